"""bench/gpu_check.sh's harness, run on the CPU with a stand-in for Python that records each step's command: the
order of the steps, the budget, a step's own limit, a rerun of chosen steps, the preflight's stop, and the one
archive a lent machine hands back. And bench/gpu_preflight.py's check of package ranges against pyproject.toml."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tarfile
import time
from importlib import metadata
from pathlib import Path

import pytest

from bench.gpu_preflight import declared, device_command, mismatches, tiny_decode

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["preflight", "graphs_8k", "tests", "kernels", "graphs_8k_b1", "speed_32k", "peak_16k", "smollm2_graphs",
         "speed_8k", "smollm2", "resources", "profile"]
# The stand-in: logs its arguments, fails or sleeps when they contain the word it is told
FAKE = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case " $* " in *" ${FAKE_FAIL:-@} "*) echo "failing as told"; exit 3 ;; esac
case " $* " in *" ${FAKE_SLOW:-@} "*) exec sleep "${FAKE_SLOW_S:-3}" ;; esac
echo "ran $*"
"""


def steps_called(log: Path) -> list[str]:
    """The stand-in's calls, less the script's probes (``-c "import xdist"``: may the tests run in parallel)."""
    return [line for line in log.read_text().splitlines() if " -c import" not in f" {line}"]


pytestmark = pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                                reason="needs coreutils' timeout and tar")


def stand_in(tmp_path: Path, **env: str) -> dict[str, str]:
    """The script's environment with the stand-in as its Python (its calls in calls.log), nothing of the caller's
    that the script reads, and ``env``."""
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    (tmp_path / "calls.log").unlink(missing_ok=True)
    read = ("OUT", "STEPS", "BUDGET_S", "MIN_STEP_S", "GPU_CHECK_DIR", "PYTHON", "QEVICT_COMMIT", "QEVICT_DIRTY")
    environ = {k: v for k, v in os.environ.items() if k not in read}
    return environ | {"PYTHON": str(fake), "FAKE_LOG": str(tmp_path / "calls.log")} | env


def run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    done = subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=ROOT, env=stand_in(tmp_path, **env),
                          capture_output=True, text=True, timeout=120)
    steps = [line.split("\t") for line in (Path(args[0]) / "steps.tsv").read_text().splitlines()[1:]] if args else []
    return done, steps


def test_every_step_runs_in_order_with_its_rows_under_the_folder(tmp_path):
    out = tmp_path / "rows"
    done, steps = run(tmp_path, str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s[0] for s in steps] == ORDER and {s[1] for s in steps} == {"ok"}
    calls = steps_called(tmp_path / "calls.log")
    assert calls[0] == "-m bench.gpu_preflight" and len(calls) == len(ORDER)
    assert calls[2].startswith("-m pytest -q -n 8")  # where xdist imports, the tests compile in 8 workers
    assert f"--out {out}/graphs" in calls[1] and "--graphs" in calls[1]  # the benchmarks write under the folder
    assert all((out / f"{name}.log").read_text().startswith("ran ") for name in ORDER)
    assert done.stdout.rstrip().splitlines()[-1].split()[0] == "profile"  # the table ends the output


def test_a_step_past_its_limit_is_cut_and_the_next_still_run(tmp_path):
    out = tmp_path / "rows"
    done, steps = run(tmp_path, str(out), FAKE_SLOW="attention", FAKE_SLOW_S="30", KERNELS_S="1")
    assert done.returncode == 0
    status = {s[0]: s[1] for s in steps}
    assert status["kernels"] == "timed out" and status["graphs_8k_b1"] == "ok" and len(steps) == len(ORDER)
    assert int(dict((s[0], s[2]) for s in steps)["kernels"]) < 20  # cut at its limit, not left to sleep
    failed, steps = run(tmp_path, str(out), FAKE_FAIL="bench.tpot")
    assert failed.returncode == 0 and {s[0]: s[1] for s in steps}["smollm2_graphs"] == "failed (exit 3)"
    assert [s[1] for s in steps].count("ok") == len(ORDER) - 1


def test_the_budget_skips_the_last_steps_not_the_call(tmp_path):
    out = tmp_path / "rows"
    # the preflight has 5 s to start the first step even on a loaded machine; that step leaves under 5 s
    done, steps = run(tmp_path, str(out), FAKE_SLOW="random:llama-8b", FAKE_SLOW_S="6", BUDGET_S="10",
                      MIN_STEP_S="5")
    assert done.returncode == 0
    assert [s[:2] for s in steps[:2]] == [["preflight", "ok"], ["graphs_8k", "ok"]]
    assert {s[1] for s in steps[2:]} == {"skipped (budget)"} and len(steps) == len(ORDER)
    assert len(steps_called(tmp_path / "calls.log")) == 2


def test_chosen_steps_rerun_after_the_preflight(tmp_path):
    done, steps = run(tmp_path, str(tmp_path / "rows"), STEPS="kernels tests")
    assert done.returncode == 0
    assert [s[0] for s in steps] == ["preflight", "tests", "kernels"]


