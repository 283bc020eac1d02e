"""Measured bytes stay within the budget at every decode step, and all three tiers are used."""

import pytest
import torch

from qevict_core import BudgetRaised, BudgetTooSmall, KVShape, Lane, QEvictConfig, Sampling, generate_lanes, make_cache, plan_tiers
from qevict_core.engine.budget import quant_window_bytes
from qevict_core.engine.ledger import WindowLedger
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_equivalence import _Tok

NEW_STEPS = 40


def resident_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a layer holds, found by walking its attributes (independent of resident_bytes), through the
    engine's own objects it holds (ledgers, the per-head layers of qevict_head)."""
    found = []
    for name, value in vars(layer).items():
        if name in ("owner", "_returned_keys"):
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, WindowLedger) or type(item).__module__.startswith("qevict_core"):
                found.extend(resident_tensors(item))
    return found


def walked_bytes(cache) -> int:
    """Bytes of every storage the layers keep alive: a slice that pins its whole parent counts as the parent."""
    storages = {}
    for layer in cache.layers:
        for tensor in resident_tensors(layer):
            if tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_within_budget(method: str, model, budget: float, prompt_len: int = 1200, new: int = 300, **changes):
    """Generates ``new`` tokens and checks after every step that the measured bytes stay within the budget and
    equal a walk over the layers' tensors."""
    cache = make_cache(method, model, QEvictConfig(budget=budget, **changes), max_length=prompt_len + new)
    steps = 0
    for event in generate_lanes(model, _Tok(), random_prompt(prompt_len), [Lane(method, cache)],
                                Sampling(max_new_tokens=new)):
        if event.kind == "memory":
            steps += 1
            assert event.total_bytes <= cache.budget_bytes, f"step {event.step}: {event.total_bytes} > budget"
            assert event.total_bytes == walked_bytes(cache)
    assert steps == new
    return cache


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("budget", [0.1, 0.2])
def test_budget_holds_over_300_steps(kv_heads, budget):
    model = tiny_model("llama", kv_heads)
    cache = run_within_budget("qevict", model, budget, coverage=None)  # Eq. 3: every tier holds windows
    for tiers in cache.tier_counts():
        assert tiers["full"] > 0 and tiers["quantized"] > 0 and tiers["evicted"] > 0
    report = cache.memory_report()
    # The uncompressed prompt existed during prefill: it is reported as the peak, above the budget.
    assert report["peak_bytes"] > cache.budget_bytes >= report["total_bytes"]
    assert report["ratio"] <= budget * 1.001
    assert report["budget_ratio"] == pytest.approx(budget, rel=1e-6)
    assert sum(report["components"].values()) == report["total_bytes"]


@pytest.mark.parametrize("budget", [0.1, 0.5])
def test_coverage_first_holds_the_budget_with_and_without_a_full_tier(budget):
    cache = run_within_budget("qevict", tiny_model("llama", 2), budget)
    assert (cache.config.bits, cache.config.scale_dtype, cache.config.coverage) == (4, "float16", 0.7)
    for tiers in cache.tier_counts():
        assert tiers["quantized"] > 0 and tiers["evicted"] > 0
        # At 10% INT4 windows for 70% of the sequence do not fit, so no full window is bought; at 50% they do.
        assert (tiers["full"] > 0) == (budget == 0.5)


