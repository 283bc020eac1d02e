"""The door: what a visitor (browser or API client) may send to Generate, as a declared schema.

Gradio's sliders clamp typed values in the browser but an API client can send anything JSON holds, so every value
is checked here against the ranges the controls show, non-finite numbers included, and a refusal names the
control, the allowed range and the value that was sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from qevict_core import QEvictConfig, Sampling
from qevict_core.config import BITS, SCORER_FILES, SCORERS
from qevict_core.registry import METHODS
from storage.schema import MAX_PROMPT_CHARS, message

NO_LANE = "(none)"
MAX_NEW_TOKENS = 512
LABELS = {
    "prompt": "Prompt", "lanes": "Lanes", "budget": "KV budget", "omega": "Ω (window)",
    "q_frac": "q (quantized share)", "coverage": "coverage κ",
    "bits": "bits", "sinks": "sinks", "recent": "recent", "scorer": "scorer", "promotion": "promotion",
    "max_new_tokens": "Max new tokens", "temperature": "temperature", "seed": "seed", "layer": "layer",
    "expected": "Expected answer",
}


def _number(low: float, high: float) -> Any:
    return Field(ge=low, le=high, allow_inf_nan=False)


def _whole(value: Any) -> Any:
    """Sliders send 8.0 for 8: an integral float is that int; anything else is left for the strict check to refuse
    (a string, a bool, 8.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        raise ValueError("must be a whole number")
    return value


Whole = Annotated[int, BeforeValidator(_whole)]
# The studio's own limits where they are tighter than the library's (a public form: no visitor asks for a 10,000-token
# Ω), as (lowest, highest) replacing the declaration's end; coverage 0 stands for None (Eq. 3's split by q).
CAPS = {"budget": (0.01, None), "omega": (None, 64), "sinks": (None, 64), "recent": (None, 1024),
        "coverage": (0.0, None)}


def knob_field(name: str) -> Any:
    """The form's type for the config field ``name``: its declaration (``QEvictConfig.knobs()``: kind, range,
    choices), narrowed by ``CAPS``. The API's schema is read from the form, so it says the same."""
    spec = QEvictConfig.knobs()[name]
    kind = Whole if spec.kind is int else spec.kind
    if spec.choices is not None:
        return Annotated[kind, Field(json_schema_extra={"enum": list(spec.choices)})]
    if spec.kind is bool:
        return bool
    low, high = CAPS.get(name, (None, None))
    bounds = {("ge" if low is not None or "low" not in spec.open else "gt"): spec.low if low is None else low,
              ("le" if high is not None or "high" not in spec.open else "lt"): spec.high if high is None else high}
    return Annotated[kind, Field(**{k: v for k, v in bounds.items() if v is not None},
                                 **({"allow_inf_nan": False} if spec.kind is float else {}))]


class RunForm(BaseModel):
    """The Generate controls. Ranges are the controls' own; ints accept integral floats (sliders send 8.0)."""

    # strict: "16", "yes" or ["a"] are refused, not converted (the API takes JSON, where types are the caller's)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
    lanes: Annotated[list[str | None], Field(min_length=1, max_length=3)]
    budget: knob_field("budget")
    omega: knob_field("omega")
    q_frac: knob_field("q_frac")
    coverage: knob_field("coverage") = QEvictConfig().coverage or 0.0  # 0: Eq. 3's split by q
    bits: knob_field("bits")
    sinks: knob_field("sinks")
    recent: knob_field("recent")
    scorer: knob_field("scorer")
    promotion: knob_field("promotion")
    max_new_tokens: Annotated[Whole, Field(ge=1, le=MAX_NEW_TOKENS)]
    temperature: Annotated[float, _number(0.0, 2.0)] = 0.0
    seed: Annotated[Whole, Field(ge=0, le=2**31 - 1)] = 0
    expected: Annotated[str, Field(max_length=200)] = ""

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str) -> str:
        if not prompt.strip():
            raise ValueError("it is empty: write one or pick an example")
        return prompt

    @field_validator("lanes")
    @classmethod
    def _methods(cls, lanes: list[str | None]) -> list[str | None]:
        unknown = [m for m in lanes if m and m != NO_LANE and m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {[m[:40] for m in unknown]}; allowed: {list(METHODS)} or {NO_LANE}")
        if not any(m and m != NO_LANE for m in lanes):
            raise ValueError("choose at least one lane")
        return lanes

    @field_validator("bits")
    @classmethod
    def _bits(cls, bits: int) -> int:
        if bits not in BITS:
            raise ValueError(f"must be one of {BITS}")
        return bits

    @field_validator("scorer")
    @classmethod
    def _scorer(cls, scorer: str) -> str:
        if scorer not in SCORERS:
            raise ValueError(f"must be one of {SCORERS}")
        return scorer


SCHEMA_KEYS = ("type", "enum", "minimum", "maximum", "maxLength", "default")


def api_schema(name: str) -> dict:
    """The JSON schema the ``/generate`` API advertises for one control: the form's own declaration (RunForm), so
    the API says exactly what its validator accepts. Each lane takes one of the runnable methods (ablations too) or
    "(none)"; ``layer``, ``head`` and ``shown_lane`` are the views' pickers, checked by the handler."""
    if name == "lane":
        return {"type": "string", "enum": [NO_LANE, *METHODS]}
    if name in ("layer", "head"):
        return {"type": "integer", "minimum": 0}
    if name == "shown_lane":
        return {"anyOf": [{"type": "string"}, {"type": "null"}],
                "description": "the lane whose routing the views draw (a routed lane)"}
    field = dict(RunForm.model_json_schema()["properties"][name])
    # bounds pydantic could not turn into JSON schema's (a validator wraps the whole numbers) come as ge/le
    field.setdefault("minimum", field.get("ge")) if "ge" in field else None
    field.setdefault("maximum", field.get("le")) if "le" in field else None
    return {key: field[key] for key in SCHEMA_KEYS if key in field}


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    methods: tuple[str, ...]
    config: QEvictConfig
    sampling: Sampling
    expected: str = ""


DEFAULTS = QEvictConfig()


@dataclass
class Controls:
    """The Generate form's controls as sent (an API client can send anything), with the values the form opens
    with; ``parse_request`` checks them. Their names are the controls' in ``blocks`` and the parameters of the
    ``/generate`` API."""

    prompt: Any = ""
    lane1: Any = "fullkv"
    lane2: Any = "snapkv"
    lane3: Any = "qevict"
    budget: Any = DEFAULTS.budget
    omega: Any = DEFAULTS.omega
    q_frac: Any = DEFAULTS.q_frac
    bits: Any = DEFAULTS.bits
    sinks: Any = DEFAULTS.sinks
    recent: Any = DEFAULTS.recent
    scorer: Any = DEFAULTS.scorer
    promotion: Any = DEFAULTS.promotion
    max_new_tokens: Any = 64
    temperature: Any = 0.0
    seed: Any = 0
    expected: Any = ""
    coverage: Any = DEFAULTS.coverage or 0.0

    @classmethod
    def lanes(cls, methods: list[Any], **values: Any) -> Controls:
        """Controls with up to three lanes from a list (the rest "(none)")."""
        methods = list(methods) + [NO_LANE] * (3 - len(methods))
        if len(methods) > 3:
            raise ValueError(f"{LABELS['lanes']}: at most 3 (got {len(methods)})")
        return cls(lane1=methods[0], lane2=methods[1], lane3=methods[2], **values)


def parse_request(controls: Controls) -> RunRequest:
    """Raw control values -> a request; ValueError naming the control, what is allowed and what was sent."""
    c = controls
    try:
        form = RunForm(prompt=c.prompt, lanes=[c.lane1, c.lane2, c.lane3], budget=c.budget, omega=c.omega,
                       q_frac=c.q_frac, bits=c.bits, sinks=c.sinks, recent=c.recent, scorer=c.scorer,
                       promotion=c.promotion, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                       seed=c.seed, expected=c.expected if c.expected is not None else "", coverage=c.coverage)
    except ValidationError as err:
        raise ValueError(readable(err)) from None
    chosen = tuple(m for m in form.lanes if m and m != NO_LANE)
    config = QEvictConfig(budget=form.budget, omega=form.omega, q_frac=form.q_frac, coverage=form.coverage or None,
                          bits=form.bits, sinks=form.sinks, recent=form.recent, scorer=form.scorer,
                          promotion=form.promotion, record_events=True,
                          # an attention-free scorer's scores are not attention masses, so nothing pools them
                          **({} if SCORER_FILES[form.scorer].needs_attention else {"pool": 0}))
    sampling = Sampling(max_new_tokens=form.max_new_tokens, temperature=form.temperature, seed=form.seed)
    return RunRequest(form.prompt, chosen, config, sampling, form.expected.strip())


def readable(err: ValidationError) -> str:
    """One sentence per problem: '<control>: <what is wrong> (got <value>)'."""
    problems = []
    for item in err.errors()[:4]:
        field = str(item["loc"][0]) if item["loc"] else "request"
        value = repr(item.get("input"))
        shown = value if len(value) <= 40 else value[:37] + "..."
        got = f" (got {shown})" if field not in ("prompt", "lanes") and item.get("input") is not None else ""
        problems.append(f"{LABELS.get(field, field)}: {message(item)}{got}")
    return "; ".join(problems) + "."
