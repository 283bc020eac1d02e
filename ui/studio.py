"""What the studio does, without Gradio: prepare a validated request, run it through the engine while persisting
the event stream step by step, and rebuild views of stored sessions. Nothing here writes for a page: ``ui/texts.py``
and the drawings (``cards``, ``plots``) present what this returns, the tabs' handlers (``run_tab``, ``replay_tab``,
``sessions_tab``) answer the controls, and ``ui/blocks.py`` wires them; ``ui/form.py`` is the door every request
passes."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from qevict_core import BudgetRaised, Lane, QEvictConfig, Sampling, make_cache
from qevict_core.config import BITS, SCORERS
from qevict_core.events import Event, event_from_dict
from qevict_core.registry import METHODS, is_reference
from storage import SessionStore
from storage.schema import parse_stored

from . import gpu
from .form import RunRequest
from .jobs import (LaneDiagnosis, RunJob, TimingJob, diagnose, diagnosis_seconds, run_events, run_seconds,
                   time_lanes, timing_seconds)
from .view import RunView

log = logging.getLogger(__name__)


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
class Timing:
    """Each lane timed alone on a run's prompt: {lane: {"tpot": seconds, "ratio": × baseline}}."""

    lanes: dict[str, dict[str, float]]
    prompt_tokens: int
    steps: int
    baseline: str