def test_capacities_follow_eq3():
    model = tiny_model("llama", 2)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2, q_frac=0.7, coverage=None), max_length=2000)
    plan = cache.plan
    hist = plan.budget_bytes // cache.shape.num_layers - plan.fixed_bytes
    assert plan.k_full == int(0.3 * hist // plan.full_window_bytes)
    assert plan.k_quant == int(0.7 * hist // plan.quant_window_bytes)
    assert plan.k_full * plan.full_window_bytes + plan.k_quant * plan.quant_window_bytes <= hist
    # INT2 windows are several times cheaper than full ones, so the quantized tier holds more windows.
    assert plan.k_quant > 3 * plan.k_full


def test_coverage_sizes_the_low_bit_tier_first_and_buys_full_windows_with_the_rest():
    shape, length = KVShape(30, 3, 9, 64, torch.float32), 2048  # SmolLM2-135M
    config = QEvictConfig(bits=4, scale_dtype="float16", coverage=0.8)
    for budget in (0.05, 0.1, 0.2, 0.6):
        plan = plan_tiers(shape, config.replace(budget=budget), length)
        hist = plan.budget_bytes // shape.num_layers - plan.fixed_bytes
        wanted = -(-8 * plan.num_windows // 10)  # ceil(0.8 W) without float rounding
        assert plan.k_full * plan.full_window_bytes + plan.k_quant * plan.quant_window_bytes <= hist
        if budget < 0.2:
            # Too few bytes for 80% of the windows in INT4: every historical byte goes to the low-bit tier.
            assert plan.k_full == 0 and plan.k_quant == hist // plan.quant_window_bytes < wanted
        elif budget == 0.2:
            assert plan.k_quant == wanted and plan.k_full == (hist - wanted * plan.quant_window_bytes) // \
                plan.full_window_bytes > 0
        else:
            # Bytes for more than every window: the surplus goes to full precision, as with Eq. 3.
            assert plan.k_full + plan.k_quant == plan.num_windows and plan.k_full > 0
    # 0.07 * 100 is 7.000000000000001 in floating point: still 7 windows, not 8.
    assert plan_tiers(shape, config.replace(budget=0.2, coverage=0.07), 805).k_quant == 7
    # None keeps Eq. 3's split by q_frac: the historical bytes split q : (1 - q) between the tiers.
    eq3 = plan_tiers(shape, config.replace(budget=0.1, coverage=None, q_frac=0.85), length)
    hist = eq3.budget_bytes // shape.num_layers - eq3.fixed_bytes
    assert (eq3.k_full, eq3.k_quant) == (int(0.15 * hist // eq3.full_window_bytes),
                                         int(0.85 * hist // eq3.quant_window_bytes))


def test_coverage_first_sizes_the_low_bit_tier_before_the_full_one():
    model = tiny_model("llama", 2)
    for budget in (0.1, 0.5):
        config = QEvictConfig(budget=budget)
        lane = make_cache("qevict", model, config, max_length=2000)
        half = make_cache("qevict", model, config.replace(coverage=None), max_length=2000).plan  # Eq. 3's split
        assert lane.plan.quant_window_bytes == half.quant_window_bytes
        if budget == 0.1:  # 70% of the windows do not fit in INT4: no full window, more INT4 ones than Eq. 3's
            assert lane.plan.k_full == 0 and lane.plan.k_quant > half.k_quant
        else:  # they fit: 70% of the windows in INT4, the rest of the bytes in full windows
            assert lane.plan.k_quant == 175 and lane.plan.k_full > half.k_full


def test_int4_holds_fewer_windows_than_int2():
    model = tiny_model("llama", 2)
    int2 = make_cache("qevict", model, QEvictConfig(budget=0.2, bits=2, coverage=None), max_length=2000).plan
    int4 = make_cache("qevict", model, QEvictConfig(budget=0.2, bits=4, coverage=None), max_length=2000).plan
    assert int4.quant_window_bytes > int2.quant_window_bytes
    assert int4.k_quant < int2.k_quant


def test_a_budget_that_holds_everything_runs_qevict_as_fullkv():
    """The studio's short prompts at budget 1.0: QEvict (and its ablations) give FullKV's tokens at FullKV's bytes."""
    model = tiny_model("llama", 2)
    prompt, new = random_prompt(30), 40
    methods = ["fullkv", "qevict", "qevict_nopromo", "r1", "r2"]
    lanes = [Lane(m, make_cache(m, model, QEvictConfig(budget=1.0), max_length=30 + new)) for m in methods]
    for event in generate_lanes(model, _Tok(), prompt, lanes, Sampling(max_new_tokens=new)):
        if event.kind == "memory":
            assert event.total_bytes <= event.fullkv_bytes
        assert event.kind != "routing"
    assert all(lane.tokens == lanes[0].tokens for lane in lanes)
    for lane in lanes[1:]:
        assert lane.cache.summary()["uncompressed"]
        assert all(t["quantized"] == t["evicted"] == 0 for t in lane.cache.tier_counts())


@pytest.mark.parametrize("method", ["qevict", "r1", "snapkv", "h2o", "streamingllm", "adakv", "layer_defensivekv"])
def test_a_refused_budget_names_the_least_that_runs(method):
    """strict=True refuses a budget too small for what the method always keeps; by default make_cache runs at
    that least budget instead, with a BudgetRaised warning that says the ratio."""
    model = tiny_model("llama", 2)
    with pytest.raises(BudgetTooSmall) as refused:
        make_cache(method, model, QEvictConfig(budget=0.01), max_length=120, strict=True)
    needed = refused.value.needed_bytes
    cache = make_cache(method, model, QEvictConfig(budget_bytes=needed), max_length=120, strict=True)
    assert cache.budget_bytes == needed <= cache.shape.fullkv_bytes(120) and cache.fitted is None
    with pytest.raises(BudgetTooSmall):
        make_cache(method, model, QEvictConfig(budget_bytes=needed - model.config.num_hidden_layers), max_length=120,
                   strict=True)
    with pytest.warns(BudgetRaised, match=rf"{method} runs at \d+\.\d% of FullKV's bytes, not 1\.0%") as caught:
        fitted = make_cache(method, model, QEvictConfig(budget=0.01), max_length=120)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert fitted.budget_bytes == needed and fitted.fitted.needed_bytes == needed
    assert fitted.fitted.ratio == pytest.approx(needed / fitted.shape.fullkv_bytes(120))
    cache = fitted
    lane = Lane(method, cache)
    for event in generate_lanes(model, _Tok(), random_prompt(100), [lane], Sampling(max_new_tokens=20)):
        if event.kind == "memory":
            assert event.total_bytes <= needed
    assert lane.done == "length"


def test_a_sequence_shorter_than_a_policys_window_is_not_refused():
    model = tiny_model("llama", 2)
    cache = make_cache("snapkv", model, QEvictConfig(budget=1.0), max_length=20)  # SnapKV's window is 32
    lane = Lane("snapkv", cache)
    list(generate_lanes(model, _Tok(), random_prompt(10), [lane], Sampling(max_new_tokens=10)))
    assert cache.summary()["evictions"] == 0 and len(lane.tokens) == 10


LLAMA_8B = KVShape(num_layers=32, num_kv_heads=8, num_q_heads=32, head_dim=128, dtype=torch.bfloat16)


def test_the_paper_preset_is_the_paper_taken_literally():
    paper, default = QEvictConfig.paper(), QEvictConfig()
    assert (paper.bits, paper.scale_dtype, paper.q_frac, paper.coverage, paper.pool, paper.prefill_window) == \
        (2, "model", 0.70, None, 0, 0)
    assert (default.bits, default.scale_dtype, default.coverage, default.pool, default.prefill_window) == \
        (4, "float16", 0.7, 1, 32)
    assert QEvictConfig.paper(recent=64).recent == 64
    # The registry's paper lane, which the benchmarks and the studio run, is that preset whatever the form says
    # of precision, split and pooling; the form keeps the budget, Ω, the sinks and the recent region.
    form = default.replace(bits=4, q_frac=0.5, omega=16)
    assert make_cache("qevict_paper", tiny_model("llama", 2), form, max_length=500).config == paper.replace(omega=16)


def test_int4_windows_cost_more_bytes_and_fewer_fit_the_same_budget():
    model, config = tiny_model("llama", 2), QEvictConfig(budget=0.2, scale_dtype="model", coverage=None)
    int2 = make_cache("qevict", model, config.replace(bits=2), max_length=500)
    int4 = make_cache("qevict", model, config, max_length=500)
    (p2, p4), shape = (int2.plan, int4.plan), KVShape.from_model(model, 1, config)
    assert p4.quant_window_bytes > p2.quant_window_bytes and p4.k_quant < p2.k_quant
    assert p4.budget_bytes == p2.budget_bytes
    assert p4.quant_window_bytes == quant_window_bytes(shape, config.omega, 4)


def test_half_precision_scales_halve_a_windows_parameters_and_buy_windows_only_on_a_wider_model():
    # a float32 cache (kv_dtype="model" beside a float32 model): pairs in the keys' dtype are 4 bytes
    model, default = tiny_model("llama", 2), QEvictConfig(budget=0.2, coverage=None, kv_dtype="model")
    int4 = make_cache("qevict", model, default.replace(scale_dtype="model"), max_length=500)
    half = make_cache("qevict", model, default, max_length=500)
    shape = KVShape.from_model(model, 1, default)
    # Per window: packed codes and an id, then a scale and a zero-point per key channel and per value token.
    codes = 2 * shape.num_kv_heads * default.omega * shape.head_dim * 4 // 8 + 4
    pairs = 2 * shape.num_kv_heads * (shape.head_dim + default.omega)
    assert int4.plan.quant_window_bytes == codes + 4 * pairs
    assert half.plan.quant_window_bytes == codes + 2 * pairs
    assert half.plan.k_quant > int4.plan.k_quant and half.plan.budget_bytes == int4.plan.budget_bytes
    # A bfloat16 cache (the default) already stores 2-byte pairs: float16 ones buy nothing there.
    bf16 = KVShape(2, 2, 4, 16, torch.bfloat16)
    assert plan_tiers(bf16, default.replace(scale_dtype="float16"), 500) == plan_tiers(bf16, default, 500)


def test_no_query_buffer_is_charged_and_r4_runs_at_the_papers_setting():
    # Appendix I.1: Llama-8B shapes, 768 tokens, 20%. Before scores were folded step by step, a buffer of Ω
    # queries per layer was charged and R4 (Ω = 32) could not run at all.
    r3 = plan_tiers(LLAMA_8B, QEvictConfig.paper(budget=0.2), 768)
    r4 = plan_tiers(LLAMA_8B, QEvictConfig.paper(budget=0.2, omega=32), 768)
    assert (r3.k_full, r3.k_quant) == (3, 34)
    assert (r4.k_full, r4.k_quant) == (0, 7)
    per_layer_table = 4 * r3.num_windows
    token = LLAMA_8B.token_bytes()
    assert r3.fixed_bytes == (5 + 32 + 2 * 8 - 1) * token + per_layer_table


def test_given_capacities_are_used_or_refused_with_the_missing_bytes():
    fits = plan_tiers(LLAMA_8B, QEvictConfig.paper(budget=0.2, k_full=2, k_quant=30), 768)
    assert (fits.k_full, fits.k_quant) == (2, 30)
    with pytest.raises(BudgetTooSmall) as err:  # the paper's own R4 capacities do not fit our accounting
        plan_tiers(LLAMA_8B, QEvictConfig.paper(budget=0.2, omega=32, k_full=1, k_quant=11), 768)
    message = str(err.value)
    assert "K_f=1, K_q=11 need 798869 bytes per layer but the budget gives 629145" in message
    assert "169724 bytes per layer are missing" in message
    assert err.value.needed_bytes == 798869 * 32
    with pytest.raises(ValueError, match="set together"):
        QEvictConfig(k_full=3)
    with pytest.raises(ValueError, match=r"k_quant must be None \(from the budget\) or an integer >= 0"):
        QEvictConfig(k_full=3, k_quant=-1)


def test_the_promotion_ablation_runs_at_qevicts_capacities():
    model = tiny_model("llama", 2)
    config = QEvictConfig(budget=0.2, coverage=None)  # Eq. 3 would give it more full windows
    qevict = make_cache("qevict", model, config, max_length=1000)
    nopromo = make_cache("qevict_nopromo", model, config, max_length=1000)
    assert (nopromo.plan.k_full, nopromo.plan.k_quant) == (qevict.plan.k_full, qevict.plan.k_quant)
    assert not nopromo.config.promotion and not nopromo.plan.keeps_dormant
    # Left to Eq. 3 alone it would get more full windows: none of them reserves a ledger record.
    own = plan_tiers(KVShape.from_model(model, 1, config), config.replace(promotion=False), 1000)
    assert own.k_full > qevict.plan.k_full
    decode_to_max_length(model, nopromo)
    assert nopromo.memory_report()["total_bytes"] <= nopromo.budget_bytes
    assert nopromo.summary()["promotions"] == 0


def test_scorer_and_window_ablations_run_at_qevicts_capacities_when_they_fit():
    model = tiny_model("llama", 2)
    config = QEvictConfig(budget=0.5)
    base = make_cache("qevict", model, config, max_length=1000).plan
    for scorer in ("decay", "pnorm", "keynorm"):
        cache = make_cache(f"qevict_{scorer}", model, config, max_length=1000)
        assert cache.config.scorer == scorer
        assert (cache.plan.k_full, cache.plan.k_quant) == (base.k_full, base.k_quant)
    config = config.replace(budget=0.3)  # a budget that Ω = 4 at the same tokens overflows
    base = make_cache("qevict", model, config, max_length=1000).plan
    wide = make_cache("qevict_omega16", model, config, max_length=1000)
    assert (wide.plan.k_full, wide.plan.k_quant) == (base.k_full * 8 // 16, base.k_quant * 8 // 16)
    # Ω = 4 at the same tokens needs twice the window ids, key scales and scores: more than the budget holds, so
    # it runs at its own plan for the same bytes.
    with pytest.raises(BudgetTooSmall):
        make_cache("qevict", model, config.replace(omega=4, k_full=base.k_full * 2, k_quant=base.k_quant * 2),
                   max_length=1000)
    narrow = make_cache("qevict_omega4", model, config, max_length=1000)
    own = plan_tiers(KVShape.from_model(model, 1, config), config.replace(omega=4), 1000)
    assert narrow.config.omega == 4 and (narrow.plan.k_full, narrow.plan.k_quant) == (own.k_full, own.k_quant)
    for cache in (wide, narrow):
        decode_to_max_length(model, cache)
        assert cache.memory_report()["total_bytes"] <= cache.budget_bytes


def decode_to_max_length(model, cache, length: int = 1000) -> None:
    """A random prompt, then greedy steps until the cache holds ``length`` tokens."""
    with torch.inference_mode():
        logits = model(random_prompt(length - NEW_STEPS), **{KV: cache}).logits[:, -1]
        for _ in range(NEW_STEPS):
            logits = model(logits.argmax(-1, keepdim=True), **{KV: cache}).logits[:, -1]
