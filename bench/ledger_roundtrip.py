"""Could a promoted window be re-quantized from its full-precision copy instead of keeping its ledger record?

    python -m bench.ledger_roundtrip

For every window of every layer of one prompt: quantize the pre-RoPE keys (the record), dequantize and rotate them
as the full tier holds them after a promotion, un-rotate and quantize again (the demotion), and compare with the
record — codes, and scales / zero-points. Repeated for ten cycles to see whether differences accumulate. A second
variant keeps the record's scales and zero-points and re-derives only the codes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from qevict_core import load_model
from qevict_core.engine.layout import WindowGrid
from qevict_core.engine.ledger import WindowLedger
from qevict_core.engine.quant import unpack
from qevict_core.engine.rope import Rope
from qevict_core.generation.model_call import call
from qevict_core.testing import tiny_model

PARAMS = ("k_scale", "k_zero", "v_scale", "v_zero")
SINKS, OMEGA, TOKENS, CYCLES = 5, 8, 1029, 10


def records(model, vocab: int, dtype: torch.dtype, bits: int):
    """(rope, positions, record) per layer for a seeded random prompt."""
    model = model.to(dtype)
    rope, cache = Rope.from_model(model), DynamicCache()
    ids = torch.randint(0, vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        call(model, ids, cache)
    windows = (TOKENS - SINKS) // OMEGA
    window_ids = torch.arange(windows, dtype=torch.int32)[None]
    positions = WindowGrid(SINKS, OMEGA).positions(window_ids)
    for layer in cache.layers:
        keys = layer.keys[:, :, SINKS:SINKS + windows * OMEGA]  # (B, H, T, D), post-RoPE
        values = layer.values[:, :, SINKS:SINKS + windows * OMEGA]
        pre = rope.unrotate(keys, positions).to(dtype)
        yield rope, positions, WindowLedger.quantize(pre, values, window_ids, OMEGA, bits)


def demoted_again(record: WindowLedger, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys recovered from the full tier's copy of a promoted window."""
    keys, _ = record.dequantize()
    full_copy = rope.rotate(keys, positions).to(keys.dtype)
    return rope.unrotate(full_copy, positions).to(keys.dtype)


def steps_moved(record: WindowLedger, first: WindowLedger, name: str) -> float:
    """Largest change of a scale or zero-point, in quantization steps of the record (zero-points near 0 make a
    relative change meaningless)."""
    step = (first.k_scale if name.startswith("k") else first.v_scale).float().abs().clamp_min(1e-12)
    return float(((getattr(record, name).float() - getattr(first, name).float()).abs() / step).max())


def compare(model, vocab: int, dtype: torch.dtype, bits: int) -> dict:
    out = {"codes": 0.0, "params_1": 0.0, "params_n": 0.0, "identical": 0, "layers": 0, "codes_kept_params": 0.0}
    for rope, positions, first in records(model, vocab, dtype, bits):
        record = first
        for cycle in range(CYCLES):
            _, values = record.dequantize()
            record = WindowLedger.quantize(demoted_again(record, rope, positions), values, record.ids, OMEGA, bits)
            change = max(steps_moved(record, first, n) for n in PARAMS)
            if cycle == 0:
                codes = torch.cat([unpack(record.k_codes, bits) != unpack(first.k_codes, bits),
                                   unpack(record.v_codes, bits) != unpack(first.v_codes, bits)], dim=2)
                out["codes"] = max(out["codes"], codes.float().mean().item())
                out["params_1"] = max(out["params_1"], change)
                out["identical"] += all(torch.equal(getattr(record, n), getattr(first, n))
                                        for n in PARAMS + ("k_codes", "v_codes"))
        out["params_n"] = max(out["params_n"], change)
        out["layers"] += 1
        # Keep the record's scales and zero-points; re-derive only the key codes.
        back = demoted_again(first, rope, positions)
        b, h, t, d = back.shape
        scale, zero = first.k_scale.unsqueeze(3), first.k_zero.unsqueeze(3)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = ((back.reshape(b, h, t // OMEGA, OMEGA, d) - zero) * inv).round_().clamp_(0, (1 << bits) - 1)
        differ = codes.to(torch.uint8).reshape(b, h, t, d) != unpack(first.k_codes, bits)
        out["codes_kept_params"] = max(out["codes_kept_params"], differ.float().mean().item())
    return out


def main() -> None:
    torch.set_num_threads(2)
    smollm2, _ = load_model(device="cpu")
    models = [("SmolLM2-135M", smollm2, smollm2.config.vocab_size), ("tiny llama", tiny_model("llama", 2), 256),
              ("tiny qwen2", tiny_model("qwen2", 2), 256)]
    print(f"{TOKENS}-token prompt, Ω={OMEGA}, {SINKS} sinks; fractions of codes that differ from the record, largest "
          f"change of scales / zero-points (in quantization steps) after 1 and {CYCLES} promote -> demote cycles\n")
    print("| model | dtype | bits | codes differ | params 1 cycle | params 10 cycles | identical records | "
          "codes differ, params kept |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (2, 4):
            for name, model, vocab in models:
                r = compare(model, vocab, dtype, bits)
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | INT{bits} | {r['codes']:.1e} | "
                      f"{r['params_1']:.1e} | {r['params_n']:.1e} | {r['identical']}/{r['layers']} | "
                      f"{r['codes_kept_params']:.1e} |")


if __name__ == "__main__":
    main()
