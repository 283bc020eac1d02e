"""Smoke runs of every benchmark script on a tiny model: output schema, resumability, plots render."""

import json

import pytest
import torch

from bench import conditions, drift, fidelity, ruler, ruler_tasks, speed
from bench.common import Variant, parse_shard, read_jsonl
from bench.ruler_tasks import NOISE, TASKS, build, string_match_all
from qevict_core.testing import tiny_chat_model, tiny_tokenizer


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_builds_a_sample_whose_answers_are_in_the_prompt(task):
    sample = build(task, 200, seed=3, depth=None, essay="austen")
    assert sample.answers and sample.max_new_tokens > 0
    if TASKS[task].kind in ("niah", "vt", "cwe"):
        assert all(answer in sample.prompt for answer in sample.answers)
    assert build(task, 200, seed=3, depth=None, essay="austen") == sample  # seeded
    assert build(task, 200, seed=4, depth=None, essay="austen") != sample


def test_needle_depth_is_controlled():
    early = build("niah_single_1", 400, seed=1, depth=0.1, essay="austen")
    late = build("niah_single_1", 400, seed=1, depth=0.9, essay="austen")
    position = lambda s: s.prompt.index("One of the special magic") / len(s.prompt)  # noqa: E731
    assert position(early) < 0.2 < 0.8 < position(late)
    assert early.prompt.count(NOISE) == 400


def test_string_match_all_is_rulers_metric():
    assert string_match_all("the numbers are 123 and 456", ("123", "456")) == 1.0
    assert string_match_all("only 123", ("123", "456")) == 0.5
    assert string_match_all("ABC-def", ("abc-DEF",)) == 1.0


def test_haystack_is_sized_to_the_target_length():
    tok = tiny_tokenizer()
    sample, ids = ruler_tasks.sized_sample(tok, "niah_single_1", 1024, seed=5, depth=0.5, haystack="austen")
    assert 1024 - 200 < ids.shape[1] + sample.max_new_tokens <= 1024


def test_shard_from_flag_or_launcher(monkeypatch):
    assert parse_shard("1/4") == (1, 4)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert parse_shard(None) == (2, 3)
    with pytest.raises(ValueError, match="shard must be i/n"):
        parse_shard("5/4")


@pytest.mark.slow  # a benchmark end to end
def test_ruler_sweep_shards_resumes_and_merges(tmp_path):
    common = ["--model", "tiny", "--methods", "fullkv,qevict,snapkv", "--budgets", "0.3", "--lengths", "1024",
              "--tasks", "niah_single_1,vt", "--samples", "2", "--out", str(tmp_path)]
    ruler.main(common + ["--shard", "0/2"])
    ruler.main(common + ["--shard", "1/2"])
    rows = read_jsonl(sorted(tmp_path.glob("ruler-*.jsonl")))
    assert len(rows) == 2 * 2 * 3  # tasks x samples x lanes
    # A file per length, task and shard, each holding only its own rows.
    assert sorted(p.name for p in tmp_path.glob("ruler-*.jsonl")) == [
        f"ruler-1024-{task}-shard{i}of2.jsonl" for task in ("niah_single_1", "vt") for i in (0, 1)]
    assert all(r["task"] == "vt" and r["sample"] == 1 for r in read_jsonl([tmp_path / "ruler-1024-vt-shard1of2.jsonl"]))
    assert {"method", "budget", "task", "length", "sample", "score", "kv_ratio", "prefill_s_shared", "decode_s",
            "threads", "commit"} <= set(rows[0])
    assert all(0 <= r["score"] <= 1 and r["kv_ratio"] > 0 for r in rows)
    ruler.main(common + ["--shard", "0/2"])  # everything done: nothing appended
    assert len(read_jsonl(sorted(tmp_path.glob("ruler-*.jsonl")))) == len(rows)
    table = (tmp_path / "ruler_table.md").read_text()
    assert "qevict @30%" in table and "fullkv" in table
    fullkv_row = next(line for line in table.splitlines() if line.startswith("| fullkv "))
    assert fullkv_row.rstrip(" |").endswith("(4) | 0")  # 1K average over 2 tasks x 2 samples; no errors
    assert all(r["stop"] in ("eos", "length", "answered") and r["error"] is None for r in rows)
    qevict_row = next(line for line in table.splitlines() if line.startswith("| qevict @30% "))
    plan = next(r for r in rows if r["method"] == "qevict")
    assert qevict_row.split(" | ")[2].startswith(str(plan["k_full"]))  # the plan's capacities are printed
    assert fullkv_row.split(" | ")[2] == "—"


