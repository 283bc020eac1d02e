"""Window ranking functions (Section 4.2 and Appendix J), one file each, found here by their ``name``.

A new scorer is one file in this package with a ``Scorer`` subclass (scorer_base.py) that sets ``name``, and its own
settings, if any, in a ``PARAMETERS`` literal; nothing else changes: ``QEvictConfig(scorer=name)`` accepts it, its
settings are config fields and CLI flags, and the registry's ``qevict_<name>`` ablation runs it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import TYPE_CHECKING

from .scorer_base import POOL_TIE, Scorer

if TYPE_CHECKING:
    from ...config import QEvictConfig


def _discover() -> dict[str, type[Scorer]]:
    found: dict[str, type[Scorer]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Scorer) and cls.name and cls.__module__ == module.__name__:
                if cls.name in found and found[cls.name] is not cls:
                    raise TypeError(f"two scorers named {cls.name!r}: {found[cls.name].__name__} and {cls.__name__}")
                found[cls.name] = cls
    return found


SCORERS: dict[str, type[Scorer]] = _discover()


def make_scorer(cfg: QEvictConfig) -> Scorer:
    return SCORERS[cfg.scorer].from_config(cfg)


__all__ = ["POOL_TIE", "SCORERS", "Scorer", "make_scorer"]
