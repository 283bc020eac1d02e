"""Decode steps replayed from a captured graph (qevict_core/generation/graphs.py), checked without a GPU.

``RecordedGraph`` stands in for ``torch.cuda.CUDAGraph`` with its semantics: capture records every operator with the
very tensors it read and wrote (and refuses what a CUDA capture refuses: a read back, a copy from the host); replay
runs the recorded operators again, no Python of the step, writing each result into the tensor the capture produced
(a graph's fixed addresses), so a value the step took from the host at capture stays what it was then. Generation
through it must give the eager tokens, moves and bytes; a step that read a host counter it should have read from the
device would replay a stale value and differ.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qevict_core import QEvictConfig, make_cache
from qevict_core.generation.graphs import GraphedSteps
from qevict_core.generation.model_call import call
from qevict_core.registry import METHODS
from tests.conftest import random_prompt, tiny_model
from tests.test_capture import REFUSED


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # what a CUDA capture refuses: waiting for the device, or a copy from the host (a tensor made from data)
        if str(func.overloadpacket) in REFUSED:
            raise AssertionError(f"{func} cannot be captured")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class RecordedGraph:
    def __init__(self):
        self.ops: list = []
        self.captured = False

    @contextmanager
    def capture(self):
        with _Recorder(self.ops):
            yield

    def replay(self) -> None:
        if not self.captured:  # a CPU cannot defer the captured work: it ran during the capture
            self.captured = True
            return
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                    old.copy_(new)  # an out-of-place result, into the address the capture gave it


def _generate(model, cache, prompt: torch.Tensor, steps: int, graph_class=None):
    """Greedy tokens, memory reports and summary of ``steps`` decode steps, eager or (``graph_class``) replayed."""
    runner = GraphedSteps(model, cache, graph_class=graph_class) if graph_class else None
    tokens, reports = [], []
    prompt = prompt.to(next(model.parameters()).device)
    with torch.inference_mode():
        token = call(model, prompt, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            tokens.append(token[:, 0].tolist())
            if runner is not None:
                logits = runner(token)
            else:
                position = torch.tensor([cache.get_seq_length()], device=prompt.device)
                logits = call(model, token, cache, logits_to_keep=1, cache_position=position,
                              position_ids=position[None]).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            report = cache.memory_report()
            reports.append((report["total_bytes"], report["components"], report["seen"]))
    return tokens, reports, cache.summary(), runner


# the default's sizing, Eq. 3's (a full tier: promotions), FullKV; batch 2 (rows route apart)
CASES = [("qevict", 0.7, 1), ("qevict", None, 1), ("fullkv_static", None, 1), ("qevict", None, 2)]
# what a GPU lays out in fixed buffers (on the CPU, tests/test_eviction_fixed.py forces SnapKV's)
CUDA_CASES = CASES + [("fullkv", None, 1), ("snapkv", None, 1), ("snapkv", None, 2)]


def _compare(method: str, coverage, batch: int, device: str, graph_class, kernels: str = "torch") -> None:
    model, omega = tiny_model("llama", 2).to(device), 8
    config = QEvictConfig(budget=0.3, kernels=kernels, omega=omega, coverage=coverage)
    prompt, steps = torch.cat([random_prompt(300, seed=s) for s in range(batch)]), 6 * omega
    made = [make_cache(method, model, config, max_length=400, batch_size=batch) for _ in range(2)]
    eager = _generate(model, made[0], prompt, steps)
    graphed = _generate(model, made[1], prompt, steps, graph_class)
    assert graphed[:3] == eager[:3]
    # most plain steps replay: each event's step and the first plain step after a change of the tiers run eagerly
    replays = graphed[3].replays
    assert replays["plain"] >= steps // 2 and (not made[1].replays_routing or replays["routing"] >= 3), replays


@pytest.mark.parametrize("method, coverage, batch", CASES)
def test_graph_replayed_steps_generate_the_eager_tokens_moves_and_bytes(method, coverage, batch):
    _compare(method, coverage, batch, "cpu", RecordedGraph)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (RecordedGraph stands in above)")
@pytest.mark.parametrize("kernels", ["torch", "triton"])  # the stand-in replays no Triton launch: a GPU only
@pytest.mark.parametrize("method, coverage, batch", CUDA_CASES)
def test_cuda_graphs_generate_the_eager_tokens_moves_and_bytes(method, coverage, batch, kernels):
    if kernels == "triton" and METHODS[method].family != "qevict":
        pytest.skip("the kernels setting concerns the QEvict family only")
    _compare(method, coverage, batch, "cuda", torch.cuda.CUDAGraph, kernels)


def _host_state(cache) -> dict:
    """Every host-side number of the cache, its schedule, its layers and their buffers."""
    state = {}
    objects = {"cache": cache, "schedule": getattr(cache, "schedule", None)}
    for i, layer in enumerate(cache.layers):
        objects[f"layer{i}"], objects[f"fp{i}"] = layer, getattr(layer, "fp", None)
    for name, obj in objects.items():
        for attr, value in vars(obj or object()).items() if obj is not None else ():
            if isinstance(value, (bool, int, float, str)) or value is None:
                state[f"{name}.{attr}"] = value
    return state


@pytest.mark.parametrize("method, routing", [("qevict", False), ("qevict", True), ("fullkv_static", False)])
def test_the_host_half_of_a_replayed_step_is_what_an_eager_step_advances(method, routing):
    """Twin caches at the same point; one takes a step eagerly, the other only the host half of it: the host
    numbers agree (for a routing step, one whose event keeps every size, as every event does once the tiers are
    full, which is when a routing graph is captured)."""
    model = tiny_model("llama", 2)
    config = QEvictConfig(budget=0.3, kernels="torch", omega=8, coverage=None)
    twins = [make_cache(method, model, config, max_length=400) for _ in range(2)]
    with torch.inference_mode():
        for cache in twins:
            token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(11):  # past the first event after the prompt
                call(model, token, cache, logits_to_keep=1)
            while cache.routes_at(1) != routing:
                call(model, token, cache, logits_to_keep=1)
        assert twins[0].replays_steps and (not routing or twins[0].replays_routing)
        key, before = twins[0].replay_key(), _host_state(twins[0])
        call(model, token, twins[0], logits_to_keep=1)
        assert twins[0].replay_key() == key  # the event kept every size and address
        twins[1].replayed(1)
    after = _host_state(twins[0])
    assert after != before and after == _host_state(twins[1])


@pytest.mark.parametrize("method, config", [("fullkv", QEvictConfig()), ("qevict", QEvictConfig(kernels="cpu")),
                                            ("snapkv", QEvictConfig(budget=0.3))])
def test_a_cache_whose_steps_follow_its_fill_is_refused(method, config):
    model = tiny_model("llama", 2)
    with pytest.raises(ValueError, match="cannot replay its decode steps.*or a QEvict method on a GPU path"):
        GraphedSteps(model, make_cache(method, model, config, max_length=400), graph_class=RecordedGraph)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_graphs_without_a_gpu_are_refused_before_any_step():
    from qevict_core.generation.generate import Lane, Sampling, generate_lanes

    model = tiny_model("llama", 2)
    cache = make_cache("fullkv_static", model, QEvictConfig(), max_length=400)
    with pytest.raises(ValueError, match="replay from CUDA graphs: the model is on cpu"):
        next(generate_lanes(model, None, random_prompt(300), [Lane("a", cache)], Sampling(stop_at_eos=False),
                            graphs=True))
    assert cache.get_seq_length() == 0


def test_the_speed_benchmark_replays_every_method_it_graphs(monkeypatch):
    """bench.speed --graphs on a GPU, run here through the stand-in (SnapKV in a GPU's fixed buffers): the row counts
    the replayed steps, and the flag is refused in one line where there is no GPU."""
    from bench import speed

    from qevict_core.engine import cache_base

    monkeypatch.setattr(speed, "GraphedSteps", lambda model, cache: GraphedSteps(model, cache, RecordedGraph))
    monkeypatch.setattr(cache_base, "lays_out_for_graphs", lambda model: True)  # SnapKV as a GPU lays it out
    model = tiny_model("llama", 2)
    prompt = random_prompt(300)
    for method in ("fullkv_static", "qevict@torch", "snapkv"):
        row = speed.one_run(model, method, 0.3, prompt, 70, graphs=True)  # eight events at Ω = 8
        assert row["replayed_plain"] >= 10 and row["tpot"] > 0
        assert (row["replayed_routing"] > 0) == (method == "qevict@torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--graphs replays CUDA graphs: it needs --device cuda"):
            speed.main(["--model", "tiny", "--methods", "fullkv_static", "--graphs", "--contexts", "256"])


def test_interleaved_timing_replays_every_lane(monkeypatch):
    """bench.tpot --graphs (qevict_core.timing.interleaved_steps) through the stand-in: each lane's steps replay
    (H2O's too, as gpu_check.sh's smollm2_graphs step runs it)."""
    from qevict_core import timing

    made = []

    def stepper(model, cache):
        made.append(GraphedSteps(model, cache, RecordedGraph))
        return made[-1]

    from qevict_core.engine import cache_base

    monkeypatch.setattr(timing, "GraphedSteps", stepper)
    monkeypatch.setattr(cache_base, "lays_out_for_graphs", lambda model: True)  # H2O as a GPU lays it out
    model = tiny_model("llama", 2)
    config = QEvictConfig(budget=0.3, kernels="torch")
    caches = {m: make_cache(m, model, config, max_length=340) for m in ("fullkv_static", "qevict", "h2o")}
    steps = timing.interleaved_steps(model, random_prompt(300), caches, 30, graphs=True)
    assert {name: len(s) for name, s in steps.items()} == {"fullkv_static": 29, "qevict": 29, "h2o": 29}
    assert len(made) == 3 and all(m.replays["plain"] >= 15 for m in made)


def test_a_studio_run_on_a_gpu_replays_every_lane_when_all_of_them_can(monkeypatch):
    """The studio's jobs (ui/jobs.py) on a GPU, the device and its graphs stood in for: where every lane can replay
    its steps, each lane decodes alone from its graphs and yields the eager run's tokens; where one lane cannot
    (the growing ``fullkv``), every lane shares eager forwards, so no lane is timed differently from another. The
    form's default lanes, laid out as a GPU lays them out, all replay."""
    from qevict_core.engine import cache_base
    from qevict_core.generation import generate, graphs
    from qevict_core.testing import tiny_chat_model, tiny_tokenizer
    from ui import jobs
    from ui.form import Controls

    real_check = graphs.require_graphs

    def gpu_check(model, cache):  # the model stands on a GPU: only the cache's own capability is asked
        if not cache.replays_steps:
            raise ValueError(f"{cache.method} cannot replay")

    made = []

    def stepper(model, cache):
        made.append(GraphedSteps(model, cache, RecordedGraph))
        return made[-1]

    monkeypatch.setattr(generate, "GraphedSteps", stepper)
    model, tokenizer = tiny_chat_model(), tiny_tokenizer()
    config = {"kernels": "torch", "omega": 8, "budget": 0.3, "record_events": True}  # as the studio's form sets

    def texts(lanes) -> dict[str, str]:
        """Each lane's text and its routing events (what the studio draws them from)."""
        job = jobs.RunJob(tuple(random_prompt(300)[0].tolist()), lanes, config, 40, 0.0, 0, "/nonexistent")
        out: dict = {}
        for e in (e for batch in jobs.run_events(model, tokenizer, job) for e in batch):
            if e["kind"] == "done":
                out[e["lane"]] = e["text"]
            elif e["kind"] == "routing":
                out.setdefault(("routing", e["lane"]), []).append(e)
        return out

    def same(run, eager) -> bool:
        """Equal but for the scores' last digits (lanes sharing a batched forward and lanes decoding alone sum in
        different orders)."""
        scores = [(e["scores"], f["scores"]) for k in eager if isinstance(k, tuple) for e, f in zip(run[k], eager[k])]
        strip = {k: [{**e, "scores": sorted(e["scores"])} for e in v] if isinstance(k, tuple) else v
                 for k, v in run.items()}
        return strip == {k: [{**e, "scores": sorted(e["scores"])} for e in v] if isinstance(k, tuple) else v
                         for k, v in eager.items()} and all(a == pytest.approx(b, rel=1e-5) for a, b in scores)

    lanes = (("FullKV", "fullkv_static"), ("QEvict", "qevict"))
    eager = texts(lanes)
    assert made == [] and len(eager) == 3  # two texts, QEvict's events; on the CPU: shared eager forwards
    monkeypatch.setattr(graphs, "require_graphs", gpu_check)
    assert len(eager[("routing", "QEvict")]) >= 4 * model.config.num_hidden_layers  # four events, every layer
    assert same(texts(lanes), eager)
    assert len(made) == 2 and all(m.replays["plain"] >= 20 for m in made)
    # the routing steps replay too, their events read on the host after each replay
    assert made[1].replays["routing"] >= 2
    made.clear()
    assert texts((("FullKV", "fullkv"), ("QEvict", "qevict"))) and made == []
    # the form's default lanes, laid out as a GPU lays them out (FullKV and SnapKV in fixed buffers): all replay
    monkeypatch.setattr(cache_base, "lays_out_for_graphs", lambda model: True)
    defaults = tuple((m, m) for m in (Controls.lane1, Controls.lane2, Controls.lane3))
    monkeypatch.setattr(graphs, "require_graphs", real_check)
    eager = texts(defaults)
    monkeypatch.setattr(graphs, "require_graphs", gpu_check)
    assert same(texts(defaults), eager) and len(eager) == 4
    assert len(made) == 3 and all(m.replays["plain"] >= 20 for m in made)
    # H2O or Layer-DefensiveKV as the baseline lane: in fixed buffers on a GPU too (eviction_heavy.py,
    # eviction_ragged.py), so every lane replays still
    for baseline in (("H2O", "h2o"), ("Layer-DefensiveKV", "layer_defensivekv")):
        made.clear()
        lanes = (defaults[0], baseline, defaults[2])
        monkeypatch.setattr(graphs, "require_graphs", real_check)
        eager = texts(lanes)
        monkeypatch.setattr(graphs, "require_graphs", gpu_check)
        assert same(texts(lanes), eager) and len(eager) == 4
        assert len(made) == 3 and all(m.replays["plain"] >= 20 for m in made)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the stand-in runs above)")
