"""Head-adaptive QEvict: per-head routing reduces to per-layer routing when heads agree, follows each head's own
attention when they do not, splits capacity AdaKV-style, and stays within the budget (bytes = a tensor walk)."""

import copy
import dataclasses

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.engine.attention import make_wrapper

qevict_attention = make_wrapper("sdpa")  # the function transformers calls for a model on SDPA
from qevict_core.engine.head_cache import HeadwiseQEvictCache, split_capacity
from qevict_core.registry import METHODS
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_budget import walked_bytes
from tests.test_equivalence import NEW, _greedy_with_logits, _Tok
from tests.test_routing import OMEGA, RECENT, SINKS, keys_for, window_direction


def test_split_gives_each_head_its_floor_then_one_top_k_across_heads():
    ranks = pad_sequence([torch.tensor([9.0, 8.0, 7.0, 0.5]), torch.tensor([1.0, 0.9]), torch.tensor([6.0, 5.0, 0.1])],
                         batch_first=True, padding_value=float("-inf"))  # (H, C): each head's ranks, best first
    # Floors of 1 (9, 1, 6), then the best 3 of the rest: 8, 7 (head 0) and 5 (head 2).
    assert split_capacity(ranks, total=6, floor=1) == [3, 1, 2]
    assert split_capacity(ranks, total=5, floor=0) == [3, 0, 2]  # 9 8 7 6 5: the weak head gets nothing
    assert split_capacity(ranks, total=6, floor=2) == [2, 2, 2]  # the floors take every slot
    assert split_capacity(ranks, total=20, floor=1) == [4, 2, 3]  # never more than a head's candidates
    # Equal ranks split evenly: the better slot of each head first, then the lower head.
    same = torch.tensor([[3.0, 2.0, 1.0]] * 3)
    assert split_capacity(same, total=6, floor=0) == [2, 2, 2]
    assert split_capacity(same, total=4, floor=0) == [2, 1, 1]


