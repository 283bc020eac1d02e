"""The package installs beside others: the wheel's top-level names are ours alone, and what a Space installs
(requirements.txt) is what pyproject.toml declares."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.test_architecture import imported_packages

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return next(out.glob("qevict-*.whl"))


def test_the_wheel_installs_only_names_of_its_own(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"qevict_core", "qevict_kernels", "qevict_vllm"}
    assert "qevict_kernels/cpu/quant_decode.c" in names  # the C kernel's source, compiled on first use
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(metadata).decode()
    assert "Requires-Dist: torch" in text and "Requires-Python: >=3.10" in text
    assert re.search(r"Requires-Dist: triton.*extra == \"gpu\"", text)  # only the GPU path needs it


def test_the_spaces_requirements_are_the_declared_ones():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["studio"] \
        + project["optional-dependencies"]["zerogpu"]
    listed = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert [r for r in listed if r] == [re.sub(r"\s*#.*", "", r).strip() for r in declared]


def test_no_module_imports_a_package_it_does_not_declare():
    """Every third-party import of the library is a dependency; the studio's and the bench's are in their extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    import_names = {"psycopg[binary]": "psycopg", "pyyaml": "yaml"}

    def names(requirements):
        return {import_names.get(n, n).replace("-", "_") for n in
                (re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in requirements)}

    extras = project["optional-dependencies"]
    allowed = {
        "qevict_core": names(project["dependencies"] + extras["gpu"]) | {"tokenizers"},  # transformers brings it
        "qevict_kernels": names(project["dependencies"] + extras["gpu"]),
        "ui": names(project["dependencies"] + extras["studio"] + extras["zerogpu"]),
        "storage": names(project["dependencies"] + extras["studio"]),
    }
    stdlib = set(sys.stdlib_module_names)
    ours = {"qevict_core", "qevict_kernels", "qevict_vllm", "ui", "storage", "bench", "app", "tests"}
    for package, ok in allowed.items():
        for path in (ROOT / package).rglob("*.py"):
            found = {name for name, _ in imported_packages(path)}
            wrong = found - stdlib - ours - ok
            assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}, declared by no extra it needs"


@pytest.mark.slow
def test_the_readme_example_runs_from_the_wheel_alone(wheel, tmp_path):
    """The wheel unpacked on its own path (ahead of the checkout), run from outside the checkout: the README's
    library example imports nothing of the repository's folders."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## The library\n\n```python\n(.*?)```", readme, flags=re.S).group(1)
    check = ("\nimport qevict_core, qevict_kernels\n"
             f"assert qevict_core.__file__.startswith({str(target)!r}), qevict_core.__file__\n"
             f"assert qevict_kernels.__file__.startswith({str(target)!r})\n"
             "print('OK', out.shape[1], cache.memory_report()['total_bytes'] <= cache.budget_bytes)\n")
    done = subprocess.run([sys.executable, "-c", example + check], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin",
                                             "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("OK") and done.stdout.strip().endswith("True")
