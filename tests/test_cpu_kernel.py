"""The C decode kernel (qevict_kernels/cpu_decode.py) against its PyTorch references, and the engine on it.

Tolerances follow flash-attn's tests: the kernel's error against a float64 reference may be at most a small
multiple of the error that the same math in float32 PyTorch makes, plus a floor for values near zero.
"""

import platform

import pytest
import torch

from qevict_kernels import cpu_decode
from qevict_core import QEvictConfig, make_cache
from qevict_core.backends import choose
from tests.conftest import KV, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(cpu_decode.available() is not None,
                                reason=f"the C kernel did not build: {cpu_decode.available()}")


def ledger_inputs(batch, heads, rows, dim, windows, omega, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = windows * omega
    packed = dim * bits // 8
    codes = lambda: torch.randint(0, 256, (batch, heads, n, packed), dtype=torch.uint8, generator=g)  # noqa: E731
    ids = torch.stack([torch.randperm(windows + 7, generator=g)[:windows] for _ in range(batch)]).int()
    positions = torch.arange(5 + (windows + 7) * omega)[:, None].float()
    angle = positions / 10000 ** (torch.arange(0, dim, 2) / dim)
    angle = torch.cat([angle, angle], dim=-1)
    return dict(rows=torch.randn(batch, heads, rows, dim, generator=g), k_codes=codes(),
                k_scale=torch.rand(batch, heads, windows, dim, generator=g) / 4,
                k_zero=torch.randn(batch, heads, windows, dim, generator=g), ids=ids, cos=angle.cos() * 1.1,
                sin=angle.sin() * 1.1, sinks=5, omega=omega, bits=bits, scaling=dim ** -0.5), codes()


def assert_within_float32_error(got, reference64, reference32, factor=4.0, floor=1e-6):
    kernel_err = (got.double() - reference64).abs().max().item()
    torch_err = (reference32.double() - reference64).abs().max().item()
    assert kernel_err <= factor * torch_err + floor, (kernel_err, torch_err)


SHAPES = [  # batch, KV heads, rows (G·L), head_dim, windows, Ω, bits: constant and generic dispatches, odd sizes
    (1, 3, 3, 64, 97, 8, 2), (2, 2, 4, 64, 13, 8, 4), (1, 2, 8, 128, 205, 5, 2), (2, 1, 1, 128, 3, 1, 4),
    (1, 2, 2, 48, 41, 7, 2), (1, 1, 5, 6, 11, 3, 4),
]


@pytest.mark.parametrize("batch,heads,rows,dim,windows,omega,bits", SHAPES)
def test_quant_logits_match_the_reference(batch, heads, rows, dim, windows, omega, bits):
    args, _ = ledger_inputs(batch, heads, rows, dim, windows, omega, bits)
    got = cpu_decode.quant_logits(**args)
    assert got.shape == (batch, heads, rows, windows * omega)
    assert_within_float32_error(got, cpu_decode.quant_logits_reference(**args, dtype=torch.float64),
                                cpu_decode.quant_logits_reference(**args))


@pytest.mark.parametrize("batch,heads,rows,dim,windows,omega,bits", SHAPES)
def test_quant_values_match_the_reference(batch, heads, rows, dim, windows, omega, bits):
    args, v_codes = ledger_inputs(batch, heads, rows, dim, windows, omega, bits, seed=1)
    n = windows * omega
    # Probabilities of a softmax over [quantized | 9 more keys]: the kernel reads only the first n columns.
    probs = torch.softmax(torch.cat([cpu_decode.quant_logits(**args), torch.randn(batch, heads, rows, 9)], -1), -1)
    v_scale, v_zero = torch.rand(batch, heads, n, 1) / 4, torch.randn(batch, heads, n, 1)
    got = cpu_decode.quant_values(probs, v_codes, v_scale, v_zero, bits)
    assert got.shape == (batch, heads, rows, dim)
    assert_within_float32_error(got, cpu_decode.quant_values_reference(probs, v_codes, v_scale, v_zero, bits,
                                                                       torch.float64),
                                cpu_decode.quant_values_reference(probs, v_codes, v_scale, v_zero, bits))


VARLEN = [  # windows per head (0 = an empty tier), rows (G), head_dim, Ω, bits, extra padded columns
    ((97, 13, 0), 3, 64, 8, 2, 0), ((5, 41), 4, 64, 8, 4, 9), ((0, 0, 3), 2, 48, 7, 2, 1), ((11, 2), 5, 6, 3, 4, 0),
]


def varlen_inputs(windows, rows, dim, omega, bits, seed=0):
    """Head h's tier drawn as a one-head ledger of windows[h] windows, then every head's packed head after head
    (as qevict_head's layer keeps them) -> (logits arguments, values arguments without probs)."""
    heads = [ledger_inputs(1, 1, rows, dim, w, omega, bits, seed=seed + h) for h, w in enumerate(windows)]
    args = heads[max(range(len(windows)), key=windows.__getitem__)][0]  # cos/sin rows for every head's positions
    packed = {name: torch.cat([a[name] for a, _ in heads], dim=2) for name in ("k_codes", "k_scale", "k_zero")}
    packed["ids"] = torch.cat([a["ids"] for a, _ in heads], dim=1)
    v_codes = torch.cat([v for _, v in heads], dim=2)
    n = v_codes.shape[2]
    values = dict(v_codes=v_codes, v_scale=torch.rand(1, 1, n, 1) / 4, v_zero=torch.randn(1, 1, n, 1),
                  lengths=[w * omega for w in windows], bits=bits)
    query = torch.randn(len(windows), rows, dim, generator=torch.Generator().manual_seed(seed))
    return dict(rows=query, **packed, lengths=[w * omega for w in windows], cos=args["cos"], sin=args["sin"],
                sinks=5, omega=omega, bits=bits, scaling=dim ** -0.5), values


@pytest.mark.parametrize("windows,rows,dim,omega,bits,extra", VARLEN)
def test_varlen_heads_match_the_reference_and_pad_with_minus_infinity(windows, rows, dim, omega, bits, extra):
    args, values = varlen_inputs(windows, rows, dim, omega, bits)
    width = max(windows) * omega + extra
    got = cpu_decode.quant_logits_varlen(**args, width=width)
    assert got.shape == (len(windows), rows, width)
    for h, w in enumerate(windows):
        assert torch.isneginf(got[h, :, w * omega:]).all() and torch.isfinite(got[h, :, :w * omega]).all()
    finite = torch.isfinite(got)
    ref64 = cpu_decode.quant_logits_varlen_reference(**args, width=width, dtype=torch.float64)
    ref32 = cpu_decode.quant_logits_varlen_reference(**args, width=width)
    assert_within_float32_error(got[finite], ref64[finite], ref32[finite])
    # A softmax over [each head's quantized keys | 9 more]: the values read only each head's own columns.
    probs = torch.softmax(torch.cat([got, torch.randn(len(windows), rows, 9)], -1), -1)
    out = cpu_decode.quant_values_varlen(probs, **values)
    assert out.shape == (len(windows), rows, dim)
    assert_within_float32_error(out, cpu_decode.quant_values_varlen_reference(probs, **values, dtype=torch.float64),
                                cpu_decode.quant_values_varlen_reference(probs, **values))


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scales_read_as_their_float32_widening(param_dtype):
    """The kernel widens stored pairs exactly: the same pairs handed over as float32 give bit-identical results,
    through every entry point (subnormal float16 scales included)."""
    args, v_codes = ledger_inputs(2, 2, 3, 64, 13, 8, 4)
    narrow = {**args, "k_scale": args["k_scale"].to(param_dtype), "k_zero": args["k_zero"].to(param_dtype)}
    narrow["k_scale"][0, 0, 0, :4] = torch.tensor([1e-7, 3e-6, 0.0, 6e-5]).to(param_dtype)
    wide = {**narrow, "k_scale": narrow["k_scale"].float(), "k_zero": narrow["k_zero"].float()}
    logits = cpu_decode.quant_logits(**narrow)
    assert torch.equal(logits, cpu_decode.quant_logits(**wide))
    probs = torch.softmax(logits, -1)
    n = v_codes.shape[2]
    v_scale, v_zero = (torch.rand(2, 2, n, 1) / 4).to(param_dtype), torch.randn(2, 2, n, 1).to(param_dtype)
    assert torch.equal(cpu_decode.quant_values(probs, v_codes, v_scale, v_zero, 4),
                       cpu_decode.quant_values(probs, v_codes, v_scale.float(), v_zero.float(), 4))
    varlen, values = varlen_inputs((5, 0, 3), 3, 64, 8, 2)
    narrow = {**varlen, "k_scale": varlen["k_scale"].to(param_dtype), "k_zero": varlen["k_zero"].to(param_dtype)}
    got = cpu_decode.quant_logits_varlen(**narrow)
    assert torch.equal(got, cpu_decode.quant_logits_varlen(**{**narrow, "k_scale": narrow["k_scale"].float(),
                                                              "k_zero": narrow["k_zero"].float()}))
    probs = torch.softmax(got, -1)
    narrow = {**values, "v_scale": values["v_scale"].to(param_dtype), "v_zero": values["v_zero"].to(param_dtype)}
    assert torch.equal(cpu_decode.quant_values_varlen(probs, **narrow),
                       cpu_decode.quant_values_varlen(probs, **{**narrow, "v_scale": narrow["v_scale"].float(),
                                                                "v_zero": narrow["v_zero"].float()}))


def test_the_bit_arithmetic_widening_reads_float16_as_the_compilers_does(monkeypatch):
    """Compilers without _Float16 widen float16 pairs with bit arithmetic: the same results, subnormals included."""
    args, _ = ledger_inputs(1, 2, 3, 64, 13, 8, 4)
    narrow = {**args, "k_scale": args["k_scale"].half(), "k_zero": args["k_zero"].half()}
    narrow["k_scale"][0, 0, 0, :4] = torch.tensor([1e-7, 3e-6, 0.0, 6e-5]).half()
    narrow["k_zero"][0, 1, 2, :3] = torch.tensor([-0.0, -3e-7, 6.5e4]).half()
    expected = cpu_decode.quant_logits(**narrow)
    bitwise = cpu_decode.build(cpu_decode.FLAGS + ("-DQEVICT_BITWISE_HALF",))
    monkeypatch.setattr(cpu_decode, "_library", lambda: bitwise)
    assert torch.equal(cpu_decode.quant_logits(**narrow), expected)
    assert torch.equal(cpu_decode.quant_logits(**{**narrow, "k_scale": narrow["k_scale"].float(),
                                                  "k_zero": narrow["k_zero"].float()}), expected)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-march=x86-64 names an x86 target")
def test_the_portable_bodies_match_the_reference_where_the_compiler_has_no_avx2(monkeypatch):
    """The kernel built for a CPU without AVX2 runs its generic bodies on SmolLM2's shapes (head_dim 64, INT2 and
    INT4): the same results as the reference, to float32 rounding."""
    portable = cpu_decode.build(tuple(f for f in cpu_decode.FLAGS if not f.startswith("-march")) + ("-march=x86-64",))
    monkeypatch.setattr(cpu_decode, "_library", lambda: portable)
    for bits in (2, 4):
        args, v_codes = ledger_inputs(1, 3, 3, 64, 29, 8, bits)
        assert_within_float32_error(cpu_decode.quant_logits(**args),
                                    cpu_decode.quant_logits_reference(**args, dtype=torch.float64),
                                    cpu_decode.quant_logits_reference(**args))
        probs = torch.softmax(torch.randn(1, 3, 3, v_codes.shape[2] + 5), -1)
        v_scale, v_zero = torch.rand(1, 3, v_codes.shape[2], 1) / 4, torch.randn(1, 3, v_codes.shape[2], 1)
        assert_within_float32_error(cpu_decode.quant_values(probs, v_codes, v_scale, v_zero, bits),
                                    cpu_decode.quant_values_reference(probs, v_codes, v_scale, v_zero, bits,
                                                                      dtype=torch.float64),
                                    cpu_decode.quant_values_reference(probs, v_codes, v_scale, v_zero, bits))


FOLDS = [  # quantized windows per head, full windows per head, recent keys, rows (G), Ω, sinks
    ((97, 13, 0), (5, 0, 9), 37, 3, 8, 5), ((4, 4), (2, 2), 8, 1, 8, 4), ((0, 0, 3), (1, 3, 0), 1, 5, 7, 0),
]


@pytest.mark.parametrize("n_q,n_f,recent,rows,omega,sinks", FOLDS)
def test_fold_varlen_adds_each_heads_window_masses_to_its_row(n_q, n_f, recent, rows, omega, sinks):
    """Random probabilities in qevict_head's decode layout (padded quantized part, sinks, full windows, recent keys,
    padding): the C fold adds what the PyTorch reference adds, and nothing lands outside the heads' windows."""
    g = torch.Generator().manual_seed(sum(n_q) + recent)
    heads, windows = len(n_q), 400
    width_q = max(n_q) * omega
    stride = width_q + sinks + max(n_f) * omega + recent + 11  # 11 padded columns after the longest head
    probs = torch.rand(heads, rows, stride, generator=g)
    ids = [torch.randperm(windows - 10, generator=g)[:q + f].to(torch.int32) for q, f in zip(n_q, n_f)]
    q_ids = [i[:q].unsqueeze(0) for i, q in zip(ids, n_q)]  # as the heads keep them: (1, n) rows
    f_ids = [i[q:].unsqueeze(0) for i, q in zip(ids, n_q)]
    args = dict(q_ids=q_ids, f_ids=f_ids, width_q=width_q, sinks=sinks, first_recent=windows - 10, recent=recent,
                omega=omega)
    table = torch.rand(heads, windows, generator=g)
    expected64 = cpu_decode.fold_varlen_reference(probs, table, **args, dtype=torch.float64)
    expected32 = cpu_decode.fold_varlen_reference(probs, table, **args)
    got = table.clone()
    cpu_decode.fold_varlen(probs, got, **args)
    assert_within_float32_error(got, expected64, expected32)
    touched = (got != table).sum(dim=1).tolist()
    assert touched == [q + f + -(-recent // omega) for q, f in zip(n_q, n_f)]


def test_fold_varlen_refuses_what_does_not_fit():
    probs, table = torch.rand(2, 3, 40), torch.zeros(2, 50)
    ids = [torch.tensor([[3, 4]], dtype=torch.int32), torch.tensor([[5, 60]], dtype=torch.int32)]
    none = [torch.zeros(1, 0, dtype=torch.int32)] * 2
    with pytest.raises(ValueError, match=r"a window id is outside \[0, 50\)"):
        cpu_decode.fold_varlen(probs, table, none, ids, 0, 5, 10, 3, 8)
    with pytest.raises(ValueError, match="need more than the 40 probability columns"):
        cpu_decode.fold_varlen(probs, table, none, none, 0, 5, 10, 36, 8)
    with pytest.raises(ValueError, match="one table row and one pair of id lists per head"):
        cpu_decode.fold_varlen(probs, table[:1], none, none, 0, 5, 10, 3, 8)
    with pytest.raises(ValueError, match=r"Ω must lie in \[1, 256\] \(got 300\)"):
        cpu_decode.fold_varlen(probs, table, none, none, 0, 5, 0, 3, 300)
    with pytest.raises(ValueError, match="table must be a contiguous CPU float32 tensor"):
        cpu_decode.fold_varlen(probs, table.double(), none, none, 0, 5, 10, 3, 8)
    assert not table.any()  # nothing was added by a refused call


def test_varlen_refuses_a_tier_that_does_not_fit():
    args, values = varlen_inputs((4, 2), 3, 64, 8, 2)
    with pytest.raises(ValueError, match="width must be at least the longest tier, 32 keys"):
        cpu_decode.quant_logits_varlen(**args, width=31)
    with pytest.raises(ValueError, match="one length per head: 2 heads, 1 lengths"):
        cpu_decode.quant_logits_varlen(**{**args, "lengths": [32]})
    with pytest.raises(ValueError, match="head 1's tier must hold whole windows of Ω = 8 keys"):
        cpu_decode.quant_logits_varlen(**{**args, "lengths": [32, 12]})
    with pytest.raises(ValueError, match="k_codes must hold 640 elements for the heads' lengths"):
        cpu_decode.quant_logits_varlen(**{**args, "lengths": [32, 8]})  # the packed tensors hold 48 keys
    with pytest.raises(ValueError, match="need as many probability columns \\(got 16\\)"):
        cpu_decode.quant_values_varlen(torch.rand(2, 3, 16), **values)
    with pytest.raises(ValueError, match="v_scale must hold 48 elements"):
        cpu_decode.quant_values_varlen(torch.rand(2, 3, 40), **{**values, "v_scale": values["v_scale"][..., :47, :]})


def test_threads_split_heads_without_changing_results(monkeypatch):
    args, _ = ledger_inputs(4, 6, 3, 64, 120, 8, 2)  # 24 heads of 960 keys: enough work to split
    pools = []
    monkeypatch.setattr(cpu_decode, "_pool", lambda workers, _pool=cpu_decode._pool: pools.append(workers) or
                        _pool(workers))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.quant_logits(**args)
        torch.set_num_threads(4)
        many = cpu_decode.quant_logits(**args)
    finally:
        torch.set_num_threads(threads)
    assert pools == [2] and torch.equal(one, many)


def test_a_small_step_runs_on_the_calling_thread(monkeypatch):
    """Three heads of 1,440 keys (SmolLM2 at 2K, one row): a thread hand-off costs more than it saves."""
    args, _ = ledger_inputs(1, 3, 3, 64, 45, 32, 4)
    monkeypatch.setattr(cpu_decode, "_pool", lambda workers: pytest.fail("a small call went to the thread pool"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_decode.quant_logits(**args)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_say_what_is_allowed():
    args, _ = ledger_inputs(1, 1, 1, 64, 4, 8, 2)
    with pytest.raises(ValueError, match="rows must be a CPU torch.float32 tensor"):
        cpu_decode.quant_logits(**{**args, "rows": args["rows"].double()})
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4\)"):
        cpu_decode.quant_logits(**{**args, "bits": 8})
    with pytest.raises(ValueError, match="not a multiple of Ω = 5"):
        cpu_decode.quant_logits(**{**args, "omega": 5})
    with pytest.raises(ValueError, match=r"scales and zero-points must be one of \(torch.float32, torch.float16, "
                                         r"torch.bfloat16\)"):
        cpu_decode.quant_logits(**{**args, "k_scale": args["k_scale"].double()})
    with pytest.raises(ValueError, match="k_zero must be a CPU torch.float16 tensor"):
        cpu_decode.quant_logits(**{**args, "k_scale": args["k_scale"].half()})


def test_the_library_is_built_once_per_machine_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVICT_CACHE_DIR", str(tmp_path))
    cpu_decode._forget()
    try:
        assert cpu_decode.available() is None
        (built,) = (tmp_path / "kernels").glob("quant_decode-*.so")
        stamp = built.stat().st_mtime_ns
        cpu_decode._forget()  # a new process: loads the library, does not build it again
        assert cpu_decode.available() is None and built.stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        cpu_decode._forget()


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("QEVICT_CACHE_DIR", "/nonexistent/cache")
    cpu_decode._forget()
    try:
        assert choose("auto", torch.device("cpu"), torch.float32).name == "torch"
        with pytest.raises(ValueError, match="no C compiler found"):
            choose("cpu", torch.device("cpu"), torch.float32)
    finally:
        monkeypatch.undo()
        cpu_decode._forget()
    assert choose("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert choose("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
    # On CUDA auto keeps PyTorch: the Triton path decoded slower on the one GPU measured (bench/README.md, "GPU").
    assert choose("auto", torch.device("cuda"), torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="float32"):
        choose("cpu", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2), ("mistral", 1)])
@pytest.mark.parametrize("bits", [2, 4])
def test_the_cpu_kernel_generates_the_torch_paths_tokens(family, kv_heads, bits):
    model = tiny_model(family, kv_heads)
    prompt = torch.cat([random_prompt(400), random_prompt(400, seed=2)])
    results = {}
    for kernels in ("torch", "cpu"):  # 48 steps: six routing events after the prefill, with promotions
        cache = make_cache("qevict", model, QEvictConfig(budget=0.4, bits=bits, kernels=kernels, coverage=None),
                           max_length=400 + 48, batch_size=2)
        assert cache.backend.name == kernels
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        memory = cache.memory_report()
        assert memory["total_bytes"] <= memory["budget_bytes"]
        components = dict(memory["components"])  # the same tiers; the torch path's steps also count on the device
        components["index"] -= sum(layer.counter_bytes() for layer in cache.layers)
        results[kernels] = (out[:, 400:].tolist(), cache.summary(), components)
    assert results["cpu"] == results["torch"]
    assert results["cpu"][1]["promotions"] > 0 and results["cpu"][1]["evictions"] > 0


@pytest.mark.parametrize("method", ["qevict", "qevict_head"])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_narrow_scales_generate_the_same_tokens_on_both_paths_within_budget(method, scale_dtype):
    model = tiny_model("llama", 2)
    prompt = random_prompt(400)
    results = {}
    # pairs narrower than the keys: a float32 cache (a 16-bit one stores "model" pairs in 16 bits already)
    config = QEvictConfig(budget=0.2, bits=4, scale_dtype=scale_dtype, kv_dtype="model")
    wide_plan = make_cache(method, model, config.replace(scale_dtype="model"), max_length=448).plan
    for kernels in ("torch", "cpu"):
        cache = make_cache(method, model, config.replace(kernels=kernels), max_length=448)
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        memory = cache.memory_report()
        assert memory["total_bytes"] <= memory["budget_bytes"]
        tiers = [tier.quant for layer in cache.layers for tier in getattr(layer, "heads", [layer])]
        assert tiers and all(tier.k_scale.dtype == getattr(torch, scale_dtype) for tier in tiers)
        results[kernels] = (out[0, 400:].tolist(), cache.summary())
    assert results["cpu"] == results["torch"]
    assert cache.plan.k_quant > wide_plan.k_quant  # the same bytes hold more low-bit windows


def test_the_cpu_kernel_on_smollm2_generates_the_torch_paths_tokens(smollm2):
    from tests.test_smollm2 import passage_prompt

    model, tok = smollm2
    prompt = passage_prompt(tok, 1400)
    tokens = {}
    for kernels in ("torch", "cpu"):
        cache = make_cache("qevict", model, QEvictConfig(budget=0.2, kernels=kernels),
                           max_length=prompt.shape[1] + 64)
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        tokens[kernels] = out[0, prompt.shape[1]:].tolist()
    assert tokens["cpu"] == tokens["torch"]
