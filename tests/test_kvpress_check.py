"""bench.kvpress_check's own reading of a cache: which prompt positions each head kept, and how alike two such
readings are. (kvpress itself runs in its own environment: `make setup-kvpress`, then the benchmark.)"""

from __future__ import annotations

import pytest
import torch

from bench.kvpress_check import agreement, full_keys, kept_positions, project_side
from qevict_core.testing import tiny_model


def test_kept_keys_are_found_at_their_positions_and_a_foreign_key_is_refused():
    full = torch.randn(50, 8)
    chosen = torch.tensor([31, 2, 7, 49, 0])
    assert kept_positions(full[chosen], full) == [0, 2, 7, 31, 49]
    with pytest.raises(RuntimeError, match="no key of the prompt"):
        kept_positions(full[chosen] + 0.1, full)


def test_agreement_of_kept_sets_per_head():
    ours = [[[0, 1, 2], [0, 1]], [[4, 5], [6]]]
    theirs = [[[0, 1, 3], [0, 1]], [[4, 5], [7]]]
    got = agreement(ours, theirs)
    assert got["jaccard"] == pytest.approx((0.5 + 1 + 1 + 0) / 4)
    assert (got["jaccard_min"], got["heads_same"], got["heads"]) == (0.0, 2, 4)
    assert (got["kept_ours"], got["kept_kvpress"]) == (2.0, 2.0)


@torch.no_grad()
def test_the_project_side_reads_streamingllm_as_sinks_and_the_most_recent_tokens():
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(3, 100, (1, 120), generator=torch.Generator().manual_seed(0))
    side = project_side(model, "streamingllm", 0.3, ids, 4, set(), full_keys(model, ids))
    sinks = 5  # QEvictConfig().sinks, which StreamingLLM keeps
    for layer in side["positions"]:
        for kept in layer:
            assert kept[:sinks] == list(range(sinks))
            assert kept[sinks:] == list(range(120 - (len(kept) - sinks), 120))  # the tail, contiguous to the end
            assert 0 < len(kept) < 120
    assert len(side["tokens"]) == 4
