"""Eviction baselines, one file each, all on :class:`~qevict_core.baselines.policies.base.Policy`; the registry
(``qevict_core/registry.py``) names each. ``from qevict_core.baselines.policies import SnapKV`` finds a policy in its own
module, so a new policy needs no line here."""

import importlib
import pkgutil


def __getattr__(name: str):
    for module in pkgutil.iter_modules(__path__):
        found = getattr(importlib.import_module(f"{__name__}.{module.name}"), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
