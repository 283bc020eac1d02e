"""What the fused low-bit kernels need of an sm_90 GPU (H100, H200), without one: each shipped configuration compiled
ahead of time by Triton with its bundled ptxas, then read by ``cuobjdump --dump-resource-usage``.

    python -m bench.kernels resources [--out bench/results/kernel_resources]
    python -m bench.kernels resources --device cuda     # on a GPU: what its own Triton builds, for its own chip
    # with the Triton of the lent GPUs' image (3.6), installed beside this environment's
    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python -m bench.kernels resources

A kernel that spills (a non-zero stack) is bound by local memory; shared memory decides how many programs share an
SM. tests/test_kernel_resources.py holds the shipped configurations to no stack and at most 100 KB of shared memory.
With ``--device cuda`` the same configurations are compiled for the GPU at hand and its figures read from the loaded
kernel (``n_regs``, ``n_spills``): the Triton installed there may build differently.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from itertools import product
from pathlib import Path

from .common import RESULTS, run_metadata

SPLIT_SIGNATURE = {"q_ptr": "*bf16", "k_codes_ptr": "*u8", "k_scale_ptr": "*{pair}", "k_zero_ptr": "*{pair}",
                   "v_codes_ptr": "*u8", "v_scale_ptr": "*{pair}", "v_zero_ptr": "*{pair}", "ids_ptr": "*i32",
                   "count_ptr": "constexpr", "inv_freq_ptr": "*fp32", "step_cos_ptr": "*fp32", "step_sin_ptr": "*fp32",
                   "out_ptr": "*fp32", "lse_ptr": "*fp32", "win_lse_ptr": "*fp32", "rope_scale": "fp32",
                   "qk_scale": "fp32", "cap": "i32", "windows_per_split": "i32"}
MERGE_SIGNATURE = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "fp_out_ptr": "*fp32", "fp_lse_ptr": "*fp32",
                   "win_lse_ptr": "*fp32", "ids_ptr": "*i32", "count_ptr": "constexpr", "out_ptr": "*fp32",
                   "lse_ptr": "*fp32", "mass_ptr": "*fp32", "cap": "i32"}
FP_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*{pair}", "v_ptr": "*{pair}", "count_ptr": "*i64", "out_ptr": "*fp32",
                "lse_ptr": "*fp32", "logits_ptr": "*fp32", "n": "i32", "keys_per_split": "i32", "scale": "fp32"}
QUANT_SIGNATURE = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_codes_ptr": "*u8", "v_codes_ptr": "*u8",
                   "k_scale_ptr": "*i16", "k_zero_ptr": "*i16", "v_scale_ptr": "*i16", "v_zero_ptr": "*i16",
                   "unfit_ptr": "*i8", "m": "i32", "H": "i32"}
FOLD_SIGNATURE = {"table_ptr": "*fp32", "win_mass_ptr": "*fp32", "count_ptr": "constexpr", "quant_ids_ptr": "*i32",
                  "logits_ptr": "*fp32", "lse_ptr": "*fp32", "full_ids_ptr": "*i32", "origin_ptr": "*i64", "cap": "i32",
                  "n": "i32", "n_full": "i32", "sinks": "i32", "full_tokens": "i32", "num_windows": "i32",
                  "inv_heads": "fp32"}
# (head_dim, rows = GQA group x queries, KV heads): SmolLM2 (64, 3, 3) and an 8B shape (128, 4, 8), decode steps
SHAPES = [(64, 3, 3), (128, 4, 8)]


def configurations() -> list[dict]:
    """Every (kernel, constants) the engine launches on a GPU for the shapes above, INT2 and INT4, half-precision
    pairs in float16 (the default) and bfloat16 ("model" on a bf16 model); the full-precision part over a cache in
    either 16-bit dtype (its "pair" column); no window count (the engine's tiers are always full)."""
    from qevict_kernels.fp_attention import block_keys
    from qevict_kernels.lowbit_attention import tile_windows

    out = []
    for (d, rows, hkv), bits, pair in product(SHAPES, (2, 4), ("fp16", "bf16")):
        out.append({"kernel": "split", "D": d, "R": rows, "HKV": hkv, "BITS": bits, "pair": pair,
                    "constants": dict(count_ptr=None, SPLITS=8, HKV=hkv, R=rows, BLOCK_R=16, SINKS=5, OMEGA=8,
                                      BITS=bits, D=d, WB=tile_windows(d, 8), FAST_TRIG=True)})
    for (d, rows, hkv), cache in product(SHAPES, ("bf16", "fp16")):
        out.append({"kernel": "fp", "D": d, "R": rows, "HKV": hkv, "BITS": None, "pair": cache,
                    "constants": dict(SPLITS=8, R=rows, BLOCK_R=16, D=d, BLOCK_N=block_keys(d), EXACT=False)})
    for (d, rows, hkv), bits, pair in product(SHAPES, (2, 4), ("fp16", "bf16")):
        out.append({"kernel": "quant", "D": d, "R": rows, "HKV": hkv, "BITS": bits, "pair": pair,
                    "constants": dict(OMEGA=8, BLOCK_T=8, D=d, BITS=bits, PARAM={"fp16": 1, "bf16": 2}[pair])})
    for d, rows, hkv in SHAPES:
        out.append({"kernel": "merge", "D": d, "R": rows, "HKV": hkv, "BITS": None, "pair": None,
                    "constants": dict(count_ptr=None, SPLITS=8, FP_SPLITS=8, HKV=hkv, R=rows, BLOCK_R=16, D=d,
                                      BLOCK_W=64)})
        out.append({"kernel": "fold", "D": d, "R": rows, "HKV": hkv, "BITS": None, "pair": None,
                    "constants": dict(count_ptr=None, HKV=hkv, R=rows, BLOCK_R=16, OMEGA=8, BLOCK_W=64,
                                      BLOCK_K=8)})
    return out


def compile_for_sm90(config: dict, num_warps: int = 4) -> dict:
    """-> registers, stack bytes per thread, shared memory bytes of one configuration compiled for sm_90."""
    return _compile(config, num_warps, target="sm90")


def compile_here(config: dict, num_warps: int = 4) -> dict:
    """The same for this machine's GPU, read from the loaded kernel."""
    return _compile(config, num_warps, target=None)


def _compile(config: dict, num_warps: int, target: str | None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qevict_kernels.fp_attention import _fp_kernel
    from qevict_kernels.lowbit_attention import _merge_kernel, _split_kernel
    from qevict_kernels.score_fold import _fold_kernel
    from qevict_kernels.window_quant import _quant_kernel

    fn, signature = {"split": (_split_kernel, SPLIT_SIGNATURE), "merge": (_merge_kernel, MERGE_SIGNATURE),
                     "fold": (_fold_kernel, FOLD_SIGNATURE), "fp": (_fp_kernel, FP_SIGNATURE),
                     "quant": (_quant_kernel, QUANT_SIGNATURE)}[config["kernel"]]
    signature = {k: v.format(pair=config["pair"]) for k, v in signature.items()}
    constants = config["constants"]
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    if target is None:
        compiled = triton.compile(source, options={"num_warps": num_warps})
        compiled._init_handles()
        return {"registers": compiled.n_regs, "stack": compiled.n_spills, "shared": int(compiled.metadata.shared)}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"registers": int(found["REG"]), "stack": int(found["STACK"]), "shared": int(compiled.metadata.shared)}


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=str(RESULTS / "kernel_resources"))
    parser.add_argument("--device", default="sm90", help="sm90 (ahead of time, no GPU needed) or cuda (this GPU)")


