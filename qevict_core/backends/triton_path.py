"""QEvict without the reconstruction tax: attention and routing scores read the low-bit tier in place.

With kernels on, ``update`` returns only the full-precision keys (sinks | full | recent). Attention runs as
segments merged by log-sum-exp: the full-precision segment through PyTorch's fused attention (which returns its
LSE), the quantized segment through ``qevict_kernels.quant_attention``, which dequantizes and re-rotates the packed codes
in registers. Right after, ``qevict_kernels.window_mass`` turns the step's exp(q·k·scale - lse) into every key's attention
mass, which the layer folds into its score table — Eq. 1 without materialising attention rows or keeping queries.
The prompt (nothing quantized yet) still takes SDPA and the chunked PyTorch scorer.
"""

from __future__ import annotations

import torch

def attend(layer, query: torch.Tensor, fp_keys: torch.Tensor, fp_values: torch.Tensor, scaling: float):
    """-> (out (B, Hq, L, D), lse (B, Hq, L)) float32 over the full-precision keys and the quantized tier."""
    from qevict_kernels.merge import fp_attention_with_lse, merge_attention
    from qevict_kernels.quant_attention import quant_attention

    parts = [fp_attention_with_lse(query, fp_keys, fp_values, scaling, causal_tail=query.shape[2] > 1)]
    if layer.quant.num_windows:
        rope = layer.owner.rope
        parts.append(quant_attention(query, layer.quant, layer.owner.config.sinks, rope.inv_freq,
                                     rope.attention_scaling, scaling))
    return merge_attention(parts) if len(parts) > 1 else parts[0]


def key_mass(layer, query: torch.Tensor, query_pos: torch.Tensor, lse: torch.Tensor, fp_keys: torch.Tensor,
             scaling: float) -> torch.Tensor:
    """(B, Hkv, N) attention mass of this step's queries on every key, laid out [quantized | full precision] like
    the keys of the PyTorch path, summed over each group's query heads."""
    from qevict_kernels.window_mass import fp_mass, quant_mass

    masses = []
    if layer.quant.num_windows:
        rope = layer.owner.rope
        masses.append(quant_mass(query, query_pos, lse, layer.quant, layer.owner.config.sinks, rope.inv_freq,
                                 rope.attention_scaling, scaling))
    masses.append(fp_mass(query, query_pos, lse, fp_keys, layer.fp_positions(), scaling))
    return torch.cat(masses, dim=2)