@pytest.mark.parametrize("baseline", ["default", "h2o", "layer_defensivekv"])
def test_a_studio_run_on_cuda_replays_its_lanes_with_the_tokens_each_gives_alone(monkeypatch, baseline):
    """On CUDA, with real graphs: the studio's run gives each lane the tokens it gives decoding alone, eagerly."""
    from qevict_core import Sampling, generate_lanes
    from qevict_core.generation import generate
    from qevict_core.testing import tiny_chat_model, tiny_tokenizer
    from ui import jobs
    from ui.form import Controls

    made = []

    def stepper(model, cache):
        made.append(GraphedSteps(model, cache))
        return made[-1]

    monkeypatch.setattr(generate, "GraphedSteps", stepper)
    model, tokenizer = tiny_chat_model().cuda(), tiny_tokenizer()
    config = {"kernels": "torch", "omega": 8, "budget": 0.3, "record_events": True}
    prompt = tuple(random_prompt(300)[0].tolist())
    lanes = tuple((m, m) for m in (Controls.lane1, Controls.lane2 if baseline == "default" else baseline,
                                   Controls.lane3))  # the form's default lanes, or another baseline
    job = jobs.RunJob(prompt, lanes, config, 40, 0.0, 0, "/nonexistent")
    graphed = {e["lane"]: e["text"] for batch in jobs.run_events(model, tokenizer, job) for e in batch
               if e["kind"] == "done"}
    assert len(made) == 3 and all(m.replays["plain"] >= 20 for m in made)
    sampling = Sampling(max_new_tokens=40, temperature=0.0, seed=0)
    alone = {e.lane: e.text for e in generate_lanes(model, tokenizer, torch.tensor([prompt]), job.caches(model),
                                                    sampling, together=False) if e.kind == "done"}
    assert graphed == alone and len(made) == 3


