"""The command line refuses every bad argument before a model loads: one line on stderr, exit code 2, no
traceback; ``--help`` lists the choices. (SmolLM2 runs in tests/test_smollm2.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A model that cannot load: any refusal below comes before the model would (or the test sees the model's error).
NO_MODEL = ["--model", "/nonexistent/model"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qevict_core", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "Hi", "--budget", "2"], r"--budget must be a number in (0, 1] (got 2.0)"),
    (["--prompt", "Hi", "--budget", "x"], "argument --budget: must be a number in (0, 1] (got 'x')"),
    (["--prompt", "Hi", "--bits", "3"], "--bits must be one of (2, 4) (got 3)"),
    (["--prompt", "Hi", "--scale-dtype", "float8"], "--scale-dtype must be one of ('model', 'float16', 'bfloat16')"),
    (["--prompt", "Hi", "--coverage", "1.5"], "--coverage must be None (split by q_frac) or a number in (0, 1]"),
    (["--prompt", "Hi", "--pool", "-1"], "--pool must be an integer >= 0 (got -1)"),
    (["--prompt", "Hi", "--scorer", "keynorm"], "--pool needs an attention scorer"),
    (["--prompt", "Hi", "--method", "nope"], "argument --method: invalid choice: 'nope'"),
    (["--prompt", "Hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1 (got 0)"),
    (["--prompt", "Hi", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: No such file or directory"),
])
def test_a_bad_argument_is_one_line_before_the_model_loads(args, message, capsys):
    from qevict_core.cli import main

    try:  # in this process (argparse exits, the rest returns the code): the subprocess tests check a real exit
        code = main(["generate", *args, *NO_MODEL])
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert message in stderr and stderr.startswith("qevict: error: ")
    assert stderr.count("\n") == 1 and "Traceback" not in stderr


def test_a_refusal_exits_2_with_one_line_from_a_real_process():
    done = cli("generate", "--prompt", "Hi", "--budget", "2", *NO_MODEL)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("qevict: error: --budget must be") and "Traceback" not in done.stderr


@pytest.mark.slow  # starts loading a model
def test_a_model_that_cannot_load_is_one_line():
    done = cli("generate", "--prompt", "Hi", *NO_MODEL)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "could not load model '/nonexistent/model'" in done.stderr and "Traceback" not in done.stderr


def test_help_lists_the_choices():
    done = cli("generate", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for shown in ("{2,4}", "{cumulative,decay,keynorm,pnorm}", "{model,float16,bfloat16}", "fullkv, qevict",
                  "--no-promotion", "(default: 0.2)"):
        assert shown in text, shown


def test_methods_lists_every_product_method():
    done = cli("methods")
    from qevict_core import list_methods

    assert done.returncode == 0
    assert [line.split()[0] for line in done.stdout.splitlines()] == list(list_methods())
