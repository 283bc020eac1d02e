"""The arrows between the packages point one way: qevict_kernels <- qevict_core <- storage <- ui <- app, the vLLM plugin
(qevict_vllm) on the library alone, and bench on top of everything: bench may import anything and nothing imports
bench (tests aside). Only qevict_core/backends/ imports the kernels. Every import counts, a lazy one inside a
function too."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the first-party packages it must never import
FORBIDDEN = {
    "qevict_kernels": {"qevict_core", "qevict_vllm", "storage", "ui", "bench", "app"},
    "qevict_core": {"qevict_vllm", "storage", "ui", "bench", "app"},
    "qevict_vllm": {"qevict_kernels", "storage", "ui", "bench", "app"},  # the vLLM plugin sits on the library alone
    "storage": {"qevict_kernels", "qevict_vllm", "ui", "bench", "app"},
    "ui": {"qevict_kernels", "qevict_vllm", "bench", "app"},
    "app": {"qevict_kernels", "qevict_vllm", "bench"},
}


def sources(package: str) -> list[Path]:
    """The Python files of a package (a folder) or of a top-level module (``app``: app.py)."""
    return sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else [ROOT / f"{package}.py"]


def imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_import(package):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sources(package)
             for name, line in sorted(imported_packages(path)) if name in FORBIDDEN[package]]
    assert not wrong, "imports against the architecture's direction:\n" + "\n".join(wrong)


# inside qevict_core: sub-package -> the qevict_core modules and sub-packages it must never import
INNER_FORBIDDEN = {
    "engine": {"generation", "baselines", "registry", "cli", "models", "diagnostics", "timing", "testing"},
    "backends": {"engine", "generation", "baselines", "registry", "cli"},
    "generation": {"baselines", "registry", "cli"},
    "baselines": {"generation", "registry", "cli"},
}


def qevict_core_imports(path: Path) -> set[tuple[str, int]]:
    """The qevict_core children (``engine``, ``config``, ...) a file under qevict_core/ imports, relative or not."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]  # ('qevict_core', 'engine', ...)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = list(base) + (node.module.split(".") if node.module else [])
                names = [target + [alias.name] for alias in node.names] if not node.module else [target]
            else:
                names = [(node.module or "").split(".")]
            found |= {(t[1], node.lineno) for t in names if len(t) > 1 and t[0] == "qevict_core"}
        elif isinstance(node, ast.Import):
            found |= {(a.name.split(".")[1], node.lineno) for a in node.names
                      if a.name.startswith("qevict_core.")}
    return found


def test_only_the_backends_import_the_kernels():
    """A backend is an object chosen once; everything else asks it what it can do."""
    wrong = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "qevict_core").rglob("*.py"))
             if path.parent.name != "backends"
             for name, line in imported_packages(path) if name == "qevict_kernels"]
    assert not wrong, "qevict_kernels imported outside qevict_core/backends/:\n" + "\n".join(wrong)


@pytest.mark.parametrize("sub", sorted(INNER_FORBIDDEN))
def test_inside_the_library_the_engine_sits_below_what_runs_it(sub):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports qevict_core.{name}"
             for path in sorted((ROOT / "qevict_core" / sub).rglob("*.py"))
             for name, line in sorted(qevict_core_imports(path)) if name in INNER_FORBIDDEN[sub]]
    assert not wrong, "imports against the library's direction:\n" + "\n".join(wrong)


def test_nothing_but_bench_reads_bench_s_folder():
    """bench's folder holds benchmarks and their rows; what the studio or the library needs at run time (the
    examples' text) lives with them, so no path outside bench/ and tests/ is built from a "bench" component."""
    wrong = [f"{path.relative_to(ROOT)}:{node.lineno}" for package in FORBIDDEN for path in sources(package)
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value == "bench"]
    assert not wrong, "paths into bench/ outside bench/ and tests/:\n" + "\n".join(wrong)