@pytest.mark.slow  # a benchmark end to end
def test_a_variant_is_a_method_with_changed_fields_and_a_bad_one_is_refused_before_any_run(tmp_path):
    common = ["--model", "tiny", "--budgets", "0.3", "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "2",
              "--out", str(tmp_path), "--methods", "fullkv,qevict+coverage=null,qevict+coverage=null+q_frac=0.9,qevict_head+bits=2"]
    ruler.main(common + ["--shard", "0/2"])
    ruler.main(common + ["--shard", "1/2"])
    rows = read_jsonl(sorted(tmp_path.glob("ruler-*.jsonl")))
    lanes = ("fullkv", "qevict+coverage=null", "qevict+coverage=null+q_frac=0.9", "qevict_head+bits=2")
    assert sorted((r["method"], r["sample"]) for r in rows) == sorted((v, s) for v in lanes for s in (0, 1))
    # Routed per head, its capacities count one head's windows, not the layer's.
    k_quant = {r["method"]: r["k_quant"] for r in rows}
    assert 0 < k_quant["qevict_head+bits=2"] != k_quant["qevict+coverage=null"]
    assert k_quant["qevict+coverage=null"] != k_quant["qevict+coverage=null+q_frac=0.9"]
    assert "qevict+coverage=null @30%" in (tmp_path / "ruler_table.md").read_text()
    for bad, message in [("qevict+bitz=4", "unknown config keys"), ("qevict+bits=3", "bits must be one of"),
                         ("qevictt", "unknown method"), ("qevict@gpu", "kernels must be one of"),
                         ("qevict/0", "prefill chunk")]:
        with pytest.raises(ValueError, match=message):
            ruler.main(common[:-1] + [bad])
    with pytest.raises(ValueError, match="fixes omega = 1"):
        Variant.parse("r1+omega=8").make_cache(tiny_chat_model(), 0.3, 1024)


@pytest.mark.slow  # a benchmark end to end
def test_a_crashed_generation_is_an_error_not_a_zero(tmp_path, monkeypatch):
    from qevict_core.baselines.eviction import EvictionLayer

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(EvictionLayer, "attend", broken)
    ruler.main(["--model", "tiny", "--methods", "fullkv,snapkv", "--budgets", "0.3", "--lengths", "1024",
                "--tasks", "niah_single_1", "--samples", "1", "--out", str(tmp_path)])
    rows = read_jsonl(sorted(tmp_path.glob("ruler-*.jsonl")))
    # The lanes share one forward, so the failure ends both: neither is scored.
    assert [(r["score"], r["error"]) for r in rows] == [(None, "out of memory (simulated)")] * 2
    snapkv_row = next(line for line in (tmp_path / "ruler_table.md").read_text().splitlines()
                      if line.startswith("| snapkv"))
    assert snapkv_row.rstrip(" |").endswith("— | — | 1")  # no score, no average, one error
    assert (tmp_path / "ruler_pareto.png").stat().st_size > 5000
    assert "plotly" in (tmp_path / "ruler_pareto.html").read_text()


@pytest.mark.slow  # a benchmark end to end
def test_fidelity_smoke(tmp_path):
    fidelity.main(["--model", "tiny", "--methods", "fullkv,qevict,kivi2", "--budgets", "0.3", "--prefill", "400",
                   "--steps", "12", "--passages", "2", "--out", str(tmp_path)])
    rows = read_jsonl([tmp_path / "fidelity.jsonl"])
    assert sorted(r["passage"] for r in rows) == [0, 0, 0, 1, 1, 1]
    by = {r["method"]: r for r in rows if r["passage"] == 0}
    assert by["fullkv"]["kl"] == pytest.approx(0, abs=1e-6) and by["fullkv"]["top1"] == 1.0
    assert by["qevict"]["kl"] > 0 and 0 <= by["qevict"]["top1"] <= 1 and by["qevict"]["ppl"] > 1
    assert (tmp_path / "fidelity_pareto.png").exists() and (tmp_path / "fidelity_table.md").exists()
    qevict = [r["kl"] for r in rows if r["method"] == "qevict"]
    row = next(line for line in (tmp_path / "fidelity_table.md").read_text().splitlines() if "qevict @30%" in line)
    assert f"{sum(qevict) / 2:.4f} ± " in row and " | 2 | " in row  # the mean over 2 passages and its interval


