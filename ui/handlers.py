"""What the studio does, without Gradio: validate a request, run it through the engine while persisting the
event stream, and rebuild views of stored sessions. ``ui/layout.py`` only wires these to components."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.config import BITS, SCORERS
from qevict_core.registry import METHODS
from storage import SessionStore

from .view import RunView

NO_LANE = "(none)"
FLUSH_EVERY = 32  # events buffered between database writes


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    methods: tuple[str, ...]
    config: QEvictConfig
    sampling: Sampling


def parse_request(prompt: str, methods: list[str], budget: float, omega: int, q_frac: float, bits: int, sinks: int,
                  recent: int, scorer: str, promotion: bool, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0) -> RunRequest:
    """Turn raw UI values into a request; ValueError with a readable message for anything off."""
    if not prompt or not prompt.strip():
        raise ValueError("The prompt is empty: write one or pick an example.")
    chosen = tuple(m for m in methods if m and m != NO_LANE)
    if not chosen:
        raise ValueError("Choose at least one lane.")
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; allowed: {sorted(METHODS)}.")
    try:
        config = QEvictConfig(budget=float(budget), omega=int(omega), q_frac=float(q_frac), bits=int(bits),
                              sinks=int(sinks), recent=int(recent), scorer=str(scorer), promotion=bool(promotion))
        sampling = Sampling(max_new_tokens=int(max_new_tokens), temperature=float(temperature), seed=int(seed))
    except (TypeError, ValueError) as err:
        raise ValueError(f"Invalid setting: {err}") from err
    return RunRequest(prompt, chosen, config, sampling)


def lane_names(methods: tuple[str, ...]) -> list[str]:
    """Unique lane names: the method, with #2, #3 for repeats."""
    names = []
    for method in methods:
        name, n = method, 2
        while name in names:
            name, n = f"{method}#{n}", n + 1
        names.append(name)
    return names


@dataclass
class Update:
    view: RunView
    session_id: str
    delete_token: str
    routing_changed: bool
    status: str  # running, done, stopped, error
    message: str = ""


@dataclass
class Studio:
    """One model, one tokenizer, one store. Runs are sequential (the Gradio queue has one slot)."""

    model: object
    tokenizer: object
    store: SessionStore
    model_name: str = "SmolLM2-135M-Instruct"
    choices: dict = field(default_factory=lambda: {"methods": sorted(METHODS), "bits": BITS, "scorers": SCORERS})

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def encode(self, prompt: str) -> torch.Tensor:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                      return_tensors="pt", return_dict=True)["input_ids"]
        return self.tokenizer(prompt, return_tensors="pt").input_ids

    def prepare(self, req: RunRequest) -> tuple[torch.Tensor, list[Lane], dict]:
        """Everything that can fail on bad input happens here, before anything is stored."""
        input_ids = self.encode(req.prompt)
        context = getattr(self.model.config, "max_position_embeddings", None)
        total = input_ids.shape[1] + req.sampling.max_new_tokens
        if context and total > context:
            raise ValueError(f"The prompt is {input_ids.shape[1]} tokens; with {req.sampling.max_new_tokens} new "
                             f"tokens that is {total}, beyond the model's context of {context}. Shorten it.")
        lanes = []
        for name, method in zip(lane_names(req.methods), req.methods):
            try:
                cache = make_cache(method, self.model, req.config, max_length=total)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
            lanes.append(Lane(name, cache))
        request = {
            "model": self.model_name,
            "lanes": [{"name": lane.name, "method": method} for lane, method in zip(lanes, req.methods)],
            "config": req.config.to_dict(),
            "sampling": {"max_new_tokens": req.sampling.max_new_tokens, "temperature": req.sampling.temperature,
                         "seed": req.sampling.seed},
            "prompt_length": input_ids.shape[1],
            "prompt_tokens": self.tokenizer.batch_decode([[t] for t in input_ids[0].tolist()]),
        }
        return input_ids, lanes, request

    def run(self, req: RunRequest, should_stop: Callable[[], bool] = lambda: False) -> Iterator[Update]:
        """Stream the run; every event is persisted as it comes, so a stopped or failed run stays replayable."""
        input_ids, lanes, request = self.prepare(req)
        session_id, token = self.store.create(req.prompt, request)
        view, pending, status, message = RunView(request), [], "running", ""
        yield Update(view, session_id, token, True, status)
        routing_changed = False
        try:
            for event in generate_lanes(self.model, self.tokenizer, input_ids, lanes, req.sampling, should_stop):
                data = event.to_dict()
                routing_changed |= view.apply(data)
                pending.append(data)
                if len(pending) >= FLUSH_EVERY:
                    self.store.append(session_id, pending)
                    pending = []
                if data["kind"] == "token":
                    yield Update(view, session_id, token, routing_changed, status)
                    routing_changed = False
            errors = [lane.done for lane in view.lanes.values() if (lane.done or "").startswith("error")]
            status = "error" if errors else "stopped" if should_stop() else "done"
            message = "; ".join(errors)
        except Exception as err:  # keep what was generated; say what went wrong
            status, message = "error", str(err)
        finally:
            self.store.append(session_id, pending)
            self.store.finish(session_id, status if status != "running" else "stopped", summarize(view))
        yield Update(view, session_id, token, True, status, message)

    def replay(self, session_id: str, step: int | None = None) -> tuple[RunView, int] | None:
        """The view of a stored session at ``step`` (None: the end) and its last step; None if unknown."""
        meta = self.store.get(session_id or "")
        if meta is None:
            return None
        events = self.store.events(session_id)
        view = RunView(meta["request"])
        last = max((e.get("step", 0) for e in events), default=0)
        for event in events:
            if step is None or event.get("step", 0) <= step:
                view.apply(event)
        return view, last