@dataclass
class Diagnosis:
    """The diagnostics of a stored run: per lane the paper's numbers; why any lane was left out."""

    lanes: dict[str, dict]
    problems: list[str]
    routed: bool = True  # False: the run has no routed lane, nothing to diagnose


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
    threads: int = field(default_factory=torch.get_num_threads)  # the most a run may use (set before the studio)
    _loaded: dict = field(default_factory=dict, repr=False)  # id -> ((updated_at, status), meta, events)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        # A lane the library runs above the asked budget says so in its card's note (prepare): not in the log.
        warnings.filterwarnings("ignore", category=BudgetRaised)
        # The model's work, as jobs that cross a process boundary on ZeroGPU (jobs.py); wrapped once, at start-up,
        # as spaces.GPU requires.
        self.events = gpu.GPU(duration=run_seconds)(self._run_events)
        self.timed = gpu.GPU(duration=timing_seconds)(self._time_lanes)
        self.diagnosed = gpu.GPU(duration=diagnosis_seconds)(self._diagnose)

    def _run_events(self, job: RunJob) -> Iterator[list[dict]]:
        yield from run_events(self.model, self.tokenizer, job)

    def _time_lanes(self, job: TimingJob) -> dict:
        return time_lanes(self.model, job)

    def _diagnose(self, lanes: tuple[LaneDiagnosis, ...], prompt_len: int) -> dict:
        return diagnose(self.model, lanes, prompt_len)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def encode(self, prompt: str) -> tuple[torch.Tensor, list[int]]:
        """-> (input ids (1, T), [start, stop) of the user's own text among them, chat-template markup excluded)."""
        if not getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            return ids, [0, ids.shape[1]]
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        return ids, self._span(text, prompt, ids.shape[1])

    def token_pieces(self, ids: list[int]) -> list[str]:
        """The text of each prompt token, by character spans: a character that several tokens encode (an emoji,
        a CJK or Hebrew character in a byte-level vocabulary) belongs to the first of them, whole, and the others
        show nothing; decoding tokens one by one would show each a piece of a byte sequence, garbled."""
        text = self.tokenizer.decode(ids)
        if not getattr(self.tokenizer, "is_fast", False):
            return self.tokenizer.batch_decode([[t] for t in ids])
        found = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if found["input_ids"] != ids:  # the text does not tokenize back to these ids: one by one, as before
            return self.tokenizer.batch_decode([[t] for t in ids])
        pieces, done = [], 0
        for _, end in found["offset_mapping"]:
            pieces.append(text[done:max(done, end)])  # from where the previous token stopped: its spaces too
            done = max(done, end)
        pieces[-1] += text[done:]
        return pieces

    def _span(self, text: str, prompt: str, length: int) -> list[int]:
        begin = text.rfind(prompt)
        if begin < 0 or not getattr(self.tokenizer, "is_fast", False):
            return [0, length]
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        inside = [i for i, (a, b) in enumerate(offsets) if a < begin + len(prompt) and b > begin]
        return [inside[0], inside[-1] + 1] if inside else [0, length]

    def prepare(self, req: RunRequest) -> tuple[torch.Tensor, list[Lane], dict]:
        """Everything that can fail on bad input happens here, before anything is stored. A lane whose method
        cannot run at the asked budget on this sequence runs at the least it can, and its note says why."""
        input_ids, span = self.encode(req.prompt)
        context = getattr(self.model.config, "max_position_embeddings", None)
        total = input_ids.shape[1] + req.sampling.max_new_tokens
        if context and total > context:
            raise ValueError(f"The prompt is {input_ids.shape[1]} tokens; with {req.sampling.max_new_tokens} new "
                             f"tokens that is {total}, beyond the model's context of {context}. Shorten it.")
        lanes, specs = [], []
        for name, method in zip(lane_names(req.methods), req.methods):
            spec = {"name": name, "method": method}
            cache = make_cache(method, self.model, req.config, max_length=total)
            if cache.fitted is not None:
                spec["budget_bytes"] = cache.fitted.needed_bytes
                spec["note"] = (f"Runs at {cache.fitted.ratio:.1%} of FullKV's bytes, not {req.config.budget:.1%}: "
                                f"this run holds only {total} tokens, and {cache.fitted.reason}. That is the least "
                                "this method can run with here; the other lanes use the budget you chose.")
            if cache.summary().get("uncompressed"):
                spec["note"] = ("The budget holds this whole run uncompressed, so this lane is FullKV: nothing is "
                                "routed, quantized or evicted.")
            spec["config"] = cache.config.to_dict()  # what this lane runs with: its method's fields, its capacities
            lanes.append(Lane(name, cache))
            specs.append(spec)
        request = {
            "model": self.model_name,
            "lanes": specs,
            "config": req.config.to_dict(),
            "sampling": {"max_new_tokens": req.sampling.max_new_tokens, "temperature": req.sampling.temperature,
                         "seed": req.sampling.seed},
            "prompt_length": input_ids.shape[1],
            "prompt_tokens": self.token_pieces(input_ids[0].tolist()),
            "prompt_span": span,
            "expected": req.expected,
        }
        return input_ids, lanes, request

    def run(self, req: RunRequest, should_stop: Callable[[], bool] = lambda: False) -> Iterator[Update]:
        """Stream the run. Each lane's step is written before it is shown, so a crash loses at most the step in
        flight; a stopped, failed or abandoned run (the generator closed) keeps what was written. The model runs
        as a job (``jobs.run_events``): on ZeroGPU in a forked process, whose yields are all this sees of it."""
        input_ids, _, request = self.prepare(req)
        session_id, token = self.store.create(req.prompt, request)
        view, status, message = RunView(request), "running", ""
        stop_file = os.path.join(tempfile.gettempdir(), f"qevict-stop-{session_id}")
        job = RunJob(tuple(input_ids[0].tolist()), tuple((lane["name"], lane["method"]) for lane in request["lanes"]),
                     req.config.to_dict(), req.sampling.max_new_tokens, req.sampling.temperature, req.sampling.seed,
                     stop_file, self.threads)
        stream = self.events(job)
        try:
            yield Update(view, session_id, token, True, status)
            routing_changed = False
            for batch in stream:
                if should_stop() and not os.path.exists(stop_file):
                    open(stop_file, "w").close()  # the job stops after the step in flight
                for data in batch:
                    routing_changed |= view.apply(event_from_dict(data))
                self.store.append(session_id, batch)
                step = batch[-1]["step"]
                if all(lane.done or len(lane.tokens) > step for lane in view.lanes.values()):
                    yield Update(view, session_id, token, routing_changed, status)
                    routing_changed = False
            errors = [lane.done for lane in view.lanes.values() if (lane.done or "").startswith("error")]
            status = "error" if errors else "stopped" if should_stop() else "done"
            message = "; ".join(errors)
            view.status = status
        except Exception as err:  # keep what was generated; say what went wrong
            log.exception("run %s failed", session_id)
            status, message = "error", str(err)
            view.status = status
        finally:
            stream.close()  # an abandoned run (tab closed): on ZeroGPU this releases the GPU worker
            if os.path.exists(stop_file):
                os.unlink(stop_file)
            self.store.finish(session_id, status if status != "running" else "stopped", summarize(view))
        yield Update(view, session_id, token, True, status, message)

    def load(self, session_id: str) -> tuple[dict, list[Event]]:
        """A stored session, checked against the schema -> (meta, typed events); LookupError when missing, ValueError
        when malformed, so one bad row is a message on its own page and nothing else. The replay slider reloads
        at every step: sessions are kept validated until they change."""
        try:
            meta = self.store.get(session_id or "")
        except ValueError as err:  # its JSON could not even be decoded
            raise ValueError(f"Session `{session_id}` is stored in a form this studio cannot show ({err}).") from None
        if meta is None:
            raise LookupError(f"No such session: `{(session_id or '')[:64]}`")
        version = (meta["updated_at"], meta["status"])
        with self._lock:
            cached = self._loaded.get(session_id)
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        try:
            events = self.store.events(session_id)
            request, parsed = parse_stored(meta["prompt"], meta["request"], events)
        except ValueError as err:
            raise ValueError(f"Session `{session_id}` is stored in a form this studio cannot show ({err}).") from None
        meta = {**meta, "request": request.model_dump(mode="json")}
        events = [event_from_dict(event.model_dump(mode="json")) for event in parsed]
        with self._lock:
            self._loaded[session_id] = (version, meta, events)
            while len(self._loaded) > 8:
                self._loaded.pop(next(iter(self._loaded)))
        return meta, events

    def time_lanes(self, session_id: str, new_tokens: int = 33, rounds: int = 1) -> Timing:
        """The stored run's lanes rebuilt on its prompt and timed alone, their decode steps interleaved in one
        process (``qevict_core.timing``, what ``bench.tpot`` measures): ms per token and the ratio to FullKV (or to
        the first lane when there is no FullKV lane)."""
        meta, _ = self.load(session_id)
        request = meta["request"]
        req = RunRequest(meta["prompt"], tuple(lane["method"] for lane in request["lanes"]),
                         QEvictConfig.from_dict(request["config"]), Sampling(max_new_tokens=new_tokens))
        input_ids, _, spec = self.prepare(req)
        names = [lane["name"] for lane in spec["lanes"]]
        baseline = next((lane["name"] for lane in spec["lanes"] if is_reference(lane["method"])), names[0])
        job = TimingJob(tuple(input_ids[0].tolist()), tuple((lane["name"], lane["method"]) for lane in spec["lanes"]),
                        req.config.to_dict(), new_tokens, rounds, baseline)
        timed = self.timed(job)  # on the model's one worker (Gradio's "gpu" queue), never beside a generation
        return Timing(timed, input_ids.shape[1], new_tokens - 1, baseline)

    def replay(self, session_id: str, step: int | None = None) -> tuple[RunView, int, dict]:
        """The view of a stored session at ``step`` (None: the end), its last step and its metadata."""
        meta, events = self.load(session_id)
        view = RunView(meta["request"], meta["status"])
        last = max((e.step for e in events), default=0)
        for event in events:
            if step is None or event.step <= step:
                view.apply(event)
        return view, last, meta


