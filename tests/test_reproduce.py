"""Committed rows reproduce at HEAD: prompts whose rows README's and bench/README's tables render, rerun at today's
code on the footing their rows record, give the predictions and bytes stored in those rows.

The rows (bench/evaluation.md, bench/promotion.md) are rerun on the 16-bit caches they record, one thread, as the
rows say they ran: thread counts change the order of float sums (so can the lanes beside a lane: each cell is a
prompt whose answers do not turn on them). A failure here means the rows' commit no longer describes HEAD: rerun
them (bench/evaluation.md), never mix the two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.common import Variant, read_jsonl
from bench.ruler import decode_until_answered
from bench.ruler_tasks import sized_sample
from qevict_core import Lane

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
# (folder, task, sample, lanes): a 2K sample of each kind of row a table renders, with lanes it compares (the
# promotion experiment's, at a prompt where promotion changes the answer; the 16-bit evaluation's, at one where the
# default at 5% answers in another form than FullKV)
CELLS = [("promotion/ruler", "niah_single_2", 35, ["fullkv", "qevict@0.4", "qevict+promotion=false@0.4"]),
         ("eval16/ruler", "niah_single_2", 1, ["fullkv", "qevict@0.05", "qevict@0.2", "snapkv@0.2", "kivi4"])]


def stored_rows(folder: str, task: str, sample: int) -> dict:
    rows = [r for r in read_jsonl(sorted((RESULTS / folder).glob("ruler-*.jsonl")))
            if r["task"] == task and r["sample"] == sample and r["length"] == 2048]
    return {f"{r['method']}@{r['budget']}" if r["budget"] is not None else r["method"]: r for r in rows}


@pytest.mark.parametrize("folder, task, sample, lanes", CELLS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CELLS])
def test_committed_ruler_rows_reproduce_at_head(smollm2, folder, task, sample, lanes):
    model, tok = smollm2
    stored = stored_rows(folder, task, sample)
    rows = [stored[lane] for lane in lanes]
    first = rows[0]
    assert first["threads"] == 1 and len({r["kv_dtype"] for r in rows}) == 1
    kv_dtype = first["kv_dtype"]
    sample_, ids = sized_sample(tok, task, 2048, first["seed"], first["depth"], first["haystack"])
    assert ids.shape[1] == first["prompt_tokens"]
    max_length = ids.shape[1] + sample_.max_new_tokens
    made = []
    for lane in lanes:
        spec, _, budget = lane.partition("@")
        made.append(Lane(lane, Variant.parse(spec).make_cache(model, float(budget) if budget else None, max_length,
                                                              kv_dtype=kv_dtype)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode_until_answered(model, tok, ids, made, sample_)
    finally:
        torch.set_num_threads(threads)
    for lane, row in zip(made, rows):
        assert lane.text[:400] == row["prediction"], (lane.name, lane.text[:120], row["prediction"][:120])
        assert lane.cache.memory_report()["total_bytes"] == row["total_bytes"], lane.name
