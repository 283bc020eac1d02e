"""Lanes sharing a prompt forward compute an equal-input score once (qevict_core/engine/shared_work.py)."""

from __future__ import annotations

import torch

from qevict_core.engine.shared_work import shared, sharing


def test_an_equal_call_reuses_the_result_and_anything_else_computes():
    calls = []

    @shared
    def mass(keys: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(1)
        return keys.sum(dim=-1) * scale

    keys = torch.randn(2, 3, 5)
    assert torch.equal(mass(keys, 2.0), keys.sum(dim=-1) * 2.0) and len(calls) == 1  # no sharing: computes
    with sharing():
        first = mass(keys, 2.0)
        again = mass(keys.clone(), 2.0)  # an equal copy, as another lane's buffer holds it
        assert torch.equal(first, again) and again is not first and len(calls) == 2
        again.add_(1)  # the caller's copy: the kept result stays as computed
        assert torch.equal(mass(keys, 2.0), first) and len(calls) == 2
        mass(keys, 3.0)  # another argument
        keys[0, 0, 0] += 1  # the input rewritten in place after the call: not the kept one any more
        mass(keys, 2.0)
        zeros = torch.zeros(2, 3, 5)
        mass(zeros, 2.0)
        mass(-zeros, 2.0)  # -0.0 is not 0.0: compared bit for bit
        assert len(calls) == 6
    mass(keys, 2.0)
    assert len(calls) == 7  # outside the block nothing is kept
