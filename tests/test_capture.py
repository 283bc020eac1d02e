"""Toward CUDA graphs: a plain decode step of QEvict's GPU paths (the fused Triton kernel, here under
TRITON_INTERPRET=1, and the PyTorch path that ``kernels="auto"`` takes on CUDA) asks the host nothing. Under a
dispatch mode that refuses the operators that wait for the device (``nonzero``, ``.item()``/``int()``,
``unique``, ``masked_select``, boolean indexing) and ``.tolist()``, the step
runs, and two plain steps at different fill levels launch the same sequence of operators. A routing step reads
nothing back either, and the tiers keep their storage across steps and routing events once they are full. On the
GPU paths a plain step, and a routing step, is moreover the same call at every fill once the tiers are at their
planned sizes: the same operators on the same shapes with the same arguments, what a replayed CUDA graph needs (the
ledgers are replaced while they grow)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.ledger import TENSORS
from qevict_core.generation.model_call import call
from tests.conftest import random_prompt, tiny_model

# the operators that wait for the device, and a tensor made from host data (a copy from the host: a CUDA graph
# capture refuses it)
REFUSED = {"aten.nonzero", "aten._local_scalar_dense", "aten.unique", "aten._unique", "aten._unique2",
           "aten.unique_consecutive", "aten.unique_dim", "aten.masked_select", "aten.is_nonzero", "aten.equal",
           "aten.lift_fresh"}


class NoHostSync(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in REFUSED:
            raise AssertionError(f"{func} waits for the device or copies from the host")
        if name == "aten.index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                        for i in (args[1] if len(args) > 1 else ()) if i is not None):
            raise AssertionError("boolean indexing waits for the device")
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def refuse_tolist(*_args, **_kwargs):
    raise AssertionError(".tolist() waits for the device")


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_plain_decode_step_of_the_gpu_path_asks_the_host_nothing(monkeypatch, kernels):
    model, omega = tiny_model("llama", 2), 8
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, kernels=kernels, omega=omega), max_length=340)
    assert cache.backend.name == kernels
    with torch.inference_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        while not cache.routed():  # up to the first routing event after the prompt
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        assert cache.layers[0].quant.num_windows > 0
        sequences = []
        for _ in range(omega - 2):  # the plain steps before the next event
            mode = NoHostSync()
            with monkeypatch.context() as patch, mode:
                patch.setattr(torch.Tensor, "tolist", refuse_tolist)
                token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            assert not cache.routed()
            sequences.append(mode.ops)
    # the first step may build a lookup table once (the torch path's code table); every later one is the same
    assert len(sequences[1]) > 50 and all(ops == sequences[1] for ops in sequences[1:])


class RecordCalls(TorchDispatchMode):
    """Every operator with what a replay would fix: tensor shapes and dtypes, every other argument as given."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        self.calls.append((str(func), tuple(_fixed(a) for a in flat)))
        return func(*args, **(kwargs or {}))


def _fixed(arg):
    """What a replay fixes of an argument: a tensor's shape and dtype, a storage's size (the Triton interpreter hands
    its kernels copies through storages), anything else as given."""
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape), arg.dtype
    if isinstance(arg, torch.UntypedStorage):
        return "storage", arg.nbytes()
    return arg


@pytest.mark.parametrize("kernels, coverage", [("torch", 0.7), ("torch", None), ("triton", None)])
def test_a_step_of_the_gpu_paths_is_one_call_at_every_fill(kernels, coverage):
    """Every plain step of several routing intervals, once the tiers are at their planned sizes, runs the same
    operators on the same shapes with the same non-tensor arguments: the step writes its token at a slot counted on
    the device, attends over the whole full-precision buffer (its reserved tail hidden by position) and folds its
    mass into window ids taken from the device, so a CUDA graph captured once replays it. So does every routing
    step: the aged windows and the recent region's origin come from the device too. The positions come in as
    tensors, as a graph's static inputs do (tests/test_graphs.py replays them)."""
    model, omega = tiny_model("llama", 2), 8
    config = QEvictConfig(budget=0.3, kernels=kernels, omega=omega, coverage=coverage)
    cache = make_cache("qevict", model, config, max_length=400)
    calls, routing = [], []
    with torch.inference_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range((5 if kernels == "torch" else 3) * omega):  # the interpreter is slow: three events
            position = torch.tensor([cache.get_seq_length()])
            mode = RecordCalls()
            with mode:
                token = call(model, token, cache, logits_to_keep=1, cache_position=position,
                             position_ids=position[None]).logits[:, -1].argmax(-1, keepdim=True)
            (routing if cache.routed() else calls).append(mode.calls)
        layer = cache.layers[0]
        assert layer.reads_buffer and layer.fp.length < layer.fp.capacity and layer.quant.num_windows > 0
        assert (coverage is None) == (layer.full_ids.shape[1] > 0)
    # the first step may build the code table once; every later plain step, over the events, is the same call
    assert len(calls) >= 2 * (omega - 1) and all(c == calls[1] for c in calls[1:])
    assert len(routing) >= 3 and all(c == routing[1] for c in routing[1:])  # the first may build a table too