def test_fidelity_of_a_prompt_read_in_chunks():
    from qevict_core.testing import tiny_model

    model = tiny_model("llama", 2)
    tokens = torch.randint(0, 256, (1, 412), generator=torch.Generator().manual_seed(3))
    lanes = [("fullkv/96", None), ("qevict", 0.3), ("qevict/96", 0.3)]
    rows = {r["method"]: r for r in fidelity.measure(model, tokens, 400, lanes)}
    assert rows["fullkv/96"]["kl"] == pytest.approx(0, abs=1e-6)  # FullKV reads chunks exactly
    assert rows["qevict/96"]["kl"] == pytest.approx(rows["qevict"]["kl"], rel=0.05) and rows["qevict"]["kl"] > 0
    with pytest.raises(ValueError, match="cannot read a prompt in chunks"):
        fidelity.measure(model, tokens, 400, [("snapkv/96", 0.3)])


def test_fidelity_lane_with_a_config_field_changed():
    """``method+field=value`` runs the method with that field set; a field the method fixes, an unknown field and a
    method that takes no config are refused with what went wrong."""
    from qevict_core.testing import tiny_model

    model = tiny_model("llama", 2)
    tokens = torch.randint(0, 256, (1, 412), generator=torch.Generator().manual_seed(3))
    lanes = [("qevict+coverage=null", 0.3), ("qevict+bits=2+coverage=null", 0.3)]
    rows = {r["method"]: r for r in fidelity.measure(model, tokens, 400, lanes)}
    int2, int4 = rows["qevict+bits=2+coverage=null"], rows["qevict+coverage=null"]
    assert int4["k_quant"] < int2["k_quant"]  # INT4 windows cost more bytes each
    assert int4["kl"] != int2["kl"]
    for spec, message in (("qevict_head+pool=2", "qevict_head fixes pool = 1"),
                          ("qevict+colour=1", "unknown config keys"), ("qevict+pool", "must be field=value"),
                          ("kivi2+bits=4", "fixes bits = 2|takes no")):
        with pytest.raises(ValueError, match=message):
            fidelity.measure(model, tokens, 400, [(spec, 0.3)])


def test_t_interval_follows_its_definition():
    from bench.compare import interval

    # mean 2, sample sd 1, n = 3: half-width t(0.975, 2) * 1 / sqrt(3) = 4.3027 / 1.7321 = 2.484
    assert interval([1.0, 2.0, 3.0]) == "2.000 ± 2.484"
    # n = 20 passages: t(0.975, 19) = 2.093, not the normal 1.96 (sample sd of 0..19 is 5.916; / sqrt(20) = 1.323)
    assert interval([float(i) for i in range(20)]) == "9.500 ± 2.769"
    assert interval([0.5]) == "0.500" and interval([]) == "—"


@pytest.mark.slow  # renders every committed folder
def test_report_renders_every_fidelity_folder(tmp_path):
    from bench import report

    def row(method, budget, kl, passage):
        return {"method": method, "budget": budget, "kl": kl, "top1": 1 - kl, "ppl": 30 + kl, "ppl_fullkv": 30.0,
                "kv_ratio": budget or 1.0, "passage": passage}

    for folder, kl in (("fidelity", 0.25), ("fidelity_other", 0.5)):
        (tmp_path / folder).mkdir()
        rows = [row("fullkv", None, 0.0, 0), row("qevict", 0.1, kl, 0)]
        (tmp_path / folder / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "speed").mkdir()  # a folder with neither kind of JSONL is left alone
    report.main(["--results", str(tmp_path)])
    assert "| qevict @10% | 0.100 | — | 1 | 0.2500 |" in (tmp_path / "fidelity" / "fidelity_table.md").read_text()
    assert "| qevict @10% | 0.100 | — | 1 | 0.5000 |" in (tmp_path / "fidelity_other" / "fidelity_table.md").read_text()
    assert list((tmp_path / "speed").iterdir()) == []
    # Unchanged results render to unchanged files, so a re-render touches nothing in git.
    first = {f: f.read_bytes() for f in tmp_path.rglob("fidelity_pareto.*")}
    report.main(["--results", str(tmp_path)])
    assert len(first) == 4 and all(f.read_bytes() == data for f, data in first.items())


