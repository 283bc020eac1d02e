"""Head-adaptive QEvict (``qevict_head``): windows routed per KV head, under one byte budget per layer.

QEvict ranks a layer's windows by the mean attention of all its query heads, so every KV head keeps the same
windows. Here each KV head is a QEvict layer of its own - one KV head and its G query heads (GQA-aware) - with its
own score table (Eq. 1 averaged over its group), tiers, dormant ledger and routing decisions. Storage is per head,
so a head holding more windows than another really holds more bytes, and less is really freed elsewhere.

Ranking. At a routing event each head ranks windows by (1 - β)·its own ranking + β·the mean of the layer's heads'
(β = ``QEvictConfig.head_blend``, 0.5 by default; β = 1 makes QEvict's per-layer decisions exactly; β = 0 keeps
only what a head's own group attended to). The scorer pools the ranking before the blend (``QEvictConfig.pool``;
the default pools forward at a tenth of the score), so a head that keeps a needle's window tends to keep the window
that continues it. docs/decisions.md says why, and where the measurements are.

Allocation. ``plan_tiers`` sizes one head's share of the budget (a layer of one KV head: every head's window ids,
ledger flags and score table are charged), which gives K_f and K_q per head. At every routing event the layer's
H·K_f full and H·K_q quantized slots are split over its heads, AdaKV-style: each head first gets its
best-ranked floor(α·K_f) full and floor(α·K_q) quantized windows (α = ``QEvictConfig.head_floor``, 0.2 by default,
1 in the registered ``qevict_head``, where every head keeps K_f and K_q and nothing is left to split), then the
remaining slots go to the best-ranked remaining windows of the whole layer, whichever head they belong to (one
top-k across heads; on equal
ranks the better slot within its head first, then the lower head, so identical heads get identical shares). The
quantized split runs on what each head's full tier leaves. Every window of every head costs the same bytes, so the
layer's bytes are those of H heads at K_f and K_q, within the budget. A decode step on the CPU kernel moves every head
at once (head_move.py); elsewhere heads move one by one, those whose allocation shrinks first, so the layer never
holds more than before or after the event, even between two heads' moves.

Where this departs from AdaKV (FFY0/AdaKV, ``adaptive_snapkv``): AdaKV splits a token budget once, at the end of
prefill, from SnapKV's pooled observation-window scores, as ``floor + (1 - α)·(share of one top-k over all heads)``.
Here the units are windows, the scores are QEvict's cumulative attention, both tiers are split, and the split is
redone at every routing event, so a head's capacity follows where its attention goes while decoding. Batch size 1
(as the ragged eviction baselines): padded batches run one cache per row (``make_cache(..., padded=True)``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.utils.rnn import pad_sequence

from .budget import KVShape
from .cache import QEvictCache
from .qevict_layer import QEvictLayer
from . import head_move
from .cache_base import ReportingLayer
from ..config import QEvictConfig
from .ledger import WindowLedger

class HeadLayer(QEvictLayer):
    """One KV head of one layer, routed on its own; ``allotted`` is its (K_f, K_q) for the next routing event."""

    rewrites_in_place = False  # its low-bit tier, dormant ledger and ids are views of its layer's (head_move.py)
    stacks_as_rows = False  # its tiers have its own sizes (allotted)
    steps_at_fixed_shape = False  # its buffer holds exactly what is live (fp_reserve)

    def __init__(self, layer_idx: int, owner: QEvictCache, head: int):
        super().__init__(layer_idx, owner)
        self.head = head
        self.allotted = (owner.plan.k_full, owner.plan.k_quant)
        self.rank_table: torch.Tensor | None = None  # during a routing event only: what this head ranks by

    def capacities(self) -> tuple[int, int]:
        return self.allotted

    def fp_reserve(self) -> int:
        """Exactly what is live: a head's K_f changes at every event (its share of the layer's), and the layer's
        bytes are the sum of its heads' tiers."""
        return 0

    def push(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode step's token, stored without building this head's attended keys (step_heads lays out every
        head's at once)."""
        self.store(key_states, value_states)
        self.seen += key_states.shape[2]

    def candidate_ranks(self, cand_ids: torch.Tensor) -> torch.Tensor:
        if self.rank_table is None:
            return super().candidate_ranks(cand_ids)
        return self.rank_table.gather(1, cand_ids.long())


class HeadwiseLayer(ReportingLayer):
    """The KV heads of one layer, each a :class:`HeadLayer`. A decode step on the CPU kernel runs every head in one
    pass (the backend's step_heads); anything else (the prompt, other kernels) runs head group by head group."""

    def __init__(self, layer_idx: int, owner: HeadwiseQEvictCache, kv_heads: int):
        super().__init__(layer_idx, owner)
        self.heads = [HeadLayer(layer_idx, owner, h) for h in range(kv_heads)]
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] | None = []  # None: this step runs in one pass
        # The heads' score tables, stacked (H, W): each head's table is a row of it, so one scatter folds them all.
        self.scores: torch.Tensor | None = None
        self.interval: torch.Tensor | None = None
        # Every head's quantized tier in one ledger, head after head; each head's tier is a view of it.
        self._packed: WindowLedger | None = None
        self._views: tuple[WindowLedger, ...] = ()

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def append(self, key_states, value_states):
        # (B, H, n, D) -> H heads of (B, 1, n, D); each copies what it keeps.
        if self._one_pass(key_states.shape[2]):
            for h, head in enumerate(self.heads):
                head.push(key_states[:, h:h + 1], value_states[:, h:h + 1])
            self._parts = None
            return key_states, value_states
        self._parts = [head.update(key_states[:, h:h + 1], value_states[:, h:h + 1])
                       for h, head in enumerate(self.heads)]
        if self.scores is None:
            self._stack_tables()
        # Every head's attended keys are alive together until attention has run.
        self.owner.note_workspace(sum(k.nbytes + v.nbytes for k, v in self._parts))
        return key_states, value_states  # a handle: attention reads the heads' parts

    def _one_pass(self, tokens: int) -> bool:
        owner = self.owner
        return (owner.backend.steps_heads_in_one_pass and owner.step > 0 and tokens == 1
                and not owner.plan.uncompressed)

    def _stack_tables(self) -> None:
        self.scores = torch.cat([head.scores for head in self.heads])
        if self.heads[0].interval is not None:
            self.interval = torch.cat([head.interval for head in self.heads])
        for h, head in enumerate(self.heads):
            head.keep_tables(self.scores[h:h + 1], self.interval[h:h + 1] if self.interval is not None else None)

    def packed_quant(self) -> WindowLedger:
        """Every head's quantized tier in one ledger, head after head (the varlen kernel checks one tensor per
        field and layer, not one per head). A move of every head at once builds it (head_move.py); after heads
        moved one by one (the prompt's event) it is joined here, once, and each head's tier becomes a view of it,
        so nothing is held twice."""
        heads = self.heads
        if self._packed is None or any(head.quant is not view for head, view in zip(heads, self._views)):
            packed = heads[0].quant.cat(*(head.quant for head in heads[1:]))
            self.owner.note_workspace(sum(packed.nbytes_by_component().values()))  # the old tiers until replaced
            self.set_packed(packed, [head.quant.num_windows for head in heads])
        return self._packed

    def set_packed(self, packed: WindowLedger, counts: list[int]) -> None:
        """Make ``packed`` (``counts[h]`` windows of head h, head after head) every head's quantized tier."""
        self._views = tuple(packed.split(counts))
        for head, view in zip(self.heads, self._views):
            head.keep_records(view, head.dormant, head.dormant_valid)
        self._packed = packed

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        one_pass = self._parts is None
        if one_pass:
            out, keys, values = self.owner.backend.step_heads(self, query, scaling)
        else:
            out, parts = self._attend_per_head(module, query, scaling, dropout, output)
        self._parts = []
        if self.owner.routed():
            table = self._settle_and_rank()
            cands = [head.candidates()[0] for head in self.heads]  # batch row 0: batch size is 1
            ids = pad_sequence(cands, batch_first=True)  # (H, C), padded with window 0
            sizes = [c.numel() for c in cands]
            padding = torch.arange(ids.shape[1]) >= torch.tensor(sizes).unsqueeze(1)
            rank = table.gather(1, ids.long()).masked_fill_(padding, float("-inf"))  # (H, C)
            order, ranked = self.owner.allot(self.heads, rank, sizes)
            for h, head in enumerate(self.heads):  # what a head moving on its own ranks by
                head.rank_table = table[h:h + 1]
            if one_pass:
                head_move.move_heads(self, keys, values, cands, rank, ranked)
            else:
                for h in order:
                    self.heads[h].move(*parts[h])
            for head in self.heads:
                head.rank_table = None
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.end_forward()
        return out

    def _settle_and_rank(self) -> torch.Tensor:
        """Every head's table settled for ranking at once (the stacked rows; a scorer that reads the keys of windows
        leaving the recent region reads each head's) -> (H, W): what each head ranks its windows by."""
        scorer = self.owner.scorer
        scorer.settle(self.scores, self.interval)
        if scorer.reads_aged_keys:
            for head in self.heads:
                aged = head.candidates()[:, head.quant.num_windows + head.full_ids.shape[1]:]
                if aged.shape[1]:
                    scorer.on_aged(head.scores, aged, head.recent_k[:, :, :aged.shape[1] * self.owner.grid.omega])
        return self.owner.blend(self.scores)

    def _attend_per_head(self, module, query, scaling, dropout, output=True):
        parts = self._parts
        g = query.shape[1] // len(self.heads)
        outs = []
        for h, (head, (k, v)) in enumerate(zip(self.heads, parts)):
            head.claim(k)  # drops the head's reference to its keys once this step is done with them
            outs.append(head.attend_and_score(module, query[:, h * g:(h + 1) * g], k, v, scaling, dropout, output))
        if any(out is None for out in outs):
            return None, parts
        return torch.cat(outs, dim=2), parts  # (B, L, Hq, D): head h's group of query heads in place

    def resident_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for head in self.heads:
            for name, nbytes in head.resident_bytes().items():
                total[name] = total.get(name, 0) + nbytes
        return total

    def tier_counts(self) -> dict[str, int]:
        """Tokens per tier, mean over heads (the unit of every other method's counts: tokens of one head)."""
        counts = [head.tier_counts() for head in self.heads]
        return {name: round(sum(c[name] for c in counts) / len(counts)) for name in counts[0]}


def split_capacity(ranks: torch.Tensor, total: int, floor: int, available: list[int] | None = None) -> list[int]:
    """ranks (H, C): row h holds head h's candidates' ranks best first, then -inf padding (``available[h]`` finite
    ranks in row h, counted here when not given). -> slots per head, summing to at most ``total``: each head first
    gets min(floor, its candidates), then one top-k across heads of the rest takes what is left."""
    heads = ranks.shape[0]
    if available is None:
        available = (ranks > float("-inf")).sum(dim=1).tolist()
    counts = [min(n, floor) for n in available]
    left = min(total, sum(available)) - sum(counts)
    if left <= 0 or ranks.shape[1] <= floor:
        return counts
    pool = ranks[:, floor:].T.flatten()  # (slot, head): slot-major ties; what each head's floor did not take
    # pool holds available - counts finite ranks, at least ``left``: the first ``left`` are never padding.
    chosen = pool.sort(descending=True, stable=True).indices[:left]
    return [n + extra for n, extra in zip(counts, torch.bincount(chosen % heads, minlength=heads).tolist())]


class HeadwiseQEvictCache(QEvictCache):
    """QEvict with per-KV-head routing and an adaptive split of each layer's capacities (module docstring)."""

    method = "qevict_head"
    chunked_prefill = None  # its heads would each need a stage; not built (prefill.py)

    def __init__(self, model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        if batch_size != 1:
            raise ValueError(f"qevict_head routes each head of each sequence separately and runs batch size 1 "
                             f"(got {batch_size}); for a batch use make_cache(..., padded=True)")
        super().__init__(model, config, max_length, batch_size)

    def plan_shape(self, shape: KVShape) -> KVShape:
        """One KV head with its G query heads is the unit: H times as many of them as layers."""
        return dataclasses.replace(shape, num_layers=shape.num_layers * shape.num_kv_heads, num_kv_heads=1,
                                   num_q_heads=shape.num_q_heads // shape.num_kv_heads)

    def make_layer(self, layer_idx: int, shape: KVShape) -> ReportingLayer:
        return HeadwiseLayer(layer_idx, self, shape.num_kv_heads)

    def blend(self, table: torch.Tensor) -> torch.Tensor:
        """table (H, W): the layer's stacked score table, a head per row -> what each head ranks by: (1 - β) x its
        own ranking + β x the mean ranking of the layer's heads (β = ``config.head_blend``), the windows a head's
        own query group favours without dropping what the layer as a whole attends to. β = 1 ranks every head alike,
        which makes exactly QEvict's per-layer decisions."""
        own, beta = self.scorer.rank(table), self.config.head_blend
        if not beta:
            return own
        return own * (1 - beta) + own.mean(dim=0, keepdim=True) * beta

    def allot(self, heads: list[HeadLayer], rank: torch.Tensor, sizes: list[int]) -> tuple[list[int], torch.Tensor]:
        """Split the layer's H·K_f and H·K_q over its (settled) heads; ``rank`` (H, C): each head's ``sizes[h]``
        candidates' ranks (finite), padded with -inf. -> the order in which heads moving one by one must move (those
        whose windows shrink in bytes first), and the stable descending sort (H, C) of the ranks eligible for the
        full tier."""
        plan, promotion = self.plan, self.config.promotion
        n_quant = [head.quant.num_windows for head in heads]
        in_quant = torch.arange(rank.shape[1]) < torch.tensor(n_quant).unsqueeze(1)
        eligible = (rank if promotion else rank.masked_fill(in_quant, float("-inf"))).sort(
            dim=1, descending=True, stable=True)
        k_full = split_capacity(eligible.values, len(heads) * plan.k_full, int(self.config.head_floor * plan.k_full),
                                sizes if promotion else [n - q for n, q in zip(sizes, n_quant)])
        # What each head's full tier leaves (its best k_full eligible ranks taken out) competes for low-bit slots.
        rest = eligible.values.masked_fill(torch.arange(rank.shape[1]) < torch.tensor(k_full).unsqueeze(1),
                                           float("-inf"))
        if not promotion:
            rest = torch.cat([rest, rank.masked_fill(~in_quant, float("-inf"))], dim=1)
        rest = rest.sort(dim=1, descending=True).values
        # Every candidate but the head's full tier (without promotion the quantized ones are back in).
        k_quant = split_capacity(rest, len(heads) * plan.k_quant, int(self.config.head_floor * plan.k_quant),
                                 [n - k for n, k in zip(sizes, k_full)])
        growth = []
        for h, head in enumerate(heads):
            growth.append((k_full[h] - head.full_ids.shape[1]) * plan.full_window_bytes
                          + (k_quant[h] - head.quant.num_windows) * plan.quant_window_bytes)
            head.allotted = (k_full[h], k_quant[h])
        return sorted(range(len(heads)), key=lambda h: growth[h]), eligible.indices

    def summary(self) -> dict:
        out = super().summary()
        allotted = [head.allotted for layer in self.layers for head in layer.heads]
        out.update(head_k_full_min=min(a[0] for a in allotted), head_k_full_max=max(a[0] for a in allotted),
                   head_k_quant_min=min(a[1] for a in allotted), head_k_quant_max=max(a[1] for a in allotted))
        return out