def test_bench_is_a_shelf_of_entry_points_each_on_its_readme():
    """Every runnable bench module is listed under bench/README.md's "Running the benchmarks", and every other
    bench module is a library some entry point imports: no script stands outside the list."""
    readme = (ROOT / "bench" / "README.md").read_text()
    shelf = readme.split("## Running the benchmarks", 1)[1].split("```", 2)[1]
    modules = {path.stem: path.read_text() for path in (ROOT / "bench").glob("*.py") if path.stem != "__init__"}
    entries = {name for name, text in modules.items() if 'if __name__ == "__main__":' in text}
    assert entries == set(re.findall(r"python -m bench\.(\w+)", shelf))
    imported = {name for text in modules.values()
                for pair in re.findall(r"from \.(\w+) import|from \. import (\w+)", text) for name in pair if name}
    assert set(modules) - entries <= imported, "bench modules nothing runs or imports"
    assert len(entries) <= 15  # 14 benchmarks and the lent GPU's preflight (bench/gpu_preflight.py)


def test_the_inner_checker_resolves_relative_imports(tmp_path):
    module = ROOT / "qevict_core" / "engine" / "probe_for_test.py"
    try:
        module.write_text("from ..registry import METHODS\nfrom . import ledger\nfrom .. import generation\n")
        assert qevict_core_imports(module) == {("registry", 1), ("engine", 2), ("generation", 3)}
    finally:
        module.unlink()


def test_the_checker_sees_a_lazy_upward_import(tmp_path):
    module = tmp_path / "leaf.py"
    module.write_text("def f():\n    from qevict_core.engine.layout import WindowGrid\n    return WindowGrid\n")
    assert ("qevict_core", 2) in imported_packages(module)


def test_file_names_are_unique_across_the_packages():
    names = {}
    for package in ("qevict_core", "qevict_vllm", "qevict_kernels", "ui", "storage", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" and path.name != "__main__.py":
                names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"files that share a name: {shared}"


def test_every_policy_file_is_a_registered_method():
    """A new eviction policy is one file in qevict_core/baselines/policies/ plus its registry line; this test (and
    test_baselines, which runs every registered eviction method at its budget) picks it up."""
    import importlib
    import inspect

    from qevict_core.baselines.policies.base import Policy
    from qevict_core.registry import METHODS

    registered = {spec.policy for spec in METHODS.values() if spec.policy is not None}
    for path in sorted((ROOT / "qevict_core" / "baselines" / "policies").glob("*.py")):
        if path.stem in ("__init__", "base"):
            continue
        module = importlib.import_module(f"qevict_core.baselines.policies.{path.stem}")
        policies = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                    if issubclass(cls, Policy) and cls is not Policy and cls.__module__ == module.__name__]
        assert policies, f"{path.name} defines no Policy"
        for cls in policies:
            assert cls in registered, f"{cls.__name__} ({path.name}) has no registry line in qevict_core/registry.py"
            assert cls.description and cls.reference, f"{cls.__name__} needs a description and a reference"


def test_the_readmes_policy_example_runs_at_its_budget(monkeypatch):
    """The contributing section's policy file and registry line, taken from README.md as written: the file becomes
    qevict_core/baselines/policies/recent.py (in memory), the line an entry of METHODS."""
    import re
    import sys
    import types

    import torch

    from qevict_core import QEvictConfig
    from qevict_core import registry
    from tests.conftest import KV, random_prompt, tiny_model

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    policy_code = next(b for b in blocks if "(Policy):" in b)
    registry_line = next(b for b in blocks if "policy(" in b and "METHODS" in b).split("#")[0].strip().rstrip(",")
    module = types.ModuleType("qevict_core.baselines.policies.recent")
    header = ("from dataclasses import dataclass\nimport torch\n"
              "from qevict_core.baselines.policies.base import Policy, ScoreInputs\n")
    exec(header + policy_code, module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    name, spec = eval("{" + registry_line + "}", {"policy": registry.policy}).popitem()
    monkeypatch.setitem(registry.METHODS, name, spec)
    assert spec.policy.__name__ == "Recent" and spec.description == module.Recent.description
    model = tiny_model("llama", 2)
    prompt = random_prompt(200)
    cache = registry.METHODS[name].build(model, QEvictConfig(budget=0.3), max_length=232)
    with torch.inference_mode():
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=32, do_sample=False)
    report = cache.memory_report()
    assert name == "recent" and out.shape[1] == 232
    assert report["total_bytes"] <= report["budget_bytes"] < report["fullkv_bytes"]