@pytest.mark.slow  # a benchmark end to end
def test_drift_bins_per_passage_and_resumes(tmp_path):
    args = ["--model", "tiny", "--methods", "fullkv,streamingllm,qevict", "--budgets", "0.25", "--prefill", "300",
            "--steps", "64", "--passages", "2", "--bin", "16", "--out", str(tmp_path)]
    drift.main(args)
    rows = read_jsonl([tmp_path / "drift.jsonl"])
    assert sorted({r["passage"] for r in rows}) == [0, 1] and len(rows) == 6
    by = {(r["method"], r["passage"]): r for r in rows}
    full = by[("fullkv", 0)]
    assert len(full["kl_bins"]) == 4 and max(full["kl_bins"]) == pytest.approx(0, abs=1e-6)
    assert full["top1_bins"] == [1.0] * 4 and full["kl_slope_per_1k"] == pytest.approx(0, abs=1e-5)
    assert all(v > 0 for v in by[("streamingllm", 0)]["kl_bins"])
    table = (tmp_path / "drift_table.md").read_text()
    assert "streamingllm @25%" in table and "KL 48–64" in table and (tmp_path / "drift.png").stat().st_size > 0
    drift.main(args)  # both passages are in the file: nothing runs again
    assert len(read_jsonl([tmp_path / "drift.jsonl"])) == 6


def test_drift_slope_and_growth_follow_their_definitions():
    row = drift.summarise({"kl_steps": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], "top1_steps": [1.0] * 8}, 4)
    assert row["kl_bins"] == pytest.approx([0.25, 0.65]) and row["top1_bins"] == [1.0, 1.0]
    assert row["kl_slope_per_1k"] == pytest.approx(100.0)  # 0.1 per position
    assert row["kl_growth"] == pytest.approx(0.75 / 0.15)


