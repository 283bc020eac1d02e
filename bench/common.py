"""What every benchmark script shares: model and thread setup, run metadata, JSONL files, sharding."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Variant:
    """A benchmark lane, named ``method[+field=value...][@path][/N]``: the one way every benchmark names what it runs.

    ``method`` is a registered method (``qevict_core.list_methods(ablations=True)``); ``+field=value`` changes a
    ``QEvictConfig`` field for this lane, the value read as JSON (``qevict+bits=4+scale_dtype=float16``); ``@path``
    forces the low-bit tier's attention path (``@torch``, ``@cpu``, ``@triton``); ``/N`` reads the prompt in chunks of
    N tokens (``qevict_core.generation.prefill``). A registered method may fix a field (``r1`` fixes Ω = 1): a lane that asks
    otherwise is refused rather than silently measuring something else."""

    spec: str
    method: str
    fields: dict
    kernels: str
    chunk: int | None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        from qevict_core import QEvictConfig
        from qevict_core.registry import method_info

        rest, slash, chunk = spec.strip().partition("/")
        if slash and not (chunk.isdigit() and int(chunk) >= 1):
            raise ValueError(f"{spec!r}: the prefill chunk after '/' must be a whole number of tokens >= 1")
        rest, _, kernels = rest.partition("@")
        name, *changes = rest.split("+")
        method_info(name)  # unknown names fail here, with the list of known ones
        fields = {}
        for change in changes:
            field, equals, text = change.partition("=")
            if not (equals and field and text):
                raise ValueError(f"{spec!r}: each change after '+' must be field=value (got {change!r})")
            try:
                fields[field] = json.loads(text)
            except json.JSONDecodeError:
                fields[field] = text
        known = set(QEvictConfig.__dataclass_fields__)
        if set(fields) - known:  # a retired field too: from_dict reads stored configs that still name one
            raise ValueError(f"{spec!r}: unknown config keys {sorted(set(fields) - known)}; allowed: {sorted(known)}")
        QEvictConfig.from_dict({**fields, "kernels": kernels or "auto"})  # bad values: refused here
        return cls(spec.strip(), name, fields, kernels or "auto", int(chunk) if slash else None)

    @property
    def budgeted(self) -> bool:
        """Whether the method takes a byte budget (FullKV and the quantization baselines run once)."""
        from qevict_core.registry import method_info

        return method_info(self.method).family in ("qevict", "eviction")

    def config(self, budget: float | None, **extra):
        from qevict_core import QEvictConfig

        return QEvictConfig(budget=budget or 1.0, kernels=self.kernels, **{**self.fields, **extra})

    def make_cache(self, model, budget: float | None, max_length: int, batch_size: int = 1, **extra):
        """A fresh cache of this lane; refused when the method fixes a field the lane changes."""
        from qevict_core import make_cache

        if self.fields and not self.budgeted:  # FullKV and the quantization baselines read no QEvictConfig field
            raise ValueError(f"{self.spec!r}: {self.method} takes no QEvictConfig fields")
        cache = make_cache(self.method, model, self.config(budget, **extra), max_length=max_length,
                           batch_size=batch_size)
        for field, value in self.fields.items():
            if getattr(cache.config, field) != value:
                raise ValueError(f"{self.spec!r}: {self.method} fixes {field} = {getattr(cache.config, field)!r}")
        return cache


def setup(model_name: str | None, device: str | None, threads: int | None, dtype: str | None = None):
    """Pin threads (shared machines are noisy: say how many), load the model; -> (model, tokenizer, meta).

    ``model_name="tiny"`` is a tiny random model with a byte tokenizer, for smoke runs in CI.
    """
    from qevict_core import load_model
    from qevict_core.testing import tiny_chat_model, tiny_tokenizer

    if threads:
        torch.set_num_threads(threads)
    if model_name == "tiny":
        model, tokenizer = tiny_chat_model(max_position_embeddings=16384), tiny_tokenizer()
    else:
        model, tokenizer = load_model(model_name, device=device, dtype=dtype)
    meta = run_metadata(model_name or "SmolLM2-135M-Instruct", str(next(model.parameters()).device))
    return model, tokenizer, meta


def add_model_args(parser, model_help: str = "bundled SmolLM2 by default; a local HF folder, a hub id or 'tiny'"):
    """The --model / --device / --threads flags every benchmark takes (see ``setup``)."""
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; pin it on shared machines")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_metadata(model_name: str, device: str) -> dict:
    """What a row must say about where it came from: ``commit`` is HEAD and ``dirty`` whether a tracked file
    differed from it (a row from a dirty tree is not reproducible from its commit)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    # A copy of the tree sent to a lent GPU host may carry a .git that is not the tree's: the sender names the commit.
    if os.environ.get("QEVICT_COMMIT"):
        commit, dirty = os.environ["QEVICT_COMMIT"], os.environ.get("QEVICT_DIRTY", "0") == "1"
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"model": model_name, "device": device, "gpu": gpu, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "commit": commit, "dirty": dirty, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as rows name it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")


def kv_dtype(cache) -> str:
    """The dtype a cache stores full-precision keys and values in (its byte counts are in it), for rows."""
    return dtype_name(cache.shape.dtype)


def kv_dtypes(model, lanes: list[tuple[str, float | None]], max_length: int) -> dict[str, str]:
    """What each lane's cache stores its full-precision keys and values in (a cache as the run builds it)."""
    return {spec: kv_dtype(Variant.parse(spec).make_cache(model, budget, max_length)) for spec, budget in lanes}


def read_jsonl(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as handle:
            rows.extend(json.loads(line) for line in handle if line.strip())
    return rows


def append_jsonl(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()


def parse_shard(text: str | None) -> tuple[int, int]:
    """``i/n`` from the flag, else RANK/WORLD_SIZE from torchrun or accelerate, else 0/1."""
    if text:
        index, _, count = text.partition("/")
        shard = (int(index), int(count or 1))
    else:
        shard = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    if not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard must be i/n with 0 <= i < n (got {shard[0]}/{shard[1]})")
    return shard


def default_device() -> str | None:
    """Under a multi-GPU launcher each process takes its own GPU."""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return None


def method_lanes(specs: list[str], budgets: list[float]) -> list[tuple[str, float | None]]:
    """(lane spec, budget) cells: lanes whose method takes no byte budget (fullkv, KIVI) run once. Every spec is
    parsed first, so a bad one fails before anything runs."""
    cells = []
    for spec in specs:
        variant = Variant.parse(spec)
        cells += [(variant.spec, b) for b in budgets] if variant.budgeted else [(variant.spec, None)]
    return cells