def test_every_scorer_file_is_found_and_runs():
    """A new scorer is one file in qevict_core/engine/scorers/ with a named Scorer: the config accepts its name and
    the registry's ``qevict_<name>`` ablation (every scorer but the default's) builds it."""
    import importlib
    import inspect

    from qevict_core import QEvictConfig
    from qevict_core.engine.scorers import SCORERS, Scorer, make_scorer
    from qevict_core.registry import METHODS

    folder = ROOT / "qevict_core" / "engine" / "scorers"
    for path in sorted(folder.glob("*.py")):
        if path.stem in ("__init__", "scorer_base"):
            continue
        module = importlib.import_module(f"qevict_core.engine.scorers.{path.stem}")
        classes = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                   if issubclass(cls, Scorer) and cls.__module__ == module.__name__]
        assert classes and all(cls.name for cls in classes), f"{path.name} defines no named Scorer"
        for cls in classes:
            assert SCORERS[cls.name] is cls
            unpooled = {} if cls.needs_attention else {"pool": 0}  # pooling needs attention mass
            assert type(make_scorer(QEvictConfig(scorer=cls.name, **unpooled))) is cls
            if cls.name != QEvictConfig().scorer:
                assert METHODS[f"qevict_{cls.name}"].fixed["scorer"] == cls.name


def test_a_scorer_file_is_named_after_its_scorer():
    """The config lists scorers by file name without importing them (the CLI's --help needs no torch)."""
    from qevict_core.config import SCORERS as names
    from qevict_core.engine.scorers import SCORERS

    assert names == tuple(sorted(SCORERS))
    assert all(SCORERS[name].__module__.rsplit(".", 1)[1] == name for name in SCORERS)


def test_the_registry_and_the_config_import_no_torch():
    """``qevict --help`` and every refused flag are immediate: the CLI, the config and the method names load no
    torch, transformers or engine module."""
    code = ("import sys; import qevict_core.cli; from qevict_core import QEvictConfig; "
            "QEvictConfig(pool=0); heavy = {'torch', 'transformers', 'qevict_core.engine.cache'} & set(sys.modules); "
            "assert not heavy, heavy")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_no_file_over_400_lines_and_no_studio_function_over_80():
    sources = [p for package in ("qevict_core", "qevict_vllm", "qevict_kernels", "ui", "storage", "bench")
               for p in (ROOT / package).rglob("*.py")]
    long_files = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(sources + [ROOT / "app.py"])
                  if (n := p.read_text().count("\n")) > 400]
    assert not long_files, long_files
    long_functions = []
    for path in sorted((ROOT / "ui").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long_functions, long_functions


def test_removed_method_names_live_only_in_the_migration():
    """Sessions that name a removed method are rewritten once (storage/migrate.py); nothing else keeps a
    compatibility path for them: the library, the studio and the app know only the current names."""
    from storage.migrate import RETIRED

    sources = [p for package in ("qevict_core", "qevict_vllm", "ui", "storage")
               for p in (ROOT / package).rglob("*.py") if p.name != "migrate.py"] + [ROOT / "app.py"]
    found = [f"{p.relative_to(ROOT)}: {name}" for p in sources for name in RETIRED
             if re.search(rf"\b{name}\b", p.read_text())]
    assert not found, found
