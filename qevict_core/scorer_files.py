"""What each scorer file of engine/scorers/ declares, read without importing it (its module needs torch, and the
config, the CLI's ``--help`` and the studio's form must not): its name (the file's), whether it ranks by
attention mass (its class's ``needs_attention``), and its own settings (its module's ``PARAMETERS``, a literal).

A scorer's settings become ``QEvictConfig`` fields (config.py), so the CLI's flags, the vLLM plugin's settings and
the benchmarks' ``method+field=value`` read them as they read every other field: a new scorer with a setting of its
own is one file. tests/test_scorers_and_batch.py checks that what is read here is what the classes say.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).parent / "engine" / "scorers"
KINDS = {"float": float, "int": int, "bool": bool, "str": str}


@dataclass(frozen=True)
class ScorerFile:
    name: str
    needs_attention: bool
    parameters: dict[str, dict[str, Any]]  # name -> {"default", "help", "kind", and Knob's rules}


def read(path: Path) -> ScorerFile:
    tree = ast.parse(path.read_text(), filename=str(path))
    parameters: dict[str, dict[str, Any]] = {}
    needs_attention = True  # the base class's
    for node in tree.body:
        if _assigns(node, "PARAMETERS"):
            parameters = ast.literal_eval(node.value)
        if isinstance(node, ast.ClassDef):
            needs_attention = next((ast.literal_eval(item.value) for item in node.body
                                    if _assigns(item, "needs_attention")), needs_attention)
    for name, spec in parameters.items():
        missing = {"default", "help", "kind"} - set(spec)
        if missing or spec["kind"] not in KINDS:
            raise TypeError(f"{path.name}: PARAMETERS[{name!r}] needs default, help and kind (one of {sorted(KINDS)})"
                            f"; missing {sorted(missing)}")
    return ScorerFile(path.stem, needs_attention, parameters)


def _assigns(node: ast.AST, name: str) -> bool:
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(target, ast.Name) and target.id == name
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]))


def scorer_files(folder: Path = FOLDER) -> dict[str, ScorerFile]:
    """Every scorer of ``folder`` by name, in name order; two scorers may not declare the same setting."""
    found = {path.stem: read(path) for path in sorted(folder.glob("*.py"))
             if path.stem not in ("__init__", "scorer_base")}
    owners: dict[str, str] = {}
    for scorer in found.values():
        for name in scorer.parameters:
            if name in owners:
                raise TypeError(f"scorers {owners[name]!r} and {scorer.name!r} both declare a setting {name!r}")
            owners[name] = scorer.name
    return found
