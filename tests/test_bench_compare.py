"""The paired comparisons that the rendered tables print (bench/compare.py), pinned on hand-built rows."""

import pytest

from bench.compare import ruler_headline


def _rows(method, budget, scores, length=2048):
    return [{"method": method, "budget": budget, "length": length, "task": "t", "sample": i, "score": s}
            for i, s in enumerate(scores)]


def test_headline_pairs_with_fullkv_and_the_baseline_with_the_best_mean():
    rows = (_rows("fullkv", None, [1.0] * 20) + _rows("qevict", 0.1, [1.0] * 20)
            + _rows("snapkv", 0.1, [0.0] * 20) + _rows("h2o", 0.1, [1.0] * 5 + [0.0] * 15))
    lines = [line for line in ruler_headline(rows, "qevict").splitlines() if line.startswith("|")]
    assert len(lines) == 3  # header, rule, one budget at one length
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:4] == ["10%", "2K", "100.0", "100.0"]
    assert cells[4].startswith("+0.0 [+0.0, +0.0] (20; indistinguishable; detects —; sign p 1)")
    assert cells[5] == "h2o 25.0"  # the best baseline by mean, not the first listed
    assert cells[6].startswith("+75.0 [") and "(20; better; detects ±" in cells[6]


def test_headline_pairs_only_the_samples_both_ran():
    rows = _rows("fullkv", None, [1.0] * 10) + _rows("qevict", 0.05, [0.0] * 4) + _rows("snapkv", 0.05, [0.0] * 10)
    cells = [c.strip() for c in ruler_headline(rows, "qevict").splitlines()[2].strip("|").split("|")]
    assert cells[4].startswith("-100.0 [-100.0, -100.0] (4; worse; detects —; sign p 0.12)")


def test_the_vllm_serving_table_pairs_scores_and_adds_qevicts_bytes_to_the_blocks():
    from bench.vllm_plugin import serve_table

    base = {"requests": 2, "length": 2048, "seed": 0, "vllm": "0.32.0", "commit": "abc", "cores": 2,
            "pool_blocks": 100, "block_bytes": 2**20, "blocks_freed": 0, "qevict_peak_bytes": 0}
    rows = [{**base, "method": "vllm", "budget": None, "scores": [1.0, 0.0], "tokens_per_second": 10.0,
             "peak_blocks": 50},
            {**base, "method": "qevict", "budget": 0.2, "scores": [1.0, 1.0], "tokens_per_second": 5.0,
             "peak_blocks": 10, "qevict_peak_bytes": 5 * 2**20, "blocks_freed": 40}]
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in serve_table(rows).splitlines() if line.startswith("| vLLM")}
    alone, qevict = lines["vLLM alone"], lines["vLLM + QEvict @20%"]
    assert alone[1] == "50.0" and qevict[1] == "100.0"
    assert qevict[2].startswith("+50.0 [") and "(2; " in qevict[2]
    assert qevict[4] == "0.50"  # tokens/s against vLLM alone
    assert qevict[6] == "15" and qevict[7] == "0.30"  # 10 blocks of 1 MiB + 5 MiB held by QEvict, over 50 MiB
    assert qevict[8] == "40"


def test_the_served_table_pairs_answers_with_vllm_alone_and_takes_medians_of_vllms_figures():
    from bench.vllm_served import table

    base = {"requests": 2, "lengths": [2048, 4096], "seed": 0, "kv_space_gib": 1.0, "vllm": "0.32.0",
            "commit": "abc", "cores": 2, "failed": 0, "peak_waiting": 0.0, "output_throughput": 10.0,
            "p50_ttft_ms": 1000.0, "p99_ttft_ms": 3000.0, "p50_tpot_ms": 50.0, "p99_tpot_ms": 90.0,
            "p50_e2el_ms": 2000.0, "p99_e2el_ms": 5000.0}
    rows = [{**base, "method": "vllm", "budget": None, "scores": [1.0, 0.0], "peak_running": 1.0,
             "peak_waiting": 1.0, "request_throughput": 0.1},
            {**base, "method": "qevict", "budget": 0.2, "scores": [1.0, 1.0], "peak_running": 2.0,
             "request_throughput": 0.2},
            {**base, "method": "qevict", "budget": 0.2, "scores": [1.0, 1.0], "peak_running": 3.0,
             "request_throughput": 0.4, "round": 1}]
    text = table(rows)
    assert "2 RULER-style prompts (2,048, 4,096 tokens, seed 0)" in text and "1 GiB KV pool" in text
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines() if line.startswith("| vLLM")}
    alone, qevict = lines["vLLM alone"], lines["vLLM + QEvict @20%"]
    assert alone[1:4] == ["50.0", "—", "1; 1"] and qevict[1] == "100.0" and qevict[2].startswith("+50.0 [")
    assert qevict[3] == "3; 0" and qevict[4] == "0.300"  # the most admitted in any round; the median requests/s
    assert qevict[6:9] == ["1.0 / 3.0", "50 / 90", "2.0 / 5.0"]


