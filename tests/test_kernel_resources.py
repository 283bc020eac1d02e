"""The fused low-bit kernels compiled ahead of time for sm_90 (H100/H200) with Triton's bundled ptxas: no stack (a
spilling kernel is bound by local memory) and at most 100 KB of shared memory, for every configuration the engine
launches on a GPU (bench/kernel_resources.py lists them). Slow: a few seconds of compilation each."""

import pytest

from bench.kernel_resources import compile_for_sm90, configurations

SHARED_LIMIT = 100 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("config", configurations(),
                         ids=lambda c: f"{c['kernel']}-d{c['D']}-r{c['R']}-int{c['BITS']}-{c['pair']}")
def test_no_spills_and_bounded_shared_memory_on_sm90(config):
    usage = compile_for_sm90(config)
    assert usage["stack"] == 0, usage
    assert usage["shared"] <= SHARED_LIMIT, usage
    assert usage["registers"] <= 255