def run(args) -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    build = compile_here if args.device == "cuda" else compile_for_sm90
    import triton

    meta = run_metadata("fused low-bit kernels", args.device if args.device == "cuda" else "cpu") | {
        "triton": triton.__version__}
    rows = []
    for config in configurations():
        row = {k: v for k, v in config.items() if k != "constants"} | build(config) | {"target": args.device, **meta}
        rows.append(row)
        print(f"{row['kernel']:6s} D={row['D']:3d} R={row['R']} INT{row['BITS'] or '-'} {row['pair'] or '':4s} "
              f"registers {row['registers']:3d}  stack/spills {row['stack']:4d}  shared {row['shared'] / 1024:6.1f} KB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.device}-triton{triton.__version__}.jsonl"  # one file per Triton: each builds differently
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path}")


def table(rows: list[dict]) -> str:
    """One line per shipped configuration: registers, stack (spills) and shared memory of what was compiled, a group
    of columns per Triton version among the rows."""
    versions = sorted({r["triton"] for r in rows}, key=lambda v: tuple(int(x) for x in v.split(".")[:3]))
    by_config = {}
    for r in rows:
        key = (r["kernel"], r["D"], r["R"], r["HKV"], r["BITS"], r["pair"])
        by_config.setdefault(key, {})[r["triton"]] = r
    head = "| kernel | head_dim | query rows | KV heads | bits | pair dtype |" + "".join(
        f" registers ({v}) | stack B ({v}) | shared KB ({v}) |" for v in versions)
    lines = [head, "|---|---|---|---|---|---|" + "---|---|---|" * len(versions)]
    for (kernel, d, r_, hkv, bits, pair), built in by_config.items():
        cells = "".join(f" {b['registers']} | {b['stack']} | {b['shared'] / 1024:.1f} |" if (b := built.get(v))
                        else " — | — | — |" for v in versions)
        lines.append(f"| {kernel} | {d} | {r_} | {hkv} | {bits or '—'} | {pair or '—'} |{cells}")
    made = "; ".join(f"Triton {v} at commit {_first(rows, v)['commit']}, {_first(rows, v)['date']}" for v in versions)
    return (f"Compiled for {rows[0]['target']} with each Triton's bundled ptxas ({made}); 4 warps.\n\n"
            + "\n".join(lines) + "\n")


def _first(rows: list[dict], version: str) -> dict:
    return next(r for r in rows if r["triton"] == version)
