"""The fused low-bit kernels compiled ahead of time for sm_90 (H100/H200) with Triton's bundled ptxas: no stack (a
spilling kernel is bound by local memory) and at most 100 KB of shared memory, for every configuration the engine
launches on a GPU (bench/kernel_resources.py lists them). Slow: a few seconds of compilation each, in a process of
its own (the tests' processes run Triton's interpreter, which compiles nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_LIMIT = 100 * 1024


@pytest.fixture(scope="module")
def usage(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("resources")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench.kernels", "resources", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (rows,) = out.glob("sm90-triton*.jsonl")  # one file, named by the Triton that compiled it
    return [json.loads(line) for line in rows.read_text().splitlines()]


@pytest.mark.slow
def test_no_spills_and_bounded_shared_memory_on_sm90(usage):
    from bench.kernel_resources import configurations

    assert len(usage) == len(configurations())
    for row in usage:
        assert row["stack"] == 0, row
        assert row["shared"] <= SHARED_LIMIT, row
        assert row["registers"] <= 255, row
