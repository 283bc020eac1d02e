"""Token-eviction baselines on the same cache framework as QEvict, at the same measured bytes.

Each KV head keeps its own chronological list of tokens, ``keys[h]: (B, n_h, D)``. Uniform policies keep the same
count per head (attention runs on the stacked (B, H, N, D) tensors); per-head-budget policies (AdaKV, DefensiveKV)
keep different counts, and their memory is really freed per head (attention then runs head by head). A policy
(``qevict_core.baselines.policies``) ranks tokens; this layer does the top-k, the gathers and the byte budget.

Budget: every method gets the same ``budget_bytes``. ``capacity`` = tokens per head that fit it, counting K/V and
any accumulated score. Prefill-only policies pick ``capacity - reserve`` tokens after the prompt and keep
``reserve = min(new tokens, capacity / 2)`` slots for decoding; once those fill up, decoded tokens roll (the
oldest token outside the prefill selection leaves first), so the byte budget holds for any generation length.
Keys stay post-RoPE at their original positions, in chronological order, so no positions need storing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.attention import sdpa_with_positions
from ..engine.budget import ID_BYTES, SCORE_BYTES, BudgetTooSmall, KVShape, budget_bytes_of
from ..engine import cache_base
from ..engine.cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig
from .policies.base import Policy, ScoreInputs
from ..engine.key_mass import attention_probs, kv_head_mass


COUNTER_BYTES = torch.empty(0, dtype=torch.long).element_size()  # a fixed-buffer layer's device counter


@dataclass(frozen=True)
class EvictionPlan:
    budget_bytes: int
    capacity: int  # tokens per KV head per layer (average, for per-head-budget policies)


def plan_eviction(shape: KVShape, cfg: QEvictConfig, policy: Policy, max_length: int,
                  index_bytes: int | None = None) -> EvictionPlan:
    """``index_bytes``: what each layer keeps besides its tokens (fixed buffers' device counters); by default the
    lists', each head's length where heads keep different counts."""
    budget = budget_bytes_of(shape, cfg, max_length)
    per_token = 2 * shape.batch * shape.head_dim * shape.element_size
    if policy.scores_from == "all":
        per_token += shape.batch * SCORE_BYTES
    fixed = (shape.num_kv_heads * ID_BYTES if policy.ragged else 0) if index_bytes is None else index_bytes
    capacity = max(0, budget // shape.num_layers - fixed) // (shape.num_kv_heads * per_token)
    # A sequence that fits whole is never compressed, so the policy's own minimum does not apply to it.
    least = min(policy.min_capacity(), max_length)
    if capacity < least:
        needed = shape.num_layers * (fixed + least * shape.num_kv_heads * per_token)
        raise BudgetTooSmall(f"budget of {budget} bytes holds {capacity} tokens per head; {policy.label} needs at "
                             f"least {least} ({needed} bytes): raise the budget", needed,
                             f"it keeps at least {least} tokens per head")
    return EvictionPlan(budget, capacity)


class EvictionLayer(ReportingLayer):
    def lazy_initialization(self, key_states, value_states):
        b, heads = key_states.shape[:2]
        if b != self.owner.shape.batch:
            raise ValueError(f"cache was made for batch size {self.owner.shape.batch}, got {b}")
        self.keys = [key_states[:, h, :0] for h in range(heads)]  # each (B, n_h, D)
        self.values = [value_states[:, h, :0] for h in range(heads)]
        self.acc = ([torch.zeros(b, 0, device=key_states.device) for _ in range(heads)]
                    if self.owner.policy.scores_from == "all" else None)
        self.lengths = torch.zeros(heads, dtype=torch.int32) if self.owner.policy.ragged else None
        self.frozen = [0] * heads  # oldest tokens per head that never roll out (the prefill selection)
        self.limit = [self.owner.plan.capacity] * heads
        self.compressed = False
        self.pending = None
        self.is_initialized = True

    def append(self, key_states, value_states):
        for h in range(len(self.keys)):
            self.keys[h] = torch.cat([self.keys[h], key_states[:, h]], dim=1)
            self.values[h] = torch.cat([self.values[h], value_states[:, h]], dim=1)
            if self.acc is not None:
                self.acc[h] = torch.cat([self.acc[h], self.acc[h].new_zeros(key_states.shape[0],
                                                                            key_states.shape[2])], dim=1)
        # Attention reads the per-head stores; the new states only identify this call.
        return key_states, value_states

    def _stacked(self):
        if len({k.shape[1] for k in self.keys}) != 1:
            return None
        return torch.stack(self.keys, dim=1), torch.stack(self.values, dim=1)  # (B, H, N, D)

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        dense = self._stacked()
        if not output:
            out = None
        elif dense is not None:
            out = sdpa_with_positions(module, query, *dense, scaling, dropout)
        else:
            g = module.num_key_value_groups
            out = torch.cat([sdpa_with_positions(module, query[:, h * g:(h + 1) * g], self.keys[h][:, None],
                                                 self.values[h][:, None], scaling, dropout)
                             for h in range(len(self.keys))], dim=2)
        policy = self.owner.policy
        if policy.scores_from == "all":
            self._accumulate(query, dense[0], scaling, module.num_key_value_groups)
        if policy.compress_at == "step":
            self._evict_by_score()
        elif not self.compressed:
            self._compress_prompt(module, query, dense, scaling)
        else:
            self._roll()
        return out

    def _accumulate(self, query, keys, scaling, groups):
        b, n = keys.shape[0], keys.shape[2]
        key_pos = torch.arange(n, device=keys.device).expand(b, -1)
        query_pos = torch.arange(n - query.shape[2], n, device=keys.device)
        mass = kv_head_mass(query, query_pos, keys, key_pos, scaling) / groups  # mean over the GQA group
        for h in range(len(self.acc)):
            self.acc[h] += mass[:, h]

    def _evict_by_score(self):
        n, capacity = self.keys[0].shape[1], self.owner.plan.capacity
        if n > capacity:
            keep, tail = self.owner.policy.split(capacity, 0)
            scores = torch.stack(self.acc, dim=1)[:, :, :n - tail]
            self.apply_selection(scores, [keep] * len(self.keys), tail, spare=capacity - keep)

    def _compress_prompt(self, module, query, dense, scaling):
        policy, capacity = self.owner.policy, self.owner.plan.capacity
        keys, values = dense
        n = keys.shape[2]
        reserve = min(self.owner.max_length - n, capacity // 2)
        keep, tail = policy.split(capacity, reserve)
        if n <= keep + tail:
            self.compressed = True
            self.frozen = [max(0, min(keep, n - tail))] * len(self.keys)
            return
        probs = None
        if policy.scores_from == "window":
            w = min(policy.window, query.shape[2])
            key_pos = torch.arange(n, device=keys.device).expand(keys.shape[0], -1)
            probs = attention_probs(query[:, :, -w:], torch.arange(n - w, n, device=keys.device), keys, key_pos,
                                    scaling)
        scores = policy.score(ScoreInputs(keys, values, module, keep, n - tail, probs))[:, :, :n - tail]
        if policy.cross_layer:
            self.pending = (scores, keep, tail, capacity - keep)
            if self.layer_idx == len(self.owner.layers) - 1:
                self.owner.select_across_layers()
            return
        self.apply_selection(scores, policy.allocate(scores, keep), tail, capacity - keep)

    def apply_selection(self, scores, counts: list[int], tail: int, spare: int) -> None:
        """Keep, per head, its top-``counts[h]`` candidates and the last ``tail`` tokens; the head may then grow
        to ``counts[h] + spare`` tokens (tail + decoding reserve) before decoded tokens roll."""
        picked = self.owner.policy.select(scores, counts)
        n = self.keys[0].shape[1]
        tail_idx = torch.arange(n - tail, n, device=scores.device).expand(scores.shape[0], -1)
        before = sum(k.shape[1] for k in self.keys)
        for h, idx in enumerate(picked):
            keep = torch.cat([idx, tail_idx], dim=1)
            self.keys[h] = self.keys[h].gather(1, keep[..., None].expand(-1, -1, self.keys[h].shape[-1]))
            self.values[h] = self.values[h].gather(1, keep[..., None].expand(-1, -1, self.values[h].shape[-1]))
            if self.acc is not None:
                self.acc[h] = self.acc[h].gather(1, keep)
            self.frozen[h] = counts[h]
            self.limit[h] = counts[h] + spare
        self.owner.evicted += before - sum(k.shape[1] for k in self.keys)
        self.compressed = True
        self._sync_lengths()

    def _roll(self):
        for h in range(len(self.keys)):
            excess = self.keys[h].shape[1] - self.limit[h]
            if excess > 0:
                f = self.frozen[h]
                self.keys[h] = torch.cat([self.keys[h][:, :f], self.keys[h][:, f + excess:]], dim=1)
                self.values[h] = torch.cat([self.values[h][:, :f], self.values[h][:, f + excess:]], dim=1)
                self.owner.evicted += excess
        self._sync_lengths()

    def _sync_lengths(self):
        if self.lengths is not None:
            self.lengths.copy_(torch.tensor([k.shape[1] for k in self.keys], dtype=torch.int32))

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        return {
            "full": sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values)),
            "scores": sum(a.nbytes for a in self.acc) if self.acc is not None else 0,
            "index": self.lengths.nbytes if self.lengths is not None else 0,
        }

    def tier_counts(self) -> dict[str, int]:
        kept = round(sum(k.shape[1] for k in self.keys) / len(self.keys)) if self.is_initialized else 0
        return {"sink": 0, "recent": 0, "full": kept, "quantized": 0, "evicted": self.seen - kept}


class EvictionCache(ReportingCache):
    """``fixed_buffers``: decode in fixed buffers (eviction_fixed.py; eviction_ragged.py where heads keep different
    counts; eviction_heavy.py for H2O), so that a CUDA graph can replay the steps; None: on a GPU, where the policy
    can (``Policy.decodes_in_place``), and in chronological lists elsewhere."""

    def __init__(self, model, config: QEvictConfig, max_length: int, batch_size: int, policy: Policy, method: str,
                 fixed_buffers: bool | None = None):
        if policy.ragged and batch_size != 1:
            raise ValueError(f"{policy.label} keeps a different number of tokens per head and supports batch size 1 "
                             f"only (got {batch_size})")
        if fixed_buffers and not policy.decodes_in_place:
            raise ValueError(f"{policy.label} cannot decode in fixed buffers: only a policy that selects once, after "
                             "the prompt (StreamingLLM, SnapKV, CriticalKV, AdaKV, the DefensiveKVs), or evicts by "
                             "accumulated attention (H2O) can")
        if fixed_buffers is None:
            fixed_buffers = policy.decodes_in_place and cache_base.lays_out_for_graphs(model)
        self.method = method
        self.policy = policy
        shape = KVShape.from_model(model, batch_size, config)
        layer_class = EvictionLayer
        if fixed_buffers and policy.compress_at == "step":
            from .eviction_heavy import HeavyEvictionLayer as layer_class
        elif fixed_buffers and (policy.ragged or policy.cross_layer):
            from .eviction_ragged import RaggedEvictionLayer as layer_class
        elif fixed_buffers:
            from .eviction_fixed import FixedEvictionLayer as layer_class
        self.plan = plan_eviction(shape, config, policy, max_length,
                                  layer_class.index_bytes(shape.num_kv_heads) if fixed_buffers else None)
        self.evicted = 0
        layers = [layer_class(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, self.plan.budget_bytes)
        self.config = config  # what it was made with (make_cache reports it per lane)

    def select_across_layers(self) -> None:
        """One top-k over every layer's and head's candidates (Layer-DefensiveKV), then each layer gathers."""
        pending = [layer.pending for layer in self.layers]
        if any(p is None for p in pending):  # every prompt fitted: nothing to select
            return
        flat = torch.cat([scores[0].reshape(-1) for scores, *_ in pending])
        total = min(flat.numel(), sum(scores.shape[1] * keep for scores, keep, *_ in pending))
        chosen = torch.zeros_like(flat, dtype=torch.long).scatter(0, flat.topk(total).indices, 1)
        offset = 0
        for layer, (scores, keep, tail, spare) in zip(self.layers, pending):
            heads, n = scores.shape[1], scores.shape[2]
            counts = chosen[offset:offset + heads * n].reshape(heads, n).sum(dim=1).tolist()
            offset += heads * n
            layer.apply_selection(scores, counts, tail, spare)
            layer.pending = None

    def summary(self) -> dict:
        return {"evictions": self.evicted // self.shape.num_kv_heads, "capacity": self.plan.capacity}