def identical_heads(model):
    """Every query head and every KV head of every layer computes the same thing: heads see identical attention."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                heads = proj.weight.shape[0] // d
                proj.weight.copy_(proj.weight[:d].repeat(heads, 1))
    return model


# Per-head forms measured on the way to qevict_head (its fields on top of the config; docs/decisions.md).
BOTH_SIDES = dict(pool=1, pool_weight=1.0, pool_direction="both")
HEAD_FORMS = {"qevict_head": {}, "both-sides, AdaKV split": dict(BOTH_SIDES, head_floor=0.2),
              "no pooling, AdaKV split": dict(pool=0, head_floor=0.2)}


def headwise(form: str, model, config: QEvictConfig, max_length: int):
    return HeadwiseQEvictCache(model, METHODS["qevict_head"].lane_config(config).replace(**HEAD_FORMS[form]),
                               max_length)


@pytest.mark.parametrize("pooling,form", [(BOTH_SIDES, "both-sides, AdaKV split"), ({}, "qevict_head")],
                         ids=["both-sides-adakv-split", "forward-uniform"])
def test_identical_heads_route_exactly_as_one_layer(pooling, form):
    """Heads that see the same attention make the decisions of one layer pooled the same way."""
    model = identical_heads(tiny_model("llama", 2))
    prompt, new = random_prompt(400), 60
    config = QEvictConfig(budget=0.5, k_full=6, k_quant=12, record_events=True)
    lanes = [Lane("qevict", make_cache("qevict", model, config.replace(**pooling), max_length=400 + new)),
             Lane(form, headwise(form, model, config.replace(**pooling), max_length=400 + new))]
    layer_wise, head_wise = ([e for e in generate_lanes(model, _Tok(), prompt, [lane], Sampling(max_new_tokens=new))
                              if e.kind == "routing"] for lane in lanes)
    assert len(head_wise) == 2 * len(layer_wise) > 0
    by_layer = {(e.step, e.layer): e for e in layer_wise}
    for event in head_wise:
        ref = by_layer[(event.step, event.layer)]
        assert (event.full, event.quantized, event.evicted) == (ref.full, ref.quantized, ref.evicted)
    assert lanes[0].tokens == lanes[1].tokens
    assert lanes[1].cache.summary()["promotions"] == 2 * lanes[0].cache.summary()["promotions"] > 0


def test_each_head_keeps_the_windows_its_own_group_attends_to():
    """Group 0 attends to windows 3 and 4, group 1 to window 9; K_f = K_q = 2 windows per head. Per layer, the three
    windows compete for two full slots; per head, each head keeps its own. Pooled over both neighbours at full
    weight with the AdaKV split, head 0's neighbours of 3 and 4 outrank window 9 in the split of
    full slots, and head 1 keeps 9 in its low-bit tier; at equal capacities (qevict_head) each head's full tier is
    its own."""
    model = tiny_model("llama", 2)
    n_prompt = SINKS + 12 * OMEGA + RECENT
    keys = keys_for(range(n_prompt))
    toward = [window_direction(3) + window_direction(4), window_direction(9) * 2]
    query = torch.stack([toward[h // 2] * 6.0 for h in range(4)])[None, :, None].expand(1, 4, n_prompt, -1)
    config = QEvictConfig(budget=1.0, omega=OMEGA, sinks=SINKS, recent=RECENT, prefill_window=0, record_events=True)
    full, kept = {}, {}
    for method in ("qevict", *HEAD_FORMS):
        cache = (make_cache(method, model, config.replace(pool=0), max_length=400) if method == "qevict"
                 else headwise(method, model, config, max_length=400))
        cache.plan = dataclasses.replace(cache.plan, k_full=2, k_quant=2, keeps_dormant=True, uncompressed=False)
        module = model.model.layers[0].self_attn
        k, v = cache.update(keys, torch.randn(1, 2, n_prompt, keys.shape[-1]), 0)
        qevict_attention(module, query.contiguous(), k, v, None, scaling=module.scaling)
        events = cache.drain_events()
        full[method] = [set(e.full) for e in events]
        kept[method] = [set(e.full) | set(e.quantized) for e in events]
    assert full["no pooling, AdaKV split"][0] == {3, 4} and 9 in full["no pooling, AdaKV split"][1]
    assert not {3, 4, 9} <= full["qevict"][0]
    assert {3, 4} <= full["both-sides, AdaKV split"][0] and 9 in kept["both-sides, AdaKV split"][1]
    assert full["qevict_head"][0] == {3, 4} and 9 in full["qevict_head"][1]


@pytest.mark.parametrize("form", ["qevict_head", "both-sides, AdaKV split"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_bytes_stay_within_budget_and_equal_a_tensor_walk(kv_heads, form):
    model = tiny_model("llama", kv_heads)
    prompt_len, new = 700, 120
    cache = headwise(form, model, QEvictConfig(budget=0.15), max_length=prompt_len + new)
    plan = cache.plan
    for event in generate_lanes(model, _Tok(), random_prompt(prompt_len), [Lane("h", cache)],
                                Sampling(max_new_tokens=new)):
        if event.kind == "memory":
            assert event.total_bytes <= cache.budget_bytes, f"step {event.step}"
            assert event.total_bytes == walked_bytes(cache)
    for layer in cache.layers:
        allotted = [head.allotted for head in layer.heads]
        assert sum(a[0] for a in allotted) == kv_heads * plan.k_full
        assert sum(a[1] for a in allotted) == kv_heads * plan.k_quant
        assert [h.full_ids.shape[1] for h in layer.heads] == [a[0] for a in allotted]
    summary = cache.summary()
    if cache.config.head_floor == 1.0:  # every head at the layer's capacities
        assert summary["head_k_full_max"] == summary["head_k_full_min"] == plan.k_full
        assert summary["head_k_quant_max"] == summary["head_k_quant_min"] == plan.k_quant
    else:
        assert summary["head_k_full_max"] > summary["head_k_full_min"] or summary["head_k_quant_max"] > summary[
            "head_k_quant_min"], "random heads should not all get the uniform share"


def test_a_budget_that_holds_everything_is_exact():
    model = tiny_model("mistral", 2)
    prompt = random_prompt(150)
    ref_tokens, ref_logits = _greedy_with_logits(model, prompt, make_cache("fullkv", model, None, 150 + NEW))
    cache = make_cache("qevict_head", model, QEvictConfig(budget=1.0), max_length=150 + NEW)
    assert cache.plan.uncompressed
    tokens, logits = _greedy_with_logits(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    # Routing with room for every window in full precision: nothing evicted, the same tokens.
    cache = make_cache("qevict_head", model, QEvictConfig(budget=1.0), max_length=150 + NEW)
    cache.plan = dataclasses.replace(cache.plan, uncompressed=False, k_full=cache.plan.num_windows, k_quant=0)
    tokens, logits = _greedy_with_logits(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert all(t["evicted"] == t["quantized"] == 0 for t in cache.tier_counts())


def test_batches_are_refused_with_the_way_to_run_them():
    with pytest.raises(ValueError, match="padded=True"):
        make_cache("qevict_head", tiny_model("llama", 2), QEvictConfig(budget=0.2), max_length=300, batch_size=2)


def test_ranking_every_head_by_the_layer_mean_makes_qevicts_decisions():
    """β = 1: heads that see different attention still rank alike, split capacity evenly and route as one layer."""
    from qevict_core.engine.head_cache import HeadwiseQEvictCache

    model = tiny_model("qwen2", 2)
    prompt, new = random_prompt(300), 40
    config = QEvictConfig(budget=0.5, k_full=4, k_quant=10, record_events=True)
    caches = [make_cache("qevict", model, config, max_length=300 + new),
              HeadwiseQEvictCache(model, config.replace(head_blend=1.0), max_length=300 + new)]
    layer_wise, head_wise = ([e for e in generate_lanes(model, _Tok(), prompt, [Lane("l", cache)],
                                                        Sampling(max_new_tokens=new)) if e.kind == "routing"]
                             for cache in caches)
    by_layer = {(e.step, e.layer): e for e in layer_wise}
    assert len(head_wise) == 2 * len(layer_wise) > 0
    for event in head_wise:
        ref = by_layer[(event.step, event.layer)]
        assert (event.full, event.quantized) == (ref.full, ref.quantized)


def _per_head_and_one_pass(monkeypatch, model, prompt, config, new):
    """(tokens, logits, cache) of qevict_head decoding head by head, then with every head in one pass per layer."""
    from qevict_core.backends import cpu_heads as head_step
    from qevict_core.engine.head_cache import HeadwiseLayer

    one_pass = HeadwiseLayer._one_pass
    calls = []
    monkeypatch.setattr(head_step, "attend", lambda *a, _f=head_step.attend: calls.append(1) or _f(*a))
    runs = []
    for allowed in (False, True):
        monkeypatch.setattr(HeadwiseLayer, "_one_pass", lambda self, n, _a=allowed: _a and one_pass(self, n))
        cache = make_cache("qevict_head", model, config, max_length=prompt.shape[1] + new)
        assert cache.backend.name == "cpu"
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.logits), cache))
        assert bool(calls) == allowed
    return runs


@pytest.mark.parametrize("family,kv_heads,bits,scorer", [("llama", 2, 2, "cumulative"), ("qwen2", 4, 4, "pnorm")])
def test_one_pass_over_the_heads_decodes_as_head_by_head(monkeypatch, family, kv_heads, bits, scorer):
    model = tiny_model(family, kv_heads)
    config = QEvictConfig(budget=0.2, bits=bits, scorer=scorer, coverage=None)
    (ref_tokens, ref_logits, ref), (tokens, logits, cache) = _per_head_and_one_pass(
        monkeypatch, model, random_prompt(500), config, 48)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for layer, ref_layer in zip(cache.layers, ref.layers):
        for head, ref_head in zip(layer.heads, ref_layer.heads):
            assert torch.equal(head.full_ids, ref_head.full_ids) and torch.equal(head.quant.ids, ref_head.quant.ids)
            torch.testing.assert_close(head.scores, ref_head.scores, rtol=1e-4, atol=1e-5)
            assert head.scores.data_ptr() == layer.scores[head.head:].data_ptr()  # a row of the layer's table
    assert cache.summary() == ref.summary() and cache.summary()["promotions"] > 0
    assert cache.memory_report()["components"] == ref.memory_report()["components"]


def test_one_pass_over_the_heads_on_smollm2_generates_head_by_heads_tokens(monkeypatch, smollm2):
    from tests.test_smollm2 import passage_prompt

    model, tok = smollm2
    (ref_tokens, _, _), (tokens, _, _) = _per_head_and_one_pass(
        monkeypatch, model, passage_prompt(tok, 600), QEvictConfig(budget=0.2), 24)  # three routing events
    assert tokens.tolist() == ref_tokens.tolist()


_STATE = ("fp", "full_ids", "quant", "dormant", "dormant_valid", "recent_start")  # what a move replaces or rewrites
_COMPARED = ("full_k", "full_v", "full_ids", "dormant_valid", "recent_k", "recent_v", "recent_start")


@pytest.mark.parametrize("family,kv_heads,config", [
    ("llama", 2, QEvictConfig(budget=0.2, bits=2, scale_dtype="model", coverage=None, record_events=True)),
    ("qwen2", 4, QEvictConfig(budget=0.2, bits=4, scorer="pnorm", coverage=None)),
    ("llama", 2, QEvictConfig(budget=0.15, scorer="decay", promotion=False, coverage=None)),  # no dormant ledger
], ids=["gqa-int2", "mha-int4-pnorm", "nopromo-decay"])
def test_moving_every_head_at_once_equals_moving_them_one_by_one(monkeypatch, family, kv_heads, config):
    """At every routing event of a decode on the CPU kernel, the heads are first moved one by one, their new state
    kept, the layer put back as it was, and then moved at once: the tiers must be equal bit for bit (dormant slots
    flagged invalid hold no record, so only valid ones are compared), and so must the move counts and events."""
    from qevict_core.engine import head_move

    move_heads, checked = head_move.move_heads, []

    def both(layer, keys, values, cands, rank, ranked):
        owner = layer.owner
        lens = [head.sink_k.shape[2] + head.full_k.shape[2] + head.recent_k.shape[2] for head in layer.heads]
        # a move rewrites tiers in place: the state to put back is a copy
        before = [{name: copy.deepcopy(getattr(head, name)) for name in _STATE} for head in layer.heads]
        # the move counts accumulate in place: copies
        scores, events = layer.scores.clone(), len(owner.events)
        moves = owner._moves.clone() if owner._moves is not None else None
        for h, (head, n) in enumerate(zip(layer.heads, lens)):
            head.move(keys[h, :n][None, None], values[h, :n][None, None])
        one_by_one = [{name: getattr(head, name) for name in _STATE + _COMPARED} for head in layer.heads]
        ref_scores, ref_moves, ref_events = layer.scores.clone(), owner._moves.clone(), owner.events[events:]
        for head, state in zip(layer.heads, before):
            head.__dict__.update(state)
        layer.scores.copy_(scores)
        owner._moves = moves.clone() if moves is not None else None  # None again where none were counted
        owner.events = owner.events[:events]
        move_heads(layer, keys, values, cands, rank, ranked)
        for head, ref in zip(layer.heads, one_by_one):
            for name in _COMPARED:
                assert torch.equal(torch.as_tensor(getattr(head, name)), torch.as_tensor(ref[name])), name
            assert _ledger(head.quant) == _ledger(ref["quant"])
            if ref["dormant"] is not None:
                kept = head.dormant_valid[0].nonzero()[:, 0].unsqueeze(0)
                assert _ledger(head.dormant.select(kept)) == _ledger(ref["dormant"].select(kept))
            else:
                assert head.dormant is None
        assert torch.equal(layer.scores, ref_scores) and torch.equal(owner._moves, ref_moves)
        assert owner.events[events:] == ref_events
        checked.append(int(ref_moves[0] - (moves[0] if moves is not None else 0)))

    monkeypatch.setattr(head_move, "move_heads", both)
    model = tiny_model(family, kv_heads)
    cache = make_cache("qevict_head", model, config, max_length=560)
    assert cache.backend.name == "cpu"
    model.generate(random_prompt(500), **{KV: cache}, max_new_tokens=56, min_new_tokens=56, do_sample=False)
    assert len(checked) == 6 * len(cache.layers)  # every routing event of the decode (seen 508, 516, ..., 548)
    assert (sum(checked) > 0) == config.promotion  # promotions happened, and were compared


def _ledger(ledger) -> list[list]:
    return [getattr(ledger, name).flatten().tolist() for name in
            ("ids", "k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")]