def test_drift_pairs_kl_and_slope_by_passage_with_the_lowest_kl_baseline():
    from bench.compare import drift_paired

    def rows(method, budget, kls, slopes):
        return [{"method": method, "budget": budget, "offset": 100 * i, "kl": k, "kl_slope_per_1k": s,
                 "kv_ratio": budget or 1.0} for i, (k, s) in enumerate(zip(kls, slopes))]

    table = (rows("fullkv", None, [0.0] * 3, [0.0] * 3) + rows("qevict", 0.1, [0.1, 0.2, 0.3], [0.5, 0.5, 0.5])
             + rows("h2o", 0.1, [0.4, 0.5, 0.6], [0.1, 0.1, 0.1]) + rows("snapkv", 0.1, [0.9] * 3, [0.0] * 3))
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in drift_paired(table, only=("qevict",)).splitlines() if line.startswith("| q")}
    assert list(lines) == ["qevict @10%"]  # only the methods asked for, never FullKV
    cells = lines["qevict @10%"]
    assert cells[1:4] == ["0.100", "3", "0.2000"]
    assert cells[5] == "-0.3000 [-0.3000, -0.3000] (3; better; detects —; sign p 0.25) vs h2o"  # h2o: the lowest mean KL, not snapkv
    assert cells[6] == "+0.4000 [+0.4000, +0.4000] (3; worse; detects —; sign p 0.25) vs h2o"  # the slope is paired with the same one


def test_the_studio_latency_table_takes_medians_and_counts_found_answers_per_lane():
    from bench.studio_latency import table

    meta = {"model": "m", "cpu": "x86_64", "threads": 2, "date": "2026-12-03", "commit": "abc"}
    rows = [{"example": "Needle", "round": i, "max_new_tokens": 64, "first_token_s": t, "total_s": 10 * t,
             "load_1min": load, "found": {"fullkv": True, "qevict": i == 0}, **meta}
            for i, (t, load) in enumerate([(1.0, 0.5), (3.0, 2.5), (2.0, 0.1)])]
    rows.append({**rows[0], "through": "browser", "first_token_s": 9.0, "commit": "def"})  # its own row
    rows.append({**rows[0], "busy": 2, "first_token_s": 7.0})  # the same example beside two spinning processes
    lines = table(rows).splitlines()
    assert "commit abc, def;" in lines[0]
    handlers, browser, busy = ([c.strip() for c in line.strip("|").split("|")] for line in lines[-3:])
    assert handlers == ["abc", "Needle", "handlers", "0", "64", "3", "2.0", "20.0", "2.5", "fullkv 3/3, qevict 1/3"]
    assert browser == ["def", "Needle", "browser", "0", "64", "1", "9.0", "10.0", "0.5", "fullkv 1/1, qevict 1/1"]
    assert busy == ["abc", "Needle", "handlers", "2", "64", "1", "7.0", "10.0", "0.5", "fullkv 1/1, qevict 1/1"]


def test_a_paired_comparison_says_what_it_could_detect_and_its_exact_sign_test():
    from scipy.stats import binomtest

    from bench.stats import POWER_Z, paired, paired_cell

    a = [1.0] * 10 + [0.0] * 2 + [1.0] * 28  # 40 pairs: 12 discordant, 10 one way and 2 the other
    b = [0.0] * 10 + [1.0] * 2 + [1.0] * 28
    result = paired(a, b)
    diff = [x - y for x, y in zip(a, b)]
    mean = sum(diff) / 40
    sd = (sum((d - mean) ** 2 for d in diff) / 39) ** 0.5
    assert result.detectable == pytest.approx(POWER_Z * sd / 40 ** 0.5) and POWER_Z == pytest.approx(2.8016, abs=1e-4)
    assert result.sign_p == pytest.approx(binomtest(10, 12, 0.5).pvalue)  # McNemar's exact test on 0/1 scores
    assert paired_cell(result, 100, 1, "higher").endswith(f"detects ±{100 * result.detectable:.1f}; sign p "
                                                          f"{result.sign_p:.2g})")
    same = paired([1.0, 0.0, 1.0], [1.0, 0.0, 1.0])
    assert same.detectable is None and same.sign_p == 1.0 and "detects —" in paired_cell(same, 100, 1, "higher")


