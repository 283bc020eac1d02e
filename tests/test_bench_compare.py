"""The paired comparisons that the rendered tables print (bench/compare.py), pinned on hand-built rows."""

from bench.compare import ruler_headline


def _rows(method, budget, scores, length=2048):
    return [{"method": method, "budget": budget, "length": length, "task": "t", "sample": i, "score": s}
            for i, s in enumerate(scores)]


def test_headline_pairs_with_fullkv_and_the_baseline_with_the_best_mean():
    rows = (_rows("fullkv", None, [1.0] * 20) + _rows("qevict", 0.1, [1.0] * 20)
            + _rows("snapkv", 0.1, [0.0] * 20) + _rows("h2o", 0.1, [1.0] * 5 + [0.0] * 15))
    lines = ruler_headline(rows, "qevict").splitlines()
    assert len(lines) == 3  # header, rule, one budget at one length
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:4] == ["10%", "2K", "100.0", "100.0"]
    assert cells[4].startswith("+0.0 [+0.0, +0.0] (20; indistinguishable)")
    assert cells[5] == "h2o 25.0"  # the best baseline by mean, not the first listed
    assert cells[6].startswith("+75.0 [") and cells[6].endswith("(20; better)")


def test_headline_pairs_only_the_samples_both_ran():
    rows = _rows("fullkv", None, [1.0] * 10) + _rows("qevict", 0.05, [0.0] * 4) + _rows("snapkv", 0.05, [0.0] * 10)
    cells = [c.strip() for c in ruler_headline(rows, "qevict").splitlines()[2].strip("|").split("|")]
    assert cells[4].startswith("-100.0 [-100.0, -100.0] (4; worse)")