@pytest.mark.slow  # a benchmark end to end
def test_diagnostics_smoke(tmp_path):
    conditions.main(["--model", "tiny", "--prefill", "256", "--generate", "48", "--articles", "1",
                      "--budget", "0.5", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "diagnostics.json").read_text())
    r3 = result["conditions"]["R3"]
    assert r3["k_quant"] > 0 and 0 <= r3["fmm"] <= 1 and r3["fmm_fp_only"] >= r3["fmm"]
    assert abs(sum(r3["tier_mass"].values()) - 1) < 1e-6 and r3["qsa"] is not None
    assert set(result["conditions"]["R1"]["lagged"]) == {str(d) for d in range(1, 9)}
    assert r3["qsa_decode"] is not None and r3["r_q_decode"] is not None
    # The ablation runs at R3's capacities; QEvict's default (INT4, coverage first) is diagnosed beside the
    # paper's preset, with more low-bit windows than full ones.
    nopromo = result["conditions"]["R3 no promotion"]
    assert (nopromo["k_full"], nopromo["k_quant"]) == (r3["k_full"], r3["k_quant"])
    default = result["conditions"]["QEvict default"]
    assert default["k_quant"] > default["k_full"] and abs(sum(default["tier_mass"].values()) - 1) < 1e-6
    for name in ("fmm_curve.png", "fmm_curve.html", "tier_mass.png", "diagnostics_table.md"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.slow  # a benchmark end to end in subprocesses: ~20 s
def test_speed_smoke(tmp_path):
    speed.main(["--model", "tiny", "--methods", "fullkv,qevict,qevict@torch,qevict/128", "--contexts", "512",
                "--new-tokens", "12", "--repeats", "1", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.jsonl")
    rows = {r["method"]: r for r in read_jsonl([path])}
    assert rows["fullkv"]["tpot_vs_fullkv"] == 1.0
    assert rows["qevict"]["kv_bytes"] < rows["fullkv"]["kv_bytes"] and rows["qevict"]["ttft"] > 0
    assert {r["kv_dtype"] for r in rows.values()} == {"bfloat16"}  # what the caches stored, for the table's footing
    # the path changes time, not the tiers' bytes; the PyTorch path's steps count on the device (two counters a layer)
    layers = speed.load("tiny", "cpu", 1)[0].config.num_hidden_layers
    assert rows["qevict@torch"]["kv_bytes"] == rows["qevict"]["kv_bytes"] + 16 * layers
    assert rows["qevict/128"]["kv_bytes"] == rows["qevict"]["kv_bytes"]  # so does reading the prompt in chunks
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| 512 | qevict |" in table and "| 512 | qevict@torch |" in table
    # 11 decode steps at Ω = 8 include one routing event: its overhead is measured and reported
    assert "routing_share" in rows["qevict"] and "routing_share" not in rows["fullkv"]
    with pytest.raises(ValueError, match="kernels must be one of"):
        speed.main(["--model", "tiny", "--methods", "qevict@gpu", "--contexts", "512", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="whole number of tokens"):
        speed.main(["--model", "tiny", "--methods", "qevict/0", "--contexts", "512", "--out", str(tmp_path)])


@pytest.mark.slow  # a benchmark end to end
def test_tpot_side_by_side_smoke(tmp_path):
    from bench import tpot

    tpot.main(["--model", "tiny", "--methods", "fullkv,qevict,qevict_head", "--baseline", "qevict", "--contexts",
               "512", "--new-tokens", "18", "--rounds", "2", "--out", str(tmp_path)])
    rows = {r["method"]: r for r in read_jsonl(list(tmp_path.glob("*.jsonl")))}
    assert rows["qevict"]["tpot_vs_baseline"] == 1.0 and rows["qevict"]["rounds"] == 2
    assert rows["qevict_head"]["tpot"] > 0 and rows["qevict_head"]["tpot_vs_baseline_min"] <= \
        rows["qevict_head"]["tpot_vs_baseline"] <= rows["qevict_head"]["tpot_vs_baseline_max"]
    # 17 steps at Ω = 8 hold two routing events: both QEvict lanes report one, FullKV none
    assert "routing_extra" in rows["qevict_head"] and "routing_extra" not in rows["fullkv"]
    assert {r["kv_dtype"] for r in rows.values()} == {"bfloat16"}  # every lane says what it stored (the default)
    assert "| 512 | qevict_head |" in next(tmp_path.glob("*.md")).read_text()
    with pytest.raises(ValueError, match=r"--baseline must be one of --methods \['fullkv'\]"):
        tpot.main(["--model", "tiny", "--methods", "fullkv", "--baseline", "qevict", "--out", str(tmp_path)])


def test_peak_rss_sees_a_buffer_freed_before_the_end():
    import torch

    with speed.PeakRSS() as rss:
        buffer = torch.ones(64 * 2**20 // 4)  # 64 MiB, written, then freed inside the block
        del buffer
    assert rss._thread is None  # the kernel's high-water mark, no sampling thread (Linux)
    assert 60 * 2**20 <= rss.peak <= 120 * 2**20


@pytest.mark.slow  # a benchmark end to end
def test_speed_under_a_fixed_mmap_threshold_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "0")  # recorded, so the value the run sets is undone afterwards
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    speed.main(["--model", "tiny", "--methods", "fullkv", "--contexts", "256", "--new-tokens", "4", "--repeats", "1",
                "--mmap-threshold", "131072", "--out", str(tmp_path)])
    (row,) = read_jsonl(list(tmp_path.glob("*.jsonl")))
    assert row["mmap_threshold"] == 131072 and row["peak_memory"] > 0
    assert "MALLOC_MMAP_THRESHOLD_=131072 in every run" in next(tmp_path.glob("*.md")).read_text()


@pytest.mark.slow  # a benchmark end to end
def test_kernel_microbenchmark_smoke(tmp_path):
    from bench import kernels

    kernels.main(["attention", "--device", "cpu", "--keys", "512", "--batch", "1", "--repeats", "1",
                  "--out", str(tmp_path)])
    rows = read_jsonl(list(tmp_path.glob("*.jsonl")))
    assert {r["impl"] for r in rows} == {"fused", "old_kernel", "dequant+sdpa", "sdpa_bf16"}
    by = {r["impl"]: r for r in rows}
    assert by["fused"]["bytes"] < by["sdpa_bf16"]["bytes"] / 2  # INT4 codes + scales vs fp32 keys and values


def test_cpu_kernel_microbenchmark_times_every_pair_dtype_against_float32(capsys):
    from bench import kernels
    from qevict_kernels import cpu_decode

    if cpu_decode.available() is not None:
        pytest.skip(f"the C kernel did not build: {cpu_decode.available()}")
    timings = kernels.c_measure(windows=5, heads=2, rows=3, dim=64, omega=8, bits=2, repeats=1, calls=2)
    assert set(timings) == {"float32", "float16", "bfloat16"}
    assert all(t > 0 for pair in timings.values() for t in pair)
    kernels.main(["c", "--windows", "5", "--heads", "2", "--repeats", "1", "--calls", "2"])
    out = capsys.readouterr().out
    assert "5 windows x 2 KV heads" in out and "float32   quant_logits" in out and "(1.00x)" in out


def test_a_passage_past_the_end_of_the_text_is_refused_before_anything_runs(smollm2):
    _, tokenizer = smollm2
    with pytest.raises(ValueError, match=r"from sentence 2800 has only 0 tokens, 100 needed .*lower --offset"):
        fidelity.passage_tokens(tokenizer, 100, [0, 2800], tiny=False)
    assert fidelity.passage_tokens(tokenizer, 100, [0, 700], tiny=False)[700].shape == (1, 100)


@pytest.mark.slow  # a benchmark end to end
def test_studio_latency_runs_each_example_at_its_own_settings():
    """bench.studio_latency times an example as the picker fills the form: the promotion example at its budget."""
    from bench.studio_latency import measure
    from qevict_core import QEvictConfig
    from storage import SessionStore, make_engine
    from tests.conftest import tiny_chat_model, tiny_tokenizer
    from ui.control import TabRuns
    from ui.run_tab import RunHandlers
    from ui.studio import Studio

    handlers = RunHandlers(Studio(tiny_chat_model(), tiny_tokenizer(), SessionStore(make_engine("sqlite://")), "tiny"),
                           TabRuns())
    example = handlers.pick_example("A window demoted, then promoted back")
    example.max_new_tokens = 4
    row = measure(handlers, example)
    assert row["status"].startswith("**Done") and row["first_token_s"] <= row["total_s"]
    assert set(row["found"]) == {"fullkv", "snapkv", "qevict"}
    assert row["kv_percent"]["qevict"] <= 100 * example.budget + 0.05  # at the example's 40%, not the form's 20%
    assert row["kv_percent"]["qevict"] > 100 * QEvictConfig().budget
    assert isinstance(row["session"], str)  # the run's session, for "Time the lanes alone"


@pytest.mark.slow  # a benchmark end to end
def test_studio_latency_presses_time_the_lanes_alone_after_a_run(tmp_path, monkeypatch):
    """--time-lanes: each example run once, then its "Time the lanes alone" pressed per round, one row per press with
    every lane's time per token and its ratio to the FullKV lane; the table renders from those rows."""
    from bench import studio_latency
    from tests.conftest import tiny_chat_model, tiny_tokenizer

    monkeypatch.setattr(studio_latency, "setup", lambda *a: (tiny_chat_model(), tiny_tokenizer(), {
        "model": "tiny", "cpu": "x86", "threads": 1, "date": "today", "commit": "abc", "dirty": False}))
    monkeypatch.setattr("ui.studio.Studio.time_lanes.__defaults__", (3, 1))  # 3 new tokens, 1 round: a smoke run
    studio_latency.main(["--time-lanes", "--rounds", "2", "--examples", "A window demoted, then promoted back",
                         "--out", str(tmp_path)])
    rows = read_jsonl([tmp_path / "studio_lanes.jsonl"])
    known = {"A window demoted, then promoted back": 1, "Two facts": 2}
    assert studio_latency.example_names("A window demoted, then promoted back,Nope,Two facts", known) == [
        "A window demoted, then promoted back", "Nope", "Two facts"]
    assert studio_latency.example_names("A window demoted", known) == ["A window demoted"]  # unknown, as written
    assert [r["press"] for r in rows] == [0, 1] and set(rows[0]["lanes"]) == {"fullkv", "snapkv", "qevict"}
    assert rows[0]["baseline"] == "fullkv" and rows[0]["lanes"]["fullkv"]["ratio"] == 1.0
    assert all(lane["tpot"] > 0 for r in rows for lane in r["lanes"].values())
    table = studio_latency.lanes_table(rows)
    assert "| abc | A window demoted, then promoted back |" in table and table.count("| 2 | qevict |") == 1


def test_a_ruler_sweep_cut_short_covers_every_task_and_shards_split_it():
    from bench.ruler import sweep

    tasks = ["a", "b", "c", "d"]
    shards = [sweep([2048, 4096], tasks, 5, i, 2) for i in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted((n, t, s) for n in (2048, 4096) for t in tasks for s in range(5))
    for i, items in enumerate(shards):  # either shard's first four items: one sample of every task, not four of one
        assert [(t, s) for _, t, s in items[:4]] == [(t, i) for t in tasks]