def test_fullkv_as_a_gpu_lays_it_out_grows_by_chunks_and_replays_between_growths(monkeypatch):
    """``fullkv`` in a GPU's layout: buffers grown ``grow_by`` tokens at a time, the bytes within a chunk of the
    tokens'; a step that must grow runs eagerly and the graph is captured again after it; the tokens are those of
    the growing cache on the CPU."""
    from qevict_core.baselines.fullkv import FullKVCache
    from qevict_core.engine import cache_base

    model, steps = tiny_model("llama", 2), 60
    on_cpu = _generate(model, make_cache("fullkv", model, QEvictConfig(), max_length=400), random_prompt(300), steps)
    monkeypatch.setattr(cache_base, "lays_out_for_graphs", lambda model: True)
    monkeypatch.setattr(FullKVCache, "grow_by", 16)
    runs = [_generate(model, make_cache("fullkv", model, QEvictConfig(), max_length=400), random_prompt(300), steps,
                      graph_class) for graph_class in (None, RecordedGraph)]
    assert runs[1][:3] == runs[0][:3] and runs[0][0] == on_cpu[0]
    per_token = on_cpu[1][0][0] // (300 + 1)  # bytes of one token, every layer
    for total, _, seen in runs[0][1]:
        assert seen * per_token <= total < (seen + 16) * per_token
    # each growth: the step that grows, a warm-up and the capture run the step's Python; so do the first two steps
    assert runs[1][3].replays["plain"] >= steps - 2 - 3 * (steps // 16 + 1)
