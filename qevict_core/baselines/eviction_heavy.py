"""H2O in fixed buffers, evicting in place, so that every decode step is one call (a CUDA graph can replay it): what
``EvictionCache`` builds on a GPU for a policy that keeps the tokens with the most accumulated attention
(``Policy.evicts_by_accumulation``).

The prompt runs as in the chronological layer (eviction.py): per-head lists, the accumulated attention of every
prompt query, the policy's selection when the prompt is longer than the limit L. Then every head's kept tokens move
into one buffer (B, H, L, D) with their accumulated attention (B, H, L), in two regions: the heavy hitters in slots
[0, K) and the recent tokens in a ring of L - K slots after them (K and L - K: the policy's split). A device counter
``count`` says how many tokens were written. While the buffer fills, a decoded token takes the next slot. Once it is
full, a step is the chronological layer's, without its one spare token: the step attends over the buffer and its
own token, every key's attention is added to its score, then the oldest recent token (the ring's slot
``K + (count - L) mod (L - K)``) leaves the recent region and competes with the heavy hitters: the lowest score of
the K + 1 is evicted (the leaving token takes the evicted one's slot, or is itself dropped), and the new token takes
the ring slot. Every step runs the same operators, masked while the buffer fills: keys are post-RoPE, so slots need
no order.

Where it departs from the chronological layer: the output and every key's attention come from one pass over
[buffer | new token], the softmax in float32 (the lists take SDPA's output and a second pass for the mass), so the
output differs from SDPA's by rounding; scores add up in another order, so ties and near-ties can break
differently. It keeps the lists' tokens while no such tie decides. The device counter (8 bytes a layer) is paid
from the budget.
"""

from __future__ import annotations

import torch

from ..engine.cache_base import tensor_key
from .eviction_fixed import FixedEvictionLayer


class HeavyEvictionLayer(FixedEvictionLayer):

    def _selected(self) -> bool:
        return True  # the lists after the prompt: evicted to the limit if it was longer, else every token

    def _write(self, key_states, value_states) -> None:
        self.new = key_states, value_states  # attention reads it beside the buffer, then it takes its slot

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        if self.key_buffer is None:
            return super().attend(module, query, key, value, scaling, dropout, output)
        new_k, new_v = self.new
        self.new = None
        keys, values, acc = self.key_buffer, self.value_buffer, self.acc_buffer
        b, hkv, limit, d = keys.shape
        groups = query.shape[1] // hkv
        rows = query.reshape(b, hkv, groups, d)  # (B, Hkv, G, D): one query per head, KV head h's group
        # logits over [buffer | new token] (B, Hkv, G, L + 1), computed as transformers' eager attention does
        logits = torch.cat([torch.matmul(rows, keys.to(query.dtype).transpose(2, 3)),
                            torch.matmul(rows, new_k.to(query.dtype).transpose(2, 3))], dim=3).float().mul_(scaling)
        slots = torch.arange(limit + 1, device=keys.device)
        hidden = (slots >= self.count) & (slots < limit)  # unwritten slots; the new token never
        probs = torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
        mass = probs.sum(dim=2).div_(groups)  # (B, Hkv, L + 1): the mean over the group, as the lists add it
        out = None
        if output:
            out = (torch.matmul(probs[..., :limit].to(query.dtype), values.to(query.dtype))
                   + probs[..., limit:].to(query.dtype) * new_v.to(query.dtype))  # (B, Hkv, G, D)
            out = out.reshape(b, 1, hkv * groups, d)  # (B, 1, Hq, D): head h reads KV head h // G
        acc.add_(mass[..., :limit])
        self._evict_and_insert(new_k, new_v, mass[..., limit:])
        return out

    def _evict_and_insert(self, new_k, new_v, new_mass) -> None:
        """The new token into its slot: the next free one while the buffer fills; once full, the ring slot of the
        oldest recent token, which first competes with the heavy hitters for their K slots."""
        keys, values, acc, count = self.key_buffer, self.value_buffer, self.acc_buffer, self.count
        b, h, limit, d = keys.shape
        heavy = self.heavy
        full = count >= limit  # (1,)
        ring = (count - limit).remainder_(limit - heavy).add_(heavy)
        slot = torch.where(full, ring, count.clamp(max=limit - 1)).expand(b, h, 1)  # (B, H, 1)
        leaving = acc.gather(2, slot)  # (B, H, 1): the oldest recent token's score (a free slot's 0 while filling)
        lowest = torch.cat([acc[:, :, :heavy], leaving], dim=2).argmin(dim=2, keepdim=True)  # (B, H, 1)
        # the leaving token takes the evicted heavy hitter's slot; else (it is the lowest, or nothing is full yet) it
        # is written where it is, and the new token overwrites it
        dest = torch.where(full & (lowest < heavy), lowest, slot)
        rows = slot.unsqueeze(-1).expand(b, h, 1, d)
        at = dest.unsqueeze(-1).expand(b, h, 1, d)
        for buffer, new in ((keys, new_k), (values, new_v)):
            buffer.scatter_(2, at, buffer.gather(2, rows))
            buffer.scatter_(2, rows, new.to(buffer.dtype))
        acc.scatter_(2, dest, leaving)
        acc.scatter_(2, slot, new_mass)
        count.add_(1)

    def _to_buffers(self) -> None:
        """Every head's kept tokens and scores, (B, n, ·) each, into the layer's buffers of L slots: [heavy hitters
        | recent], as the lists keep them (after a selection the last L - K are the recent tokens, oldest first)."""
        scores = torch.stack(self.acc, dim=1)  # (B, H, n)
        limit = self.limit[0]
        self.acc_buffer = scores.new_zeros(*scores.shape[:2], limit)
        self.acc_buffer[:, :, :scores.shape[2]] = scores
        self.acc = None
        self.heavy = self.owner.policy.split(limit, 0)[0]
        self.new = None
        super()._to_buffers()

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.key_buffer, self.value_buffer, self.acc_buffer

    def step_key(self) -> tuple:
        return tensor_key(*self.buffers(), self.count)

    def resident_bytes(self) -> dict[str, int]:
        report = super().resident_bytes()
        if self.key_buffer is not None:
            report["scores"] = self.acc_buffer.nbytes
        return report
