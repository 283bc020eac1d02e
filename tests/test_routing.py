"""Routing: scores equal eager attention, quantized windows regain attention and get promoted, records are
write-once across promote/demote cycles."""

import dataclasses

import pytest
import torch

from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.attention import make_wrapper

qevict_attention = make_wrapper("sdpa")  # the function transformers calls for a model on SDPA
from qevict_core.engine.layout import WindowGrid
from qevict_core.engine.row_move import decide_rows
from tests.conftest import KV, random_prompt, tiny_model

D, OMEGA, SINKS, RECENT = 16, 8, 4, 8


class Driver:
    """Feeds hand-made keys, values and queries through layer 0's update and the registered attention."""

    def __init__(self, promotion=True, k_full=3, k_quant=5):
        self.model = tiny_model("llama", 2)
        config = QEvictConfig(budget=1.0, omega=OMEGA, sinks=SINKS, recent=RECENT, promotion=promotion,
                              prefill_window=0, record_events=True, pool=0)  # the scenario sets raw scores
        self.cache = make_cache("qevict", self.model, config, max_length=400)
        self.cache.plan = dataclasses.replace(self.cache.plan, k_full=k_full, k_quant=k_quant,
                                              keeps_dormant=promotion, uncompressed=False)
        self.module = self.model.model.layers[0].self_attn
        self.layer = self.cache.layers[0]
        torch.manual_seed(0)

    def step(self, keys, values, query):
        k, v = self.cache.update(keys, values, 0)
        out, _ = qevict_attention(self.module, query, k, v, None, scaling=self.module.scaling)
        return out


def routing_keeps_everything(cache):
    """A budget that holds everything makes the cache plain FullKV (no routing); these tests want routing and
    scoring to run with nothing evicted, so they set that plan by hand."""
    cache.plan = dataclasses.replace(cache.plan, uncompressed=False, k_full=cache.plan.num_windows, k_quant=0)
    return cache


def window_direction(w: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(w % D), D).float()