def diagnose_run(studio: Studio, session_id: str) -> Diagnosis:
    """The paper's diagnostics for every routed lane of a stored run, against FullKV attention over that lane's
    own tokens (recomputed with eager attention: seconds for a few thousand tokens on CPU). LookupError or
    ValueError when the session is missing or cannot be read."""
    view, _, meta = studio.replay(session_id)
    lanes = view.routed_lanes()
    if not lanes:
        return Diagnosis({}, [], routed=False)
    prompt, _ = studio.encode(meta["prompt"])
    sampling = meta["request"]["sampling"]
    max_length = prompt.shape[1] + sampling["max_new_tokens"]
    problems, jobs = [], []
    vocab = int(getattr(studio.model.config, "vocab_size", 0) or 0)
    for name in lanes:
        lane = view.lanes[name]
        if len(lane.tokens) < 2:
            problems.append(f"`{name}`: fewer than two generated tokens, nothing to diagnose.")
        elif prompt.shape[1] != int(meta["request"]["prompt_length"]):
            problems.append(f"`{name}`: this model reads the stored prompt as {prompt.shape[1]} tokens, the run "
                            f"had {meta['request']['prompt_length']}: it was made with another model or tokenizer.")
        elif vocab and max(lane.tokens) >= vocab:
            problems.append(f"`{name}`: token id {max(lane.tokens)} is outside this model's vocabulary "
                            f"({vocab} ids): the run was made with another model.")
        else:
            jobs.append(LaneDiagnosis(name, tuple(prompt[0].tolist() + lane.tokens[:-1]), view.routing[name],
                                      view.grid(name).count(max_length), int(lane.summary.get("k_full", 1))))
    results = studio.diagnosed(tuple(jobs), prompt.shape[1]) if jobs else {}
    problems += [f"`{name}`: cannot be diagnosed ({result})." for name, result in results.items()
                 if isinstance(result, str)]
    return Diagnosis({name: r for name, r in results.items() if not isinstance(r, str)}, problems)


def summarize(view: RunView) -> dict:
    agreement = view.agreement()
    return {"lanes": {name: {"method": lane.method, "tokens": len(lane.tokens), "total_bytes": lane.total_bytes,
                             "ratio": lane.ratio, "done": lane.done, "promotions": lane.promotions,
                             "demotions": lane.demotions, "agreement": agreement.get(name, (None, None))[0]}
                      for name, lane in view.lanes.items()}}
