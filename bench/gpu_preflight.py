"""Before bench/gpu_check.sh runs on a lent GPU: what to carry there, and whether the host can run it.

    python -m bench.gpu_preflight prepare    # here: the wheels to carry (.whl/), and the command for the device
    python -m bench.gpu_preflight            # there, the script's first step

``prepare`` downloads, for the lent machines' Python, wheels of what the steps import and their image lacks or
holds too old: transformers (5.17 was seen there), and pydantic and SQLAlchemy with what they need (the studio's
graphed-run tests import ui/), each at the version this checkout's environment runs. It prints the device call:
the command, what to carry, its time limit. The rows name this checkout's commit (the copy sent there has no git
history).

The check prints the device and the versions the rows will name, checks each package the GPU steps import against
the range pyproject.toml declares, and decodes a few tokens of a tiny random model on CUDA with FullKV and with
QEvict's PyTorch path (no Triton: the kernels' own checks are the script's ``tests`` step). It exits 2, saying what
to carry, when no step could run: no CUDA device, a package missing, torch or transformers outside its range (the
cache's interface follows transformers' minor versions), or the tiny decode failing. Another package outside its
range (numpy, pytest...) is reported and tolerated.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import traceback
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# What the GPU steps import, as pyproject.toml names them: one missing stops the script; outside its range, only
# these two do (the engine follows their interfaces), the others are reported
NEEDED = ("torch", "transformers", "accelerate", "safetensors", "numpy", "tqdm", "triton", "psutil", "scipy",
          "pytest", "pytest-timeout")
STRICT = ("torch", "transformers")
STUDIO = ("pydantic", "sqlalchemy")  # only the tests step's studio tests import them (ui/, storage/)
# Missing from the lent machines' image, or older there than pyproject.toml allows (their package list: the device
# tool's KINDS.md); carried as wheels and installed ahead of the image's
CARRY = ("transformers", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
         "sqlalchemy")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEVICE_PYTHON = "3.12"


def declared() -> dict[str, Requirement]:
    """Each package's requirement in pyproject.toml (the library's and its extras'), for this Python."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for group in project["optional-dependencies"].values() for s in group]
    out = {}
    for spec in specs:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate():
            out.setdefault(req.name, req)
    return out


def mismatches(names, requirements: dict[str, Requirement], installed=metadata.version) -> list[tuple[str, bool]]:
    """(line, fatal) per package among ``names`` that is missing (fatal) or outside its declared range (fatal for
    ``STRICT``)."""
    found = []
    for name in names:
        try:
            version = installed(name)
        except metadata.PackageNotFoundError:
            found.append((f"{name}: not installed (pyproject.toml: {requirements[name].specifier})", True))
            continue
        spec = requirements[name].specifier
        if spec and not spec.contains(version.split("+")[0], prereleases=True):
            found.append((f"{name} {version}: outside pyproject.toml's {spec}", name in STRICT))
    return found


def tiny_decode(device: str = "cuda") -> dict[str, int]:
    """A few greedy tokens of a tiny random Llama on ``device``, FullKV and QEvict's PyTorch path, through generate:
    -> tokens each decoded."""
    import torch

    from qevict_core import QEvictConfig, make_cache
    from qevict_core.generation.model_call import cache_keyword
    from qevict_core.testing import tiny_model

    model = tiny_model("llama", 2).to(device)
    ids = torch.randint(0, 256, (1, 96), device=device, generator=torch.Generator(device).manual_seed(0))
    decoded = {}
    for method in ("fullkv", "qevict"):
        cache = make_cache(method, model, QEvictConfig(budget=0.5, omega=8, kernels="torch"), max_length=160)
        out = model.generate(ids, **{cache_keyword(type(model)): cache}, max_new_tokens=24, do_sample=False)
        decoded[method] = out.shape[1] - ids.shape[1]
        print(f"tiny decode on {device}, {method}: {decoded[method]} tokens, {cache.memory_report()['total_bytes']} "
              "bytes of cache")
    return decoded


def prepare(folder: Path = ROOT / ".whl") -> str:
    """Download the wheels to carry into ``folder`` (emptied first: two versions of a package stop the install
    there) and return the device call."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    specs = [f"{name}=={metadata.version(name)}" for name in CARRY]
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", str(folder),
                    *specs], check=True)
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    wheels = ", ".join(sorted(p.name for p in folder.glob("*.whl")))
    # the script's default budget, and a minute for the wheels and the packing
    budget = int(re.search(r"BUDGET_S:-(\d+)", (ROOT / "bench" / "gpu_check.sh").read_text())[1])
    return (f"wheels in {folder.name}/: {wheels}\n"
            f"device run, carry [\"{folder.name}\"], timeout_s {budget + 60}, command:\n"
            + device_command(commit, dirty, folder.name))


def device_command(commit: str, dirty: bool, wheels: str = ".whl") -> str:
    """The command a lent machine runs: the carried wheels installed ahead of the image's, then the script, its
    rows naming ``commit``."""
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
            f"/tmp/site {wheels}/*.whl && export PYTHONPATH=/tmp/site || exit 2; "
            f"QEVICT_COMMIT={commit} QEVICT_DIRTY={int(dirty)} bash bench/gpu_check.sh")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()


def main() -> int:
    if sys.argv[1:] == ["prepare"]:
        print(prepare())
        return 0
    import torch

    print(f"python {sys.version.split()[0]}; " + ", ".join(
        f"{name} {_version(name)}" for name in NEEDED + STUDIO))
    if not torch.cuda.is_available():
        print("STOP: torch sees no CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    requirements = declared()
    found = mismatches(NEEDED, requirements)
    fatal = [line for line, stops in found if stops]
    for line in (line for line, stops in found if not stops):
        print(f"tolerated: {line}")
    for name in (name for name in STUDIO if _version(name) == "missing"):
        print(f"tolerated: {name} missing, the tests step's studio tests will fail (make gpu-prepare carries it)")
    if fatal:
        print("STOP: " + "; ".join(fatal))
        print("carry the wheels (make gpu-prepare, bench/gpu.md) and install them before the script")
        return 2
    try:
        tiny_decode()
    except Exception:  # noqa: BLE001 - whatever it is, every end-to-end step would meet it
        traceback.print_exc()
        print("STOP: a tiny model does not decode on CUDA")
        return 2
    print("preflight: ready")
    return 0


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


if __name__ == "__main__":
    sys.exit(main())