def keys_for(positions: range) -> torch.Tensor:
    """Token at position p carries the direction of its window (sinks get a direction of their own)."""
    rows = [window_direction((p - SINKS) // OMEGA) if p >= SINKS else torch.zeros(D) for p in positions]
    return torch.stack(rows)[None, None].expand(1, 2, -1, -1).contiguous() * 6.0


def query_towards(w: int, tokens: int = 1) -> torch.Tensor:
    return (window_direction(w) * 6.0).expand(1, 4, tokens, D).contiguous()


def run_scenario(promotion: bool):
    d = Driver(promotion=promotion)
    n_prompt = SINKS + 12 * OMEGA + RECENT
    # Prefill: queries favour windows 0-2 strongly, window 6 a little (so it lands in the quantized tier).
    q = torch.cat([query_towards(w, t) for w, t in [(0, 30), (1, 30), (2, 30), (6, n_prompt - 90)]], dim=2)
    d.step(keys_for(range(n_prompt)), torch.randn(1, 2, n_prompt, D), q)
    first = d.cache.drain_events()[0]
    assert 6 in first.quantized and {0, 1, 2} == set(first.full)
    promoted_at = None
    for t in range(n_prompt, n_prompt + 25 * OMEGA):
        d.step(keys_for(range(t, t + 1)), torch.randn(1, 2, 1, D), query_towards(6))
        for event in d.cache.drain_events():
            if 6 in event.promoted and promoted_at is None:
                promoted_at = event
    return d, promoted_at


def test_quantized_window_regaining_attention_is_promoted():
    d, promoted = run_scenario(promotion=True)
    assert promoted is not None, "window 6 kept receiving attention but was never promoted"
    assert 6 in promoted.full and 6 not in promoted.quantized
    assert d.cache.summary()["promotions"] >= 1
    # The promoted window's full-precision copy is its dequantized record (a dormant ledger entry).
    slot = d.layer.full_ids[0].tolist().index(6)
    assert bool(d.layer.dormant_valid[0, slot])


def test_one_way_ablation_never_promotes():
    d, promoted = run_scenario(promotion=False)
    assert promoted is None and d.cache.summary()["promotions"] == 0
    assert 6 in d.layer.quant.ids[0].tolist()


def _record(layer, window: int):
    ids = layer.quant.ids[0].tolist()
    one = layer.quant.select(torch.tensor([[ids.index(window)]]))
    return one, one.dequantize(layer.owner.compute_dtype)  # in the model's dtype, as promotion does


def test_promote_demote_cycles_keep_the_record_bit_identical():
    d, _ = run_scenario(promotion=True)
    layer, target = d.layer, 6
    # Force the target down to the quantized tier, then cycle it through full precision several times by
    # overriding its score between routing events.
    t = layer.seen

    def route_with_score(score):
        nonlocal t
        layer.scores[0, target] = score
        for _ in range(OMEGA):
            d.step(keys_for(range(t, t + 1)), torch.randn(1, 2, 1, D), query_towards(1))
            layer.scores[0, target] = score
            t += 1
        d.cache.drain_events()

    middle = layer.scores[0, :12].sort(descending=True).values[4].item()  # rank 5: inside the quantized tier
    route_with_score(middle)
    assert target in layer.quant.ids[0].tolist()
    record, (k0, v0) = _record(layer, target)
    for _ in range(3):
        route_with_score(1e9)
        assert target in layer.full_ids[0].tolist()
        slot = layer.full_ids[0].tolist().index(target)
        full_k = layer.full_k[:, :, slot * OMEGA:(slot + 1) * OMEGA]
        rotated = d.cache.rope.rotate(k0, WindowGrid(SINKS, OMEGA).positions(torch.tensor([[target]])))
        assert torch.equal(full_k, rotated.to(full_k.dtype))  # promotion restores the dequantized record, stored
        route_with_score(middle)
        again, (k1, v1) = _record(layer, target)
        assert torch.equal(again.k_codes, record.k_codes) and torch.equal(again.k_scale, record.k_scale)
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_prefill_scores_equal_eager_attention_column_sums(kv_heads):
    """Eq. 1 at prefill: the score of a window is the eager-attention mass it receives, averaged over heads."""
    model = tiny_model("llama", kv_heads)
    prompt = random_prompt(4 + 24 * 8)
    config = QEvictConfig(budget=1.0, omega=8, sinks=4, prefill_window=0)
    cache = routing_keeps_everything(make_cache("qevict", model, config, max_length=200))
    with torch.inference_mode():
        model(prompt, **{KV: cache})
        model.set_attn_implementation("eager")
        eager = model(prompt, output_attentions=True).attentions
        model.set_attn_implementation("qevict")
    for layer_idx, probs in enumerate(eager):  # (1, Hq, T, T)
        per_key = probs[0].sum(dim=(0, 1)) / probs.shape[1]
        expected = per_key[4:].reshape(24, 8).sum(dim=1)
        got = cache.layers[layer_idx].scores[0]
        torch.testing.assert_close(got[:24], expected.float(), rtol=1e-4, atol=1e-4)


def test_decode_scores_accumulate_eager_attention_of_every_query():
    """After prefill and two routing events in decode, scores are the column sums over all 212 query rows."""
    model = tiny_model("qwen2", 2)
    full = random_prompt(4 + 26 * 8)
    cache = routing_keeps_everything(make_cache("qevict", model, QEvictConfig(budget=1.0, omega=8, sinks=4,
                                                                              prefill_window=0), max_length=212))
    with torch.inference_mode():
        model(full[:, :196], **{KV: cache})
        for i in range(196, 212):
            model(full[:, i:i + 1], **{KV: cache})
        model.set_attn_implementation("eager")
        eager = model(full, output_attentions=True).attentions
        model.set_attn_implementation("qevict")
    for layer_idx, probs in enumerate(eager):
        per_key = probs[0].sum(dim=(0, 1)) / probs.shape[1]
        expected = per_key[4:].reshape(26, 8).sum(dim=1)
        torch.testing.assert_close(cache.layers[layer_idx].scores[0, :26], expected.float(), rtol=1e-4, atol=1e-4)


def test_prefill_observation_window_scores_only_the_last_prompt_queries():
    model = tiny_model("llama", 2)
    prompt = random_prompt(4 + 24 * 8)
    cache = routing_keeps_everything(make_cache("qevict", model, QEvictConfig(budget=1.0, omega=8, sinks=4,
                                                                              prefill_window=16), max_length=200))
    with torch.inference_mode():
        model(prompt, **{KV: cache})
        model.set_attn_implementation("eager")
        eager = model(prompt, output_attentions=True).attentions
        model.set_attn_implementation("qevict")
    for layer_idx, probs in enumerate(eager):
        per_key = probs[0, :, -16:].sum(dim=(0, 1)) / probs.shape[1]
        expected = per_key[4:].reshape(24, 8).sum(dim=1)
        torch.testing.assert_close(cache.layers[layer_idx].scores[0, :24], expected.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scorer, pool", [("cumulative", 0), ("pnorm", 1)])
def test_one_decision_for_every_layer_equals_each_layers_own(scorer, pool):
    """A forward's routing events, deferred to its end, are decided at once, the layers' candidates stacked as rows
    (row_move.decide_rows): the same candidates and decisions as each layer ranking its own, on four layers whose
    tables and tiers differ."""
    model = tiny_model("llama", 2, num_hidden_layers=4)
    config = QEvictConfig(budget=0.3, scorer=scorer, pool=pool, omega=8, coverage=None)  # Eq. 3: a full tier too
    cache = make_cache("qevict", model, config, max_length=400)
    with torch.inference_mode():
        token = model(random_prompt(300), **{KV: cache}).logits[:, -1:].argmax(-1)
        for _ in range(3 * 8 - 1):  # two events after the prompt's; stop just before the next
            token = model(token, **{KV: cache}).logits[:, -1:].argmax(-1)
        assert cache.routes_at(1) and all(layer.aged_windows().shape[1] for layer in cache.layers)
        together = decide_rows(cache.layers)
        alone = [decide_rows([layer])[0] for layer in cache.layers]
    for (cand, decision), (own_cand, own) in zip(together, alone):
        assert torch.equal(cand, own_cand)
        assert torch.equal(decision.full, own.full) and torch.equal(decision.quant, own.quant)
    kept = {(tuple(d.full[0].tolist()), tuple(cand[0, d.quant[0]].tolist())) for cand, d in together}
    assert len(kept) > 1 and all(d.full.shape[1] and d.quant.shape[1] for _, d in together)  # tiers differ by layer


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("into", [False, True])
def test_a_per_row_gather_equals_torch_gather_on_every_path(rows, into):
    """gather_seq's paths (one row, several rows by a flat index, a strided input or ``flat=False`` by
    torch.gather) give the elementwise gather's result, into ``out`` too."""
    from qevict_core.engine.layout import gather_seq

    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(0, 255, (rows, 3, 97, 5), dtype=torch.uint8, generator=generator)
    index = torch.stack([torch.randperm(97, generator=generator)[:41] for _ in range(rows)]).to(torch.int32)
    expected = torch.gather(x, 2, index.long()[:, None, :, None].expand(rows, 3, 41, 5))
    for source in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):  # contiguous, then strided
        for flat in (False, True):
            out = torch.zeros_like(expected) if into else None
            got = gather_seq(source, index, out=out, flat=flat)
            assert torch.equal(got, expected)
            if into:
                assert got.data_ptr() == out.data_ptr()


def test_a_move_sized_by_the_host_equals_one_sized_by_bounds():
    """move.py sizes its work on the host where the backend does (a CPU: only as many windows per row as some row
    promotes or quantizes) and by bounds the host knows elsewhere (every slot that may need it: a CUDA graph can
    capture that): the same new tiers, bit for bit, on rows that promote and quantize different numbers of windows."""
    from qevict_core.backends import TorchBackend
    from qevict_core.engine.move import move
    from qevict_core.engine.routing import RoutingDecision
    from qevict_core.engine.row_move import row_candidates

    class OnHost(TorchBackend):
        sizes_moves_on_host = True

    model = tiny_model("llama", 2)
    config = QEvictConfig(budget=0.5, omega=8, coverage=None, kernels="torch")
    cache = make_cache("qevict", model, config, max_length=400, batch_size=2)
    with torch.inference_mode():
        token = model(torch.cat([random_prompt(300, seed=1), random_prompt(300, seed=2)]),
                      **{KV: cache}).logits[:, -1:].argmax(-1)
        while not cache.routes_at(1):  # to the step before the next event, whose candidates include aged windows
            token = model(token, **{KV: cache}).logits[:, -1:].argmax(-1)
        layer = cache.layers[0]
        n_quant, n_full = layer.quant.num_windows, layer.full_ids.shape[1]
        assert n_quant >= 3 and n_full >= 3 and layer.dormant is not None
        keys, values = layer.own_keys()
        cand = layer.candidates()
        q, f = n_quant, n_quant + n_full  # the first full candidate, the first aged one
        # row 0 promotes two of its three full slots and quantizes one window anew; row 1 promotes one, quantizes two;
        # the promoted slots are not the first ones
        decision = RoutingDecision(torch.tensor([[q, 0, 2], [q, 1, q + 1]]),
                                   torch.tensor([[1, 3, q + 1], [0, q + 2, f]]), cand.shape[1])
        cands = row_candidates(layer, keys, cand)
        moved = {}
        for backend in (OnHost(), TorchBackend()):
            cache.backend = backend
            moved[backend.sizes_moves_on_host] = move(cache, keys, values, cands, decision)
    host, bound = moved[True], moved[False]
    assert torch.equal(host.full_k, bound.full_k) and torch.equal(host.full_v, bound.full_v)
    assert torch.equal(host.full_ids, bound.full_ids) and torch.equal(host.dormant_valid, bound.dormant_valid)
    assert host.records.num_windows < bound.records.num_windows  # the bound quantized windows no row needed
    assert _windows(host.records.select(host.quant)) == _windows(bound.records.select(bound.quant))
    valid = host.dormant_valid.tolist()  # the promoted windows' records; the other dormant slots are never read
    assert [sum(row) for row in valid] == [2, 1]
    assert ([w for w, keep in zip(_windows(host.records.select(host.dormant)), sum(valid, [])) if keep]
            == [w for w, keep in zip(_windows(bound.records.select(bound.dormant)), sum(valid, [])) if keep])
    # each row's second full slot is a promoted window: its record dequantized and rotated back to its positions
    second = layer.quant.select(torch.tensor([[0], [1]]))
    rotated = cache.rope.rotate(second.dequantize(cache.compute_dtype)[0], cache.grid.positions(second.ids))
    assert torch.equal(host.full_k[:, :, 8:16], rotated.to(host.full_k.dtype))


def _windows(ledger) -> list[tuple]:
    """Each window of each row of ``ledger``, row-major: its id and the bytes of every field it holds."""
    omega, out = ledger.omega, []
    for r in range(ledger.ids.shape[0]):
        for j in range(ledger.num_windows):
            tokens = slice(j * omega, (j + 1) * omega)
            fields = (ledger.k_codes[r, :, tokens], ledger.v_codes[r, :, tokens], ledger.k_scale[r, :, j],
                      ledger.k_zero[r, :, j], ledger.v_scale[r, :, tokens], ledger.v_zero[r, :, tokens])
            out.append((int(ledger.ids[r, j]), *(field.contiguous().view(torch.uint8).numpy().tobytes()
                                                 for field in fields)))
    return out
