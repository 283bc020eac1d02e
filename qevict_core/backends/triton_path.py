"""QEvict's decode step with the low-bit tier read in place by the fused Triton kernels (a CUDA GPU; a CPU only
under TRITON_INTERPRET=1, for the tests).

``update`` returns only the full-precision keys [sinks | full | recent]. The low-bit tier goes through one split-K
pass (``qevict_kernels.lowbit_attention``) that also writes each window's log-sum-exp; the full-precision keys of
a decode step through another over the layer's whole buffer (``qevict_kernels.fp_attention``: its unwritten slots
hidden by the device count; it writes the masked logits), or for a chunk of several tokens through PyTorch's fused
attention; one small kernel merges the two by log-sum-exp and turns the window log-sum-exps into each window's
routing mass, and one more (``qevict_kernels.score_fold``) adds the step's mass per window into the score table.
Eq. 1 without materialising attention rows or reading the low-bit keys twice: four launches per layer and step.
"""

from __future__ import annotations

import torch


def attend(layer, query: torch.Tensor, fp_keys: torch.Tensor, fp_values: torch.Tensor, scaling: float,
           scored: bool):
    """query (B, Hq, L, D); fp_keys/values (B, Hkv, n, D) [sinks | full | recent], whose last L keys are the
    queries' own tokens, or the layer's whole buffer (``layer.reads_buffer``, one query: its unwritten tail hidden).
    -> out (B, L, Hq, D) in the query dtype, and when ``scored`` the mass of the step's queries on each low-bit
    window (B, nQ) and on each full-precision key (B, n), summed over the KV heads; or None for both where the step
    folded its mass into the score table itself (``qevict_kernels.score_fold``: over the whole buffer, for a scorer
    whose fold adds)."""
    from qevict_kernels.fp_attention import buffer_attention
    from qevict_kernels.lowbit_attention import lowbit_attention, merge
    from qevict_kernels.merge import fp_attention_with_lse

    b, hq, lq, d = query.shape
    hkv = fp_keys.shape[1]
    rows = query.reshape(b, hkv, hq // hkv * lq, d)  # (B, Hkv, G*L, D): head h reads KV head h // G
    logits = None  # the full-precision keys' masked logits, when the attention already computed them
    if layer.reads_buffer:  # one launch at every fill: the few full-precision keys, the unwritten slots hidden
        fp_out, fp_lse, logits = buffer_attention(rows, fp_keys, fp_values, layer.fp.count, scaling)
    else:
        if fp_keys.dtype != query.dtype:  # a 16-bit cache beside a model computing in float32 (the interpreter's)
            fp_keys, fp_values = fp_keys.to(query.dtype), fp_values.to(query.dtype)
        fp_out, fp_lse = fp_attention_with_lse(query, fp_keys, fp_values, scaling, causal_tail=lq > 1)
        fp_out, fp_lse = fp_out.reshape(rows.shape)[:, :, None], fp_lse.reshape(rows.shape[:3])[:, :, None]  # 1 split
    quant, owner = layer.quant, layer.owner
    count = None  # every window of the tier is live (its size is what it holds): no count to fill each step
    if quant.num_windows:
        rope = owner.rope
        parts = lowbit_attention(rows, quant, count, owner.config.sinks, rope.inv_freq, rope.attention_scaling,
                                 scaling, splits=owner.lowbit_splits, step=owner.rope_step_table)
    else:  # no low-bit split: the merge joins the full-precision ones alone
        parts = (fp_out.new_empty(b, hkv, 0, *rows.shape[2:]), fp_lse.new_empty(b, hkv, 0, rows.shape[2]),
                 fp_lse.new_empty(b, hkv, 0, rows.shape[2]))
    out, lse, window_mass = merge(parts[0], parts[1], fp_out, fp_lse, parts[2], quant.ids, count, query.dtype)
    out = out.reshape(b, hq, lq, d).transpose(1, 2)  # (B, L, Hq, D), as transformers expects
    if not scored:
        return out, None, None
    if logits is not None and owner.scorer.folds_by_adding:  # the whole fold in one launch, into the table
        from qevict_kernels.score_fold import fold_step_mass

        fold_step_mass(owner.scorer.mass_table(layer.scores, layer.interval), window_mass, count, quant.ids, logits,
                       lse, layer.full_ids, layer.recent_origin, layer.fp.sinks, layer.fp.full, layer.grid.omega, hq)
        return out, None, None
    if logits is None:
        logits = rows.float() @ fp_keys.float().transpose(2, 3) * scaling  # (B, Hkv, G*L, n)
        if lq > 1:  # the queries' own tokens: bottom-right causal
            later = torch.ones(lq, lq, dtype=torch.bool, device=query.device).triu_(1)
            logits.view(b, hkv, hq // hkv, lq, -1)[..., -lq:].masked_fill_(later, float("-inf"))
    fp_mass = torch.exp(logits - lse.unsqueeze(-1)).sum(dim=2)  # (B, Hkv, n)
    return out, window_mass.sum(dim=1), fp_mass.sum(dim=1)


def prepare(cache) -> None:
    """What every decode step of ``cache`` shares, made once: the programs per (row, KV head), from the tier's
    planned capacity rather than what it holds now (a count that followed the tier would recompile the kernel as it
    fills), and the cos/sin of t·f for t < Ω, the same for every window, layer and step."""
    from qevict_kernels.lowbit_attention import default_splits, step_table, tile_windows

    shape, omega = cache.shape, cache.config.omega
    device = cache.rope.inv_freq.device
    cache.lowbit_splits = default_splits(max(1, cache.plan.k_quant), shape.batch, shape.num_kv_heads,
                                         tile_windows(shape.head_dim, omega), device)
    cache.rope_step_table = step_table(cache.rope.inv_freq, omega)
