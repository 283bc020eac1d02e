"""Every table marked in the docs is what bench.report renders from the committed rows, at the current code."""

import pytest

import json

from bench.report import DOCUMENTS, MARKER, ROOT, footing, render, rendered


@pytest.mark.parametrize("name", DOCUMENTS)
def test_marked_tables_match_a_fresh_render(name):
    path = ROOT / name
    if not path.exists():
        pytest.skip(f"{name} does not exist")
    text = path.read_text()
    assert rendered(text) == text, f"{name}: a marked table differs from the rows; run python -m bench.report"


def test_the_docs_hold_marked_tables_and_a_hand_edit_is_caught():
    text = (ROOT / "bench/choice.md").read_text()  # its first table has pass/fail cells
    marks = list(MARKER.finditer(text))
    assert len(marks) >= 2
    body = marks[0].group(4)
    edited = text.replace(body, body.replace("| pass |", "| fail |", 1), 1)
    assert edited != text and rendered(edited) == text  # the render puts the rows' value back


def test_an_unknown_kind_or_folder_is_refused_with_what_exists():
    with pytest.raises(ValueError, match="kinds: ruler, fidelity, tpot, speed, studio_latency, conditions, choice"):
        render("nonsense", "default_dev_16bit")
    with pytest.raises(ValueError, match="no results folder"):
        render("ruler", "no_such_folder")


@pytest.mark.parametrize("name, most", [("README.md", 150), ("bench/README.md", 400), ("docs/engine.md", 300), ("docs/decisions.md", 150)])
def test_the_front_pages_stay_short(name, most):
    """README: three short doors; bench/README: one page of current results (detail in per-benchmark pages);
    engine.md: how the engine works (why, in docs/decisions.md)."""
    lines = (ROOT / name).read_text().count("\n")
    assert lines < most, f"{name} has {lines} lines; move detail out (most {most})"


def test_a_tables_footing_says_what_its_rows_stored_and_whether_they_came_from_committed_code(tmp_path):
    rows = [{"kv_dtype": "bfloat16", "commit": "abc1234", "dirty": False, "device": "cpu"},
            {"kv_dtype": "bfloat16", "commit": "abc1234", "dirty": True, "device": "cpu"},
            {"commit": "0ld0ld0", "device": "cpu"}]  # before rows recorded kv_dtype: a float32 cache on a CPU
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ruler-a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = footing("run", tmp_path)
    assert line.startswith("*Caches stored in float32, the model's dtype on this CPU (rows from before 16-bit")
    assert " and bfloat16 (`kv_dtype`). Rows: 3 at commits 0ld0ld0, abc1234, 1 from a tree with uncommitted " \
           "changes.*" in line
    (tmp_path / "empty").mkdir()
    assert footing("empty", tmp_path) == ""


def test_the_conditions_run_has_a_footing_and_the_claims_read_one_run_whole(tmp_path):
    from bench.claims import Rows

    def run(folder, stored, conditions):
        folder.mkdir(parents=True)
        meta = {"commit": "abc1234", "dirty": False, "device": "cpu"}
        body = {name: {"fmm": fmm, **({"kv_dtype": stored} if stored else {})} for name, fmm in conditions.items()}
        (folder / "diagnostics.json").write_text(json.dumps({"meta": meta, "conditions": body}))

    run(tmp_path / "old" / "conditions", None, {"R1": 0.3, "R4": 0.2})  # before runs said what they stored
    run(tmp_path / "new", "bfloat16", {"R1": 0.4})
    assert footing("new", tmp_path) == "*Caches stored in bfloat16 (`kv_dtype`). Rows: 1 at commit abc1234.*"
    assert footing("old", tmp_path).startswith("*Caches stored in float32")
    assert Rows.load([tmp_path / "old", tmp_path / "new"]).conditions == {"R1": {"fmm": 0.4, "kv_dtype": "bfloat16"}}
    assert Rows.load([tmp_path / "new", tmp_path / "old"]).conditions.keys() == {"R1", "R4"}
