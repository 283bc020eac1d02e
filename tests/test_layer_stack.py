"""Every layer's tiers as rows of one storage (engine/layer_stack.py): a routing event moved as one stack gives the
tokens, tiers, events, moves and bytes of the layer-by-layer move, and a layer that leaves the stack is moved alone."""

from __future__ import annotations

import pytest
import torch

from qevict_core.config import QEvictConfig
from qevict_core.engine.layer_stack import StackedLayer, row_tensors
from qevict_core.factory import make_cache
from qevict_core.testing import tiny_model
from qevict_kernels import cpu_decode

PATHS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(cpu_decode.available() is not None,
                                                                reason="the C kernel needs a compiler"))]


def _generate(monkeypatch, stacked: bool, batch: int, new_tokens: int = 90, kernels: str = "cpu"):
    model = tiny_model("llama", 2, num_hidden_layers=3)
    prompt = torch.randint(0, 256, (batch, 300), generator=torch.Generator().manual_seed(1))
    config = QEvictConfig(budget=0.4, k_full=4, k_quant=10, kernels=kernels, record_events=True)
    cache = make_cache("qevict", model, config, max_length=420, batch_size=batch)
    moved_at_once = []
    with monkeypatch.context() as patch:
        if not stacked:
            patch.setattr(StackedLayer, "can_hold", staticmethod(lambda layers: False))
        move_all = StackedLayer.move_all
        patch.setattr(StackedLayer, "move_all", lambda self: (moved_at_once.append(1), move_all(self)))
        tokens = model.generate(prompt, cache=cache, max_new_tokens=new_tokens, do_sample=False)
    return tokens, cache, len(moved_at_once), model


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("batch", [1, 2])
def test_a_stacked_move_is_the_layer_by_layer_move(monkeypatch, batch, kernels):
    """The C path reads the low-bit tier in place; the PyTorch path attends over a workspace and moves from the
    layers' own tiers at the forward's end."""
    tokens, cache, at_once, _ = _generate(monkeypatch, True, batch, kernels=kernels)
    alone_tokens, alone, never, _ = _generate(monkeypatch, False, batch, kernels=kernels)
    assert at_once >= 9 and never == 0  # every event after the first two moved every layer at once
    assert torch.equal(tokens, alone_tokens)
    assert cache.summary() == alone.summary() and cache.summary()["promotions"] > 0  # promotions and demotions ran
    assert [e.to_dict() for e in cache.drain_events()] == [e.to_dict() for e in alone.drain_events()]
    assert cache.memory_report()["components"] == alone.memory_report()["components"]
    for index, (layer, other) in enumerate(zip(cache.layers, alone.layers)):
        for mine, theirs in zip(row_tensors(layer), row_tensors(other)):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert torch.equal(mine, theirs), index
        assert layer.fp.keys.untyped_storage().data_ptr() == cache.layers[0].fp.keys.untyped_storage().data_ptr()


def test_every_layer_reads_the_step_tables_the_stack_builds_once_as_it_would_build_its_own(monkeypatch):
    """On the PyTorch path a decode step's fold ids and unwritten-slot mask are built once for every stacked layer
    (``StackedLayer.step_table``): each layer's rows equal what it builds alone, and a second layer asking builds
    nothing."""
    _, cache, at_once, _ = _generate(monkeypatch, True, 2, new_tokens=41, kernels="torch")
    assert at_once and cache.stack_of(cache.layers[0]) is cache._stack
    first = cache.layers[0]
    num = first.quant.num_windows + first.full_ids.shape[1] + cache.grid.count(first.fp.capacity - first.fp.sinks
                                                                                 - first.fp.full)
    before = first.quant.num_windows * cache.grid.omega
    shared = [(layer._fold_ids(num), layer.unwritten_slots(before)) for layer in cache.layers]
    assert len(cache._stack.step_tables) == 2  # built by the first layer, read by the others
    for layer, (ids, hidden) in zip(cache.layers, shared):
        rows, layer.stack_rows = layer.stack_rows, None  # the layer alone
        assert torch.equal(ids, layer._fold_ids(num)) and torch.equal(hidden, layer.unwritten_slots(before))
        layer.stack_rows = rows
    cache._stack.step_tables = None


@pytest.mark.parametrize("kernels", PATHS)
def test_a_continuation_read_at_once_leaves_the_stack_and_the_next_event_stacks_again(monkeypatch, kernels):
    """A forward of many tokens after decoding grows every layer's buffer past the stack's storage: that event moves
    layer by layer, a new stack is built after it, and the tokens are the layer-by-layer move's throughout."""
    runs = []
    for stacked in (True, False):
        tokens, cache, _, model = _generate(monkeypatch, stacked, 1, new_tokens=40, kernels=kernels)
        first = cache._stack
        more = torch.cat([tokens, torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(2))], 1)
        with monkeypatch.context() as patch:
            if not stacked:
                patch.setattr(StackedLayer, "can_hold", staticmethod(lambda layers: False))
            runs.append(model.generate(more, cache=cache, max_new_tokens=20, do_sample=False))
        if stacked:
            assert first is not None and cache._stack is not None and cache._stack is not first
            assert not first.holds(cache.layers) and cache._stack.holds(cache.layers)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("chunk", [None, 64])
def test_a_prompt_is_routed_layer_by_layer_so_no_two_layers_hold_it_whole(monkeypatch, kernels, chunk):
    """Only decode steps wait for the forward's end: a prompt's event moves each layer right after its attention,
    so its full-precision prompt never sits in two layers at once (deferred, every layer would hold it at the end
    of the forward: FullKV's bytes at the peak)."""
    from qevict_core.engine.qevict_layer import QEvictLayer
    from qevict_core.generation.prefill import prefill

    model = tiny_model("llama", 2, num_hidden_layers=3)
    config = QEvictConfig(budget=0.4, k_full=4, k_quant=10, kernels=kernels)
    cache = make_cache("qevict", model, config, max_length=420)
    holding = []  # at each attention: how many layers hold more than the plan's buffer
    attend = QEvictLayer.attend

    def counted(self, *args, **kwargs):
        holding.append(sum(layer.fp.capacity > layer.fp_reserve() for layer in cache.layers if layer.is_initialized))
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(QEvictLayer, "attend", counted)
    prefill(model, torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)), cache, chunk)
    assert max(holding) == 1 and cache.layers[-1].fp.capacity == cache.layers[-1].fp_reserve()