class CountHostSyncs(TorchDispatchMode):
    """Counts, instead of refusing, the operators that wait for the device."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in REFUSED:
            self.syncs.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_routing_step_reads_nothing_back(kernels):
    """A routing event on the GPU's paths decides and moves on the device: the decision takes no nonzero (a stable
    sort picks each row's windows), the windows to quantize and to dequantize are sized by bounds the host knows
    (the windows that aged and the full tier's places), and the check of new scales is read when the host next
    reads the cache. (A full tier, so that promotions dequantize windows on the Triton path.)"""
    model, omega = tiny_model("llama", 2), 8
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, kernels=kernels, omega=omega, coverage=None),
                       max_length=400)
    with torch.inference_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        while not cache.routed():
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        routed = []
        for _ in range(2 * omega):
            mode = CountHostSyncs()
            with mode:
                token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            if cache.routed():
                routed.append(mode.syncs)
    assert routed and all(syncs == [] for syncs in routed), routed


def _tier_storage(cache) -> list[tuple]:
    """Per layer: the sizes of its tiers and the addresses of every tensor they keep."""
    out = []
    for layer in cache.layers:
        ledgers = [layer.quant] + ([layer.dormant] if layer.dormant is not None else [])
        tensors = [layer.fp.keys, layer.fp.values, layer.full_ids, layer.dormant_valid, layer.scores]
        tensors += [getattr(ledger, name) for ledger in ledgers for name in TENSORS]
        out.append((tuple(t.shape for t in tensors), tuple(t.data_ptr() for t in tensors)))
    return out


@pytest.mark.parametrize("kernels, grad_mode", [("torch", torch.inference_mode), ("cpu", torch.inference_mode),
                                               ("cpu", torch.no_grad)])  # views own a base only under no_grad
def test_the_tiers_keep_their_storage_across_steps_and_routing_events(kernels, grad_mode):
    """From the prompt's routing event on, each layer's [sinks | full | recent] lives in one buffer of the plan's
    size: decode steps write into it and routing events rewrite it in place, so its address never changes (what a
    captured graph needs), and what it holds is what the plan charges (measured bytes within the budget). The
    low-bit tier, the dormant ledger and the ids are rewritten in place by every event that keeps their sizes."""
    model, omega = tiny_model("llama", 2), 8
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, kernels=kernels, omega=omega, coverage=None),
                       max_length=400)  # Eq. 3's split: a full tier to rewrite
    with grad_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        fp_storage = [(layer.fp.keys.data_ptr(), layer.fp.values.data_ptr()) for layer in cache.layers]
        assert all(layer.fp.capacity == layer.fp_reserve() < 300 for layer in cache.layers)
        kept_in_place, before = 0, _tier_storage(cache)
        for _ in range(4 * omega):
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            assert [(layer.fp.keys.data_ptr(), layer.fp.values.data_ptr()) for layer in cache.layers] == fp_storage
            after = _tier_storage(cache)
            if cache.routed():
                same_sizes = [b[0] == a[0] for b, a in zip(before, after)]
                assert all(b[1] == a[1] for b, a, same in zip(before, after, same_sizes) if same)
                kept_in_place += sum(same_sizes)
            else:
                assert after == before
            before = after
    assert kept_in_place >= 2 * len(cache.layers) and cache.layers[0].full_ids.shape[1] > 0
    assert cache.layers[0].dormant is not None and cache.layers[0].quant.num_windows > 0
    report = cache.memory_report()
    assert 0 < report["components"]["reserved"] and report["total_bytes"] <= cache.budget_bytes


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_scales_their_dtype_cannot_hold_are_refused(kernels):
    """float16 scale pairs cannot hold values this large: the C path refuses at the routing event itself, the
    paths that read nothing back at the next read of the cache (the memory report the generation loop takes after
    every step), with the same words."""
    model = tiny_model("llama", 2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(1e7)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, omega=8, scale_dtype="float16", kernels=kernels),
                       max_length=340)
    with pytest.raises(ValueError, match="do not fit torch.float16 scales.*scale_dtype='model' or 'bfloat16'"):
        with torch.inference_mode():
            call(model, random_prompt(300), cache, logits_to_keep=1)
        cache.memory_report()


def test_the_slots_a_decode_step_hides_are_the_keys_later_than_its_query():
    """Over a layer's whole buffer a decode step hides the slots no token has reached, by slot index against the
    device count: exactly the keys whose positions lie after the query's, at every fill and across events."""
    model, omega = tiny_model("llama", 2), 8
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, kernels="torch", omega=omega), max_length=400)
    seen_hidden = set()
    with torch.inference_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3 * omega):
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for layer in cache.layers:
                assert layer.reads_buffer  # the step read the whole buffer
                query_pos = layer.recent_origin + layer.fp.count - 1  # the newest token's, the last step's query
                n_quant = layer.quant.num_windows * omega
                by_position = layer.attended_positions() > query_pos  # (B, N) [quantized | buffer]
                assert torch.equal(layer.unwritten_slots(n_quant).expand_as(by_position), by_position)
                seen_hidden.add(int(by_position.sum()))
    assert len(seen_hidden) > 1 and 0 not in seen_hidden  # several fills, always some unwritten slots