DIAGNOSTIC_COLUMNS = [("FMM (H=32)", "fmm"), ("FMM without the low-bit tier", "fmm_fp_only"), ("churn", "churn"),
                      ("QSA", "qsa"), ("R_Q", "r_q")]


def diagnose_session(studio: Studio, session_id: str) -> str:
    """The paper's diagnostics for every routed lane of a stored run, against FullKV attention over that lane's
    own tokens (recomputed with eager attention: seconds for a few thousand tokens on CPU)."""
    import math

    from qevict_core import diagnostics as dg

    meta = studio.store.get(session_id or "")
    if meta is None:
        return f"**No such session:** `{session_id}`"
    view = RunView(meta["request"])
    for event in studio.store.events(session_id):
        view.apply(event)
    lanes = view.routed_lanes()
    if not lanes:
        return "This run has no routed lane (QEvict or its ablations): nothing to diagnose."
    prompt = studio.encode(meta["prompt"])
    config, sampling = meta["request"]["config"], meta["request"]["sampling"]
    max_length = prompt.shape[1] + sampling["max_new_tokens"]
    columns = [name for name, _ in DIAGNOSTIC_COLUMNS] + ["μ full", "μ quantized", "μ evicted", "LIR"]
    header = "| lane | " + " | ".join(columns) + " |"
    rows = [header, "|" + "---|" * (len(DIAGNOSTIC_COLUMNS) + 5)]
    for name in lanes:
        lane = view.lanes[name]
        if len(lane.tokens) < 2:
            continue
        sequence = torch.cat([prompt, torch.tensor([lane.tokens[:-1]])], dim=1)
        traces = dg.reference_traces(studio.model, sequence.to(next(studio.model.parameters()).device),
                                     prompt.shape[1])
        omega, sinks = int(config["omega"]), int(config["sinks"])
        result = dg.diagnose(traces, view.routing[name], prompt.shape[1], sinks, omega,
                             math.ceil((max_length - sinks) / omega), int(lane.summary.get("k_full", 1)))
        cells = [result[key] for _, key in DIAGNOSTIC_COLUMNS]
        cells += [result["tier_mass"][k] for k in ("full", "quantized", "evicted")] + [result["lir_policy"]["lir"]]
        rows.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.3f}" for c in cells) + " |")
    return ("Attention-drift diagnostics against FullKV attention over each lane's own tokens (Appendix I): "
            "lower FMM is better; QSA near 1 means the low-bit scores rank like full precision.\n\n" + "\n".join(rows))


def summarize(view: RunView) -> dict:
    agreement = view.agreement()
    return {"lanes": {name: {"method": lane.method, "tokens": len(lane.tokens), "total_bytes": lane.total_bytes,
                             "ratio": lane.ratio, "done": lane.done, "promotions": lane.promotions,
                             "demotions": lane.demotions, "evictions": lane.evictions,
                             "agreement": agreement.get(name, (None, None))[0]}
                      for name, lane in view.lanes.items()}}