@pytest.mark.parametrize("low90, high90, better, verdict", [
    (-0.02, 0.03, "higher", "equivalent within ±5"),         # both 90% bounds inside ±5 points: TOST
    (-0.04, 0.08, "higher", "no worse than −5"),             # only the lower bound clears −5
    (-0.07, 0.01, "higher", "not shown no worse than −5"),   # the lower bound reaches past −5
    (-0.08, 0.04, "lower", "no worse than −5"),              # lower is better: the upper bound is the bad side
    (-0.01, 0.06, "lower", "not shown no worse than −5"),
])
def test_no_worse_is_a_one_sided_bound_against_a_margin(low90, high90, better, verdict):
    from bench.stats import Paired

    result = Paired(0.0, low90 - 0.01, high90 + 0.01, 100, 0.2, 1.0, low90, high90)
    assert result.no_worse(5, better, scale=100) == verdict


def test_the_ninety_percent_bounds_lie_inside_the_ninety_five():
    from bench.stats import paired

    result = paired([1.0] * 30 + [0.0] * 10, [1.0] * 25 + [0.0] * 15)
    assert result.low <= result.low90 < result.mean < result.high90 <= result.high and result.low < result.high90


def test_the_headline_judges_no_worse_only_on_rows_run_after_the_margin_was_set():
    from bench.stats import MARGINS

    margin = MARGINS["ruler"]
    rows = (_rows("fullkv", None, [1.0] * 100) + _rows("qevict", 0.1, [1.0] * 99 + [0.0])
            + _rows("snapkv", 0.1, [0.0] * 100))
    before = [{**r, "time": "2026-01-01T00:00:00+00:00"} for r in rows]
    after = [{**r, "time": "2099-01-01T00:00:00+00:00"} for r in rows]
    assert not margin.judges(before) and margin.judges(after) and not margin.judges(after + [rows[0]])
    old, fresh = (ruler_headline(r, "qevict").splitlines()[2] for r in (before, after))
    assert "within ±" not in old and "no worse" not in old and "margin" not in ruler_headline(before, "qevict")
    assert "margin of 5 points" in ruler_headline(after, "qevict")
    assert f"equivalent within ±{margin.size:g}" in fresh  # one miss in 100: the 90% bounds are −3 and 0


def test_each_claim_s_verdict_follows_its_rule_on_hand_built_rows():
    from bench.claims import CLAIMS, Rows

    conditions = {"R1": {"fmm": 0.30, "churn": 0.001}, "R3": {
        "fmm": 0.15, "fmm_fp_only": 0.34, "churn": 0.006, "qsa": 0.97, "r_q": 1.03,
        "lir_policy": {"lir": 0.01}, "lir_oracle": {"lir": 0.02}},
        "R3 no promotion": {"fmm": 0.1502, "lir_policy": {"lir": 0.0}}}
    gpu = [{"method": "qevict", "device": "cuda", "context": 8192, "batch": 8, "tpot_vs_fullkv": 0.8,
            "peak_memory_vs_fullkv": 0.9}, {"method": "qevict", "device": "cuda", "context": 16384, "batch": 8,
                                            "tpot_vs_fullkv": 1.2, "peak_memory_vs_fullkv": 0.95}]
    rows = Rows(conditions, [], gpu)
    found = {claim.claim: claim.ours(rows) for claim in CLAIMS}
    by_start = {text.split(":")[0].split(" R3")[0]: verdict for text, (_, verdict) in found.items()}
    assert all(verdict == "no rows" for text, (_, verdict) in found.items() if "RULER" in text or "same two" in text
               or text.startswith("…"))  # no RULER rows
    assert by_start["Windows lower selection churn"] == "not reproduced: reversed"  # R3 0.006 above R1 0.001
    assert by_start["Windows lower FMM"] == "reproduced"
    assert by_start["Promotion lowers FMM"] == "not reproduced: unchanged"  # within 5e-4
    assert by_start["The low-bit tier lowers FMM"] == "reproduced"
    assert by_start["Low-bit scores keep the ranking"] == "reproduced"  # 0.97 >= 0.95
    assert by_start["Low-bit attention is attenuated"] == "not reproduced: above it"
    assert by_start["The deployed full tier re-enters more than the oracle's"] == "not reproduced"  # 1% < 2%
    assert by_start["Promotion makes windows re-enter"] == "reproduced"
    tpot = next(v for t, (_, v) in found.items() if t.startswith("Time per output token"))
    memory = next(v for t, (_, v) in found.items() if t.startswith("Peak GPU memory"))
    assert tpot == "not reproduced: above FullKV in 1 of 2 rows" and memory.startswith("partly")