def test_a_failed_preflight_stops_the_script(tmp_path):
    done, steps = run(tmp_path, str(tmp_path / "rows"), FAKE_FAIL="bench.gpu_preflight")
    assert done.returncode == 2 and "preflight failed" in done.stdout
    assert steps == [["preflight", "failed (exit 3)", steps[0][2], "45"]]
    assert steps_called(tmp_path / "calls.log") == ["-m bench.gpu_preflight"]


def test_on_a_lent_machine_everything_comes_back_in_one_archive(tmp_path):
    handed_back, work = tmp_path / "OUT", tmp_path / "work"
    handed_back.mkdir()
    done, _ = run(tmp_path, OUT=str(handed_back), GPU_CHECK_DIR=str(work))
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in handed_back.iterdir()] == ["gpu_check.tar.gz"]  # the machine hands back 8 files at most
    with tarfile.open(handed_back / "gpu_check.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"steps.tsv", "env.log"} | {f"{name}.log" for name in ORDER} <= names


def test_a_call_killed_mid_step_still_hands_back_the_steps_before_it(tmp_path):
    """The device tool kills a call at its limit: what the finished steps measured is already in the archive."""
    log, handed_back = tmp_path / "calls.log", tmp_path / "OUT"
    handed_back.mkdir()
    environ = stand_in(tmp_path, OUT=str(handed_back), GPU_CHECK_DIR=str(tmp_path / "work"), FAKE_SLOW="attention",
                       FAKE_SLOW_S="60")
    call = subprocess.Popen(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=environ, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and "attention" in log.read_text()):  # the kernels step has begun
        assert call.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(call.pid, signal.SIGKILL)
    call.wait()
    with tarfile.open(handed_back / "gpu_check.tar.gz") as archive:
        steps = [line.split("\t")[:2] for line in archive.extractfile("./steps.tsv").read().decode().splitlines()[1:]]
        assert "./graphs_8k.log" in archive.getnames()
    assert steps == [["preflight", "ok"], ["graphs_8k", "ok"], ["tests", "ok"]]


def test_the_archive_ends_with_the_steps_the_budget_skipped(tmp_path):
    handed_back = tmp_path / "OUT"
    handed_back.mkdir()
    done, _ = run(tmp_path, OUT=str(handed_back), GPU_CHECK_DIR=str(tmp_path / "work"), FAKE_SLOW="random:llama-8b",
                  FAKE_SLOW_S="6", BUDGET_S="10", MIN_STEP_S="5")
    assert done.returncode == 0
    with tarfile.open(handed_back / "gpu_check.tar.gz") as archive:
        steps = [line.split("\t") for line in archive.extractfile("./steps.tsv").read().decode().splitlines()[1:]]
    assert [s[0] for s in steps] == ORDER and steps[-1][1] == "skipped (budget)"


def test_the_preflight_reads_each_range_from_pyproject():
    """As the lent machines' image had it: transformers too old stops the script, tqdm too old does not."""
    requirements = declared()
    versions = {"transformers": "5.17.0", "torch": "2.11.0+cu130", "numpy": "2.5.2", "tqdm": "4.67.1"}

    def installed(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    found = mismatches(("torch", "transformers", "numpy", "tqdm", "accelerate"), requirements, installed)
    assert [(line.split()[0].rstrip(":"), fatal) for line, fatal in found] == [
        ("transformers", True), ("tqdm", False), ("accelerate", True)]
    assert "outside pyproject.toml's" in found[0][0] and "not installed" in found[2][0]
    versions["transformers"], versions["accelerate"] = "5.24.0", "1.15.0"
    assert mismatches(("torch", "transformers", "accelerate"), requirements, installed) == []


def test_the_preflights_tiny_decode_runs_where_it_is_told():
    assert tiny_decode("cpu") == {"fullkv": 24, "qevict": 24}


def test_the_device_call_installs_the_wheels_then_runs_the_script_naming_the_commit(tmp_path):
    """The command make gpu-prepare prints, run as the lent machine would (its python3 a stand-in here)."""
    command = device_command("abc1234", dirty=False)
    assert len(command) <= 2000  # the device tool's limit on a command
    (tmp_path / "python3").write_text('#!/usr/bin/env bash\necho "$QEVICT_COMMIT $*" >> "$FAKE_LOG"\n')
    (tmp_path / "python3").chmod(0o755)
    handed_back, log = tmp_path / "OUT", tmp_path / "calls.log"
    handed_back.mkdir()
    environ = stand_in(tmp_path, PATH=f"{tmp_path}:{os.environ['PATH']}", OUT=str(handed_back),
                       GPU_CHECK_DIR=str(tmp_path / "work"))
    del environ["PYTHON"]  # the script finds python3 on the PATH, as on the lent machine
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = steps_called(log)
    assert calls[0].startswith(" -m pip install") and "--target /tmp/site" in calls[0]
    assert calls[1] == "abc1234 -m bench.gpu_preflight" and len(calls) == 1 + len(ORDER)
    assert all(call.startswith("abc1234 -m ") for call in calls[1:])
    assert (handed_back / "gpu_check.tar.gz").exists()
