"""Modules that moved, so old code that imports them gets an error naming the new place instead of a bare
``ModuleNotFoundError``."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "qevict_core.eviction": "qevict_core.baselines.eviction",
    "qevict_core.kivi": "qevict_core.baselines.kivi",
    "qevict_core.kvquant": "qevict_core.baselines.kvquant",
    "qevict_core.zipcache": "qevict_core.baselines.zipcache",
    "qevict_core.policies": "qevict_core.baselines.policies",
    "qevict_core.cpu_path": "qevict_core.backends.cpu_path",
    "qevict_core.fast_path": "qevict_core.backends.triton_path (the backend object: qevict_core.backends.choose)",
    **{f"qevict_core.{name}": f"qevict_core.engine.{name}" for name in (
        "cache", "cache_base", "qevict_layer", "head_cache", "head_move", "head_step", "budget", "ledger", "routing",
        "quant", "layout", "rope", "assemble", "attention")},
    "qevict_core.staging": "qevict_core.engine.prompt_stage",
    "qevict_core.scoring": "qevict_core.engine.key_mass",
    "qevict_core.scorers": "qevict_core.engine.scorers",
    "qevict_core.generate": "qevict_core.generation.generate",
    "qevict_core.prefill": "qevict_core.generation.prefill",
    "qevict_core.shared_prefill": "qevict_core.generation.lanes_forward",
    "qevict_core.padded": "qevict_core.generation.padded",
    "qevict_core.fullkv": "qevict_core.baselines.fullkv",
}


class MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                raise ModuleNotFoundError(f"{name} moved: import it from {new}{name[len(old):]}", name=name)
        return None


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())  # last: only names nothing else can find reach it
