"""Every code block in README.md and docs/ runs in a test, as written.

A block is claimed by the line before its fence:
- nothing: a ``python`` block runs here, with the document's earlier unmarked python blocks before it (one
  process per document, the bundled model: slow); in a ``bash`` block, ``make T`` must be a target of the Makefile
  and ``qevict ...`` / ``python -m ...`` commands run here (slow);
- ``<!-- docs-test: tests/<file>.py::<test> -->``: that test runs it (it must exist and read this document);
- ``<!-- docs-test: not run: <reason> -->``: what no test machine has (a Docker engine, a Hugging Face Space).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- docs-test: (?P<claim>.*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    lang: str
    code: str
    claim: str | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}: {self.code.splitlines()[0][:60]!r}"


def blocks(doc: Path) -> list[Block]:
    return [Block(doc, m["lang"], m["code"], m["claim"]) for m in FENCE.finditer(doc.read_text())]


ALL = [b for doc in DOCS for b in blocks(doc)]


def test_every_block_is_claimed_by_something_that_runs_it():
    for block in ALL:
        assert block.lang in ("python", "bash"), f"{block.where}: a block is python or bash"
        if block.claim is None:
            continue
        if block.claim.startswith("not run: "):
            assert len(block.claim) > len("not run: ") + 10, f"{block.where}: say why it cannot run"
            continue
        path, _, name = block.claim.partition("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, f"{block.where}: {block.claim} does not exist"
        assert block.doc.name in source, f"{block.where}: {path} does not read {block.doc.name}"
    not_run = [b for b in ALL if (b.claim or "").startswith("not run")]
    assert len(not_run) <= 4, [b.where for b in not_run]


def test_every_make_target_shown_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    for block in ALL:
        if block.lang == "bash" and block.claim is None:
            for line in commands(block):
                if line[0] == "make":
                    assert line[1] in targets, f"{block.where}: make {line[1]} is not a target"


def commands(block: Block) -> list[list[str]]:
    text = block.code.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if shlex.split(line, comments=True)]


def runnable(line: list[str]) -> list[str] | None:
    """The command as this test runs it: ``qevict`` and ``python -m`` through this interpreter."""
    if line[0] == "qevict":
        return [sys.executable, "-m", "qevict_core", *line[1:]]
    if line[0].endswith("python") and line[1:2] == ["-m"]:
        return [sys.executable, *line[1:]]
    return None


SHELL = [(b, line) for b in ALL if b.lang == "bash" and b.claim is None for line in commands(b) if runnable(line)]
PYTHON_DOCS = sorted({b.doc for b in ALL if b.lang == "python" and b.claim is None})


@pytest.mark.slow
@pytest.mark.parametrize("block, line", SHELL, ids=[" ".join(line)[:60] for _, line in SHELL])
def test_the_commands_shown_run(block, line):
    done = subprocess.run(runnable(line), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, f"{block.where}: {' '.join(line)}\n{done.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", PYTHON_DOCS, ids=[d.name for d in PYTHON_DOCS])
def test_the_python_shown_runs(doc):
    """A document's unmarked python blocks, in order, in one process: each may use what the ones before made."""
    code = "\n".join(b.code for b in blocks(doc) if b.lang == "python" and b.claim is None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, f"{doc.name}:\n{done.stderr[-3000:]}"
    assert "total_bytes" in done.stdout  # every document's example prints a memory report