def test_a_ruler_gap_is_consistent_when_the_paper_s_figure_lies_inside_our_interval():
    from statistics import mean

    from bench.claims import CLAIMS, PAPER_RULER_32K, Rows

    gap = mean(PAPER_RULER_32K["qevict"]) - mean(PAPER_RULER_32K["fullkv"])  # about −2.4 points
    near = [{"method": m, "budget": b, "length": 2048, "task": "t", "sample": i, "score": s}
            for i in range(100) for m, b, s in (("fullkv", None, 1.0), ("qevict_paper", 0.2, 0.0 if i < 2 else 1.0))]
    far = [{**r, "score": 0.0} if r["method"] == "qevict_paper" and r["sample"] < 40 else r for r in near]
    claim = next(c for c in CLAIMS if c.claim.startswith("RULER at 20%: QEvict close to FullKV"))
    figure, verdict = claim.ours(Rows({}, near, []))
    assert figure.startswith("2K: -2.0 [") and verdict == "consistent", (figure, gap)
    assert claim.ours(Rows({}, far, []))[1] == "differs"
    # FullKV rows of another run (other lanes beside it) on the same prompts pair with nothing: a run's lanes decode
    # together, and a lane's greedy tokens can differ with the batch beside it
    other = [{**r, "run": "other", "score": 0.0} for r in near if r["method"] == "fullkv"]
    assert claim.ours(Rows({}, [{**r, "run": "eval"} for r in near] + other, []))[0] == figure


def test_what_promotion_buys_is_paired_over_the_same_prompts_and_passages():
    from bench.claims import CLAIMS, Rows

    claim = next(c for c in CLAIMS if c.claim.startswith("What promotion buys the default"))
    ruler = [{"method": m, "budget": b, "length": 2048, "task": "t", "sample": i, "seed": 7, "score": s}
             for i in range(40) for b in (0.4, 0.5)
             for m, s in (("qevict", 1.0), ("qevict+promotion=false", 0.0 if i < 10 else 1.0))]
    # another draw's prompt under the same task and index pairs with nothing (keyed by (task, sample) alone, it
    # would replace a miss by a hit and the mean would drop)
    ruler.append({"method": "qevict+promotion=false", "budget": 0.4, "length": 2048, "task": "t", "sample": 0,
                  "seed": 8, "score": 1.0})
    fidelity = [{"method": m, "budget": 0.4, "prefill": 2048, "offset": o, "kl": kl} for o in range(10)
                for m, kl in (("qevict", 0.01), ("qevict+promotion=false", 0.02 + 0.001 * o))]
    assert claim.ours(Rows({}, [], [])) == ("—", "no rows")
    figure, verdict = claim.ours(Rows({}, ruler, [], fidelity))
    # a prompt run at two budgets is one pair (its mean over them), not two
    assert figure.startswith("RULER, mean over 40%, 50%: +25.0 [") and "(40; better;" in figure, figure
    assert "KL, mean over 40%: -0.0145 [" in figure and "(10; better;" in figure, figure
    assert verdict == "RULER better, KL better"


def test_a_prompt_at_two_budgets_is_one_pair_at_its_mean():
    from bench.stats import pooled

    five = ({"p": 1.0, "q": 0.0}, {"p": 0.0, "q": 0.0})
    ten = ({"p": 1.0, "r": 1.0}, {"p": 1.0, "r": 0.0})  # q ran at 5% only, r at 10% only
    assert pooled([five, ten]) == ([1.0, 0.0, 1.0], [0.5, 0.0, 0.0])  # p, q, r, each once
