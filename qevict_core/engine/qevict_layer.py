"""QEvict's three-tier cache (Sections 4.1-4.3, Algorithm 1) as a transformers ``Cache``.

Per layer and batch row, tokens after the sink prefix are grouped in windows of Ω tokens. Sinks and the recent
region stay in full precision; windows leaving the recent region become candidates. At every routing event
(end of prefill, then every Ω tokens) the candidates - full-tier windows, quantized windows and newly aged
windows - are ranked by score: the top K_f are kept in full precision, the next K_q in the low-bit tier and the
rest evicted. Quantized windows take part in attention, so they keep accumulating score and can be promoted.

State of one layer, all in the (B, H, T, D) layout; only the layer's own methods replace or rewrite it:
  fp: [sinks (s) | full (nF*Ω) | recent (nR, from ``recent_start``)] in one buffer of the plan's size from the first
  routing event on (fp_region.py; ``sink_k``, ``full_k``, ``recent_k``... are views of it) + full_ids (B,nF)
  quant: WindowLedger of nQ windows; dormant: WindowLedger aligned with full_ids + dormant_valid (B,nF)
  scores (B,W) float32, the scorer's table, into which every step folds its own attention mass (nothing of the
  queries is kept); interval (B,W) only for a scorer that transforms each interval's mass (pnorm).
  stage: while a prompt is read in chunks, the part read so far as INT8 blocks (prompt_stage.py); None otherwise.
``update`` returns [dequantized quant | sinks | full | recent] on the PyTorch path, [sinks | full | recent] where a
backend reads the low-bit tier in place. A decode step's routing event waits for the forward's end (every layer's at
once, ``QEvictCache.move_deferred``) and reads the layer's own buffer (``own_keys``).
"""

from __future__ import annotations

import torch

from .assemble import assemble
from .cache_base import ReportingLayer, tensor_key
from .layout import WindowGrid
from .fp_region import FullPrecision
from .row_move import decide_rows, move_rows, settle
from .ledger import TENSORS, WindowLedger
from .key_mass import attend_with_mass, kv_head_mass
from .prompt_stage import PromptStage
from .attention import sdpa_with_positions


class QEvictLayer(ReportingLayer):
    head: int | None = None  # the KV head this layer holds alone (head_cache.py); None: every head of the layer
    # A decode step reads the whole full-precision buffer, positions from device counters, where the backend asks
    # for steps of one shape (``Backend.steps_at_fixed_shape``); False where a layer's buffer follows its fill.
    steps_at_fixed_shape = True
    # A move rewrites the full tier's ids in place when their size holds (not views shared by heads, head_move.py)
    rewrites_in_place = True
    stacks_as_rows = True
    stack_rows: tuple | None = None  # (id(stack), its rows) from take_rows: a reference would pin a dropped stack

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        owner = self.owner
        b, h, _, d = key_states.shape
        if b != owner.shape.batch:
            raise ValueError(f"cache was made for batch size {owner.shape.batch}, got {b}")
        fixed = self.steps_at_fixed_shape and owner.backend.steps_at_fixed_shape and not owner.plan.uncompressed
        self.fp = FullPrecision(key_states, self.fp_reserve(), counts=fixed)
        # Position of buffer slot j, were it recent: recent_origin + j (a device copy of what recent_start says)
        self.recent_origin = torch.zeros(1, dtype=torch.long, device=key_states.device) if fixed else None
        self.reads_buffer = False  # the last ``append`` returned the whole buffer, not its live part
        self.full_ids = torch.zeros(b, 0, dtype=torch.int32, device=key_states.device)
        def ledger() -> WindowLedger:
            return WindowLedger.empty(b, h, d, owner.config.omega, owner.config.bits,
                                      owner.config.param_dtype(owner.shape.dtype), key_states.device)
        self.quant = ledger()
        self.dormant = ledger() if owner.plan.keeps_dormant else None
        self.dormant_valid = torch.zeros(b, 0, dtype=torch.bool, device=key_states.device)
        self.recent_start = owner.config.sinks
        self.stage: PromptStage | None = None  # the prompt so far, while it is read in chunks (prompt_stage.py)
        windows = 0 if owner.plan.uncompressed else owner.plan.num_windows
        self.scores = torch.zeros(b, windows, dtype=torch.float32, device=key_states.device)
        self.interval = torch.zeros_like(self.scores) if owner.scorer.keeps_interval else None
        self.is_initialized = True

    def append(self, key_states, value_states):
        self.store(key_states, value_states)
        if self.owner.staging and not self.owner.plan.uncompressed:
            if self.stage is None:
                self.stage = PromptStage(key_states, self.grid.sinks, self.owner.max_length)
            keys, values = self.stage.keys_values(self)
            self.owner.note_workspace(keys.nbytes + values.nbytes)
            return keys, values
        if self.stage is not None:  # the prompt's last chunk: routed as if the prompt were read whole
            self.stage.release(self)
            self.stage = None
        self.reads_buffer = self.recent_origin is not None and key_states.shape[2] == 1
        # the whole buffer (one shape at every fill) or [sinks | full | recent]: views, no copy
        keys, values = (self.fp.keys, self.fp.values) if self.reads_buffer else self.fp.live()
        if self.quant.num_windows and not self.owner.backend.reads_tier_in_place:
            return self.with_quantized([keys], [values])
        return keys, values

    def fp_reserve(self) -> int:
        """Tokens the full-precision buffer keeps room for from a routing event on: what the plan charges (sinks,
        K_f windows, the recent region and the Ω tokens arriving before the next event); 0 when nothing is routed."""
        plan, cfg = self.owner.plan, self.owner.config
        if plan.uncompressed:
            return 0
        return min(cfg.sinks + plan.k_full * cfg.omega + cfg.recent + 2 * cfg.omega - 1, self.owner.max_length)

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New tokens into the sinks, then the recent region (``seen`` is the caller's to advance)."""
        to_sinks = max(0, min(key_states.shape[2], self.owner.config.sinks - self.seen))
        self.fp.append(key_states, value_states, to_sinks)

    sink_k = property(lambda self: self.fp.part("sink")[0])
    sink_v = property(lambda self: self.fp.part("sink")[1])
    full_k = property(lambda self: self.fp.part("full")[0])
    full_v = property(lambda self: self.fp.part("full")[1])
    recent_k = property(lambda self: self.fp.part("recent")[0])
    recent_v = property(lambda self: self.fp.part("recent")[1])

    def keep_moved(self, full_k: torch.Tensor, full_v: torch.Tensor, full_ids: torch.Tensor, num_aged: int) -> None:
        """A move's full tier (copies, (B, H, F, D) and its ids (B, F/Ω)) and ``num_aged`` windows out of the
        recent region; the tiers' storage stays the layer's."""
        full_before = self.fp.full
        self.fp.rebuild(full_k, full_v, num_aged * self.grid.omega)
        self.full_ids = _overwrite(self.full_ids, full_ids) if self.rewrites_in_place else full_ids
        self.recent_start += num_aged * self.grid.omega
        self._recent_moved(num_aged * self.grid.omega, full_before)

    def keep_records(self, quant: WindowLedger, dormant: WindowLedger | None, dormant_valid: torch.Tensor) -> None:
        """A per-head layer's low-bit tier and dormant ledger: views into storage its heads share (head_move.py)."""
        self.quant, self.dormant, self.dormant_valid = quant, dormant, dormant_valid

    def keep_selected(self, records: WindowLedger, quant_idx: torch.Tensor, dormant_idx: torch.Tensor | None,
                      dormant_valid: torch.Tensor) -> None:
        """A row move's low-bit tier and dormant ledger, picked by slot from ``records``: straight into the storage
        they had when they keep their sizes (every event once the tiers are full), one copy each."""
        self.quant = records.select(quant_idx, self.quant, flat := self.owner.backend.gathers_by_flat_index)
        self.dormant = None if self.dormant is None else records.select(dormant_idx, self.dormant, flat)
        self.dormant_valid = _overwrite(self.dormant_valid, dormant_valid)

    def keep_tables(self, scores: torch.Tensor, interval: torch.Tensor | None) -> None:
        """Score tables that are rows of a table shared with other heads (head_cache.py)."""
        self.scores, self.interval = scores, interval

    def drop_recent(self, tokens: int) -> None:
        """The recent region's first ``tokens`` leave it (a prompt stage took them)."""
        self.fp.drop_recent(tokens)
        self.recent_start += tokens
        self._recent_moved(tokens, self.fp.full)

    def restore_recent(self, keys: torch.Tensor, values: torch.Tensor, tokens: int) -> None:
        """The recent region becomes ``keys/values``: ``tokens`` restored in front of what it held."""
        self.fp.set_recent(keys, values)
        self.recent_start -= tokens
        self._recent_moved(-tokens, self.fp.full)

    def step_key(self) -> tuple:
        ledgers = [self.quant] + ([self.dormant] if self.dormant is not None else [])
        tensors = [self.fp.keys, self.fp.values, self.fp.count, self.recent_origin, self.full_ids,
                   self.dormant_valid, self.scores, self.interval]
        return (self.fp.sinks, self.fp.full, self.reads_buffer,
                *tensor_key(*tensors, *(getattr(ledger, name) for ledger in ledgers for name in TENSORS)))

    def replayed(self, num_tokens: int) -> None:
        """The host half of a replayed step; a routing step's is that of an event that kept every size."""
        self.seen += num_tokens
        drop = self.num_aged() * self.grid.omega if self.owner.routed() else 0
        self.fp.replayed(num_tokens, drop)
        self.recent_start += drop

    def _recent_moved(self, start_delta: int, full_before: int) -> None:
        """The recent region's first position moved by ``start_delta`` and the full tier changed size from
        ``full_before``: the device origin follows, by a difference (the same at every event that keeps the sizes,
        so a captured routing step replays it)."""
        if self.recent_origin is not None:
            self.recent_origin.add_(start_delta - (self.fp.full - full_before))

    def _first_recent(self) -> torch.Tensor:
        """(1,) the recent region's first window, from the device origin."""
        return torch.div(self.recent_origin + self.fp.full, self.grid.omega, rounding_mode="floor")

    def num_aged(self) -> int:
        """Windows the next routing event takes out of the recent region."""
        leaving = self.grid.window_of(self.seen - self.owner.config.recent)  # the first window still recent after it
        return max(0, leaving - self.grid.window_of(self.recent_start))

    def with_quantized(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """[the quantized tier dequantized and re-rotated | *keys]: a transient workspace."""
        cos, signed_sin = self.owner.tier_rope(self.sink_k, self.quant.ids)
        keys, values = assemble(self.quant, keys, values, cos, signed_sin, dtype=self.owner.compute_dtype)
        self.owner.note_workspace(keys.nbytes + values.nbytes)
        return keys, values

    @property
    def grid(self) -> WindowGrid:
        return self.owner.grid

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        out = self.attend_and_score(module, query, key, value, scaling, dropout, output)
        if self.stage is not None:
            self.stage.absorb(self)
        elif self.owner.routed() and query.shape[2] == 1:  # a decode step: moved with every layer's at its end
            self.owner.defer_move(self)
        elif self.owner.routed():  # a prompt or a continuation: moved now, or every layer would hold it whole at once
            settle(self)
            self.move(key, value)
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.end_forward()
        return out

    def attend_and_score(self, module, query, key, value, scaling, dropout, output=True):
        """This step's attention output (None when not ``output`` and it would cost a pass of its own), its mass
        folded into the score table; no routing."""
        if self.owner.plan.uncompressed:  # [sinks | recent] is every token in order: FullKV's attention
            return sdpa_with_positions(module, query, key, value, scaling, dropout) if output else None
        scored = self.owner.scorer.needs_attention
        window = self.owner.config.prefill_window
        if self.stage is not None:  # a chunk of the prompt before its last: no observation window in it yet
            out = sdpa_with_positions(module, query, key, value, scaling, dropout) if output else None
            if scored and not window:
                query_pos = self._query_positions(query.shape[2], query.device)
                self.stage.fold(self, kv_head_mass(query, query_pos, key, self.stage.positions(self), scaling),
                                query.shape[1])
            return out
        stepped = self.owner.backend.decode_step(self, query, key, value, scaling, scored) \
            if self.owner.step > 0 else None  # the prompt has no quantized tier yet
        if stepped is not None:
            out, mass = stepped
            if mass is not None:
                self._fold(mass, query.shape[1])
        elif scored and self.reads_buffer and dropout == 0.0:
            # A decode step over the whole buffer: every key is older than the query but the unwritten slots
            n_quant = key.shape[2] - self.fp.capacity  # [dequantized quantized tier | buffer]
            out, mass = attend_with_mass(query, None, key, None, value, scaling,
                                         hidden=self.unwritten_slots(n_quant))
            self._fold(mass, query.shape[1])
        elif scored and query.shape[2] <= max(window, 1) and dropout == 0.0:
            # A decode step: one attention pass gives the output and every key's mass.
            query_pos = self._query_positions(query.shape[2], query.device)
            out, mass = attend_with_mass(query, query_pos, key, self.attended_positions(), value, scaling)
            self._fold(mass, query.shape[1])
        elif self.reads_buffer:  # the whole buffer, unscored (or with dropout): its reserved tail hidden by position
            positions, query_pos = self.attended_positions(), self._query_positions(query.shape[2], query.device)
            out = sdpa_with_positions(module, query, key, value, scaling, dropout,
                                      (positions, query_pos)) if output else None
            if scored:
                self._fold(kv_head_mass(query, query_pos, key, positions, scaling), query.shape[1])
        else:
            out = sdpa_with_positions(module, query, key, value, scaling, dropout) if output else None
            if scored:  # a prompt: its mass in chunks, from its observation window only when one is set
                query_pos = self._query_positions(query.shape[2], query.device)
                if window and query.shape[2] > window:
                    query, query_pos = query[:, :, -window:], query_pos[-window:]
                self._fold(kv_head_mass(query, query_pos, key, self.attended_positions(), scaling), query.shape[1])
        return out

    def unwritten_slots(self, before: int = 0) -> torch.Tensor:
        """(before + capacity,) True at the buffer's slots no token has reached yet, after ``before`` keys read in
        front of it (``reads_buffer``: one query, the newest token, sees every written key): no positions."""
        if (stack := self.owner.stack_of(self)) is not None:  # every layer's, built once a step (layer_stack.py)
            return stack.step_table(self, ("unwritten", before), lambda: stack.unwritten_slots(before))
        return torch.arange(-before, self.fp.capacity, device=self.fp.keys.device) >= self.fp.count[:1]

    def own_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer (or its live part, as the last ``append`` returned it): what a deferred move reads."""
        return (self.fp.keys, self.fp.values) if self.reads_buffer else self.fp.live()

    def move(self, key: torch.Tensor, value: torch.Tensor, decided: tuple | None = None) -> None:
        """Move windows between tiers as decided (``decide_rows``: (candidates, decision)); by default by this
        layer's own ranking of its settled candidates. ``key``/``value``: what ``update`` returned, or ``own_keys``."""
        cand_ids, decision = decided or decide_rows([self])[0]
        move_rows(self, key, value, cand_ids, decision)
        self.note_moved()

    def note_moved(self) -> None:  # the owner's byte count after a move
        self.owner.note_bytes(self.layer_idx)

    def record_move(self, old: tuple[torch.Tensor, torch.Tensor], aged: torch.Tensor) -> None:
        """A move to record (``config.record_events``): ``old`` copies of the tiers' ids, ``aged`` (B, n) ids."""
        self.owner.record_routing(self, old, aged)

    def take_rows(self, stack, index: int) -> None:
        """Become layer ``index`` of ``stack`` (layer_stack.py): views of its rows, its host counters."""
        start, stop = index * self.owner.shape.batch, (index + 1) * self.owner.shape.batch
        self.stack_rows = id(stack), slice(start, stop)
        self.fp.take_rows(stack.fp, index)
        self.recent_origin = None if stack.recent_origin is None else stack.recent_origin[index:index + 1]
        self.full_ids, self.dormant_valid = stack.full_ids[start:stop], stack.dormant_valid[start:stop]
        self.quant = stack.quant.rows(start, stop)
        self.dormant = None if stack.dormant is None else stack.dormant.rows(start, stop)
        self.scores = stack.scores[start:stop]
        self.interval = None if stack.interval is None else stack.interval[start:stop]
        self.recent_start = stack.recent_start

    def _fold(self, kv_mass: torch.Tensor, q_heads: int) -> None:
        """Per-key mass (B, Hkv, N) of this step's queries, keys laid out [quantized | sinks | full | recent], into
        the score table; Eq. 1 averages over the ``q_heads`` query heads."""
        omega = self.grid.omega
        n_quant = self.quant.num_windows * omega
        per_key = kv_mass.sum(dim=1)  # (B, N)
        quant = per_key[:, :n_quant].reshape(per_key.shape[0], -1, omega).sum(dim=2)  # (B, nQ)
        self.fold_windows(quant, per_key[:, n_quant:], q_heads)

    def fold_windows(self, quant: torch.Tensor, fp_keys: torch.Tensor, q_heads: int) -> None:
        """This step's mass into the score table: ``quant`` (B, nQ) per window of the quantized tier (a kernel that
        reads the tier in place gives it so), ``fp_keys`` (B, N) per key of [sinks | full | recent], each summed
        over the KV heads; Eq. 1 averages over the ``q_heads`` query heads.

        Every tier after the sinks holds whole windows in that order (the recent region's last one may be partial),
        so a window's mass is a sum over Ω consecutive keys, credited to the tiers' window ids: no per-key positions
        (building and binning them cost more than the sums on a 4K decode step)."""
        omega, sinks, b = self.grid.omega, self.sink_k.shape[2], fp_keys.shape[0]
        # the recent region's last window may be partial: zeros complete it (always padded, by 0 too, so that every
        # step runs the same operators)
        tokens = torch.nn.functional.pad(fp_keys[:, sinks:], (0, -(fp_keys.shape[1] - sinks) % omega))
        fp_windows = tokens.reshape(b, tokens.shape[1] // omega, omega).sum(dim=2)
        per_window = (torch.cat([quant, fp_windows], dim=1) if quant.shape[1] else fp_windows).div_(q_heads)
        self.owner.scorer.fold(self.scores, self.interval, self._fold_ids(per_window.shape[1]), per_window)

    def _fold_ids(self, num: int) -> torch.Tensor:
        """(B, num) window ids of [quantized | full | recent], rebuilt each step (kept, they would be bytes outside the
        budget); over the whole buffer, recent windows from the device origin, the tail's (no mass) clamped."""
        if self.reads_buffer and (stack := self.owner.stack_of(self)) is not None:  # every layer's, once a step
            return stack.step_table(self, ("fold", num), lambda: stack._fold_ids(num))[self.stack_rows[1]]
        n_recent, device = num - self.quant.num_windows - self.full_ids.shape[1], self.full_ids.device
        last = self.scores.shape[1] - 1
        if self.reads_buffer:  # [:1]: a stack's origin is one per layer, the same value in each
            recent = (self._first_recent()[:1] + torch.arange(n_recent, device=device)).clamp_(max=last)
        else:
            first_recent = self.grid.window_of(self.recent_start)
            recent = torch.arange(first_recent, first_recent + n_recent, device=device)
        parts = [self.quant.ids.long(), self.full_ids.long(), recent.expand(self.full_ids.shape[0], -1)]
        return torch.cat(parts, dim=1)

    def attended_positions(self) -> torch.Tensor:
        """(B, N) absolute positions of the keys in the order [quantized | sinks | full | recent]."""
        parts = [self.grid.positions(self.quant.ids)] if self.quant.num_windows else []
        return torch.cat(parts + [self.fp_positions()], dim=1)

    def fp_positions(self) -> torch.Tensor:
        """(B, N) absolute positions of the full-precision keys [sinks | full | recent] that ``append`` returned;
        over the whole buffer, the reserved tail's lie after the newest token, so causality hides them."""
        b, device = self.full_ids.shape[0], self.full_ids.device
        parts = [torch.arange(self.sink_k.shape[2], device=device).expand(b, -1)]
        parts.append(self.grid.positions(self.full_ids))
        if self.reads_buffer:
            recent = self.recent_origin + torch.arange(self.fp.sinks + self.fp.full, self.fp.capacity, device=device)
        else:
            recent = torch.arange(self.recent_start, self.recent_start + self.recent_k.shape[2], device=device)
        parts.append(recent.expand(b, -1))
        return torch.cat(parts, dim=1)

    def _query_positions(self, num: int, device: torch.device) -> torch.Tensor:
        """(num,) positions of this forward's tokens: from the device counters over the whole buffer."""
        if self.reads_buffer:
            return self.recent_origin + self.fp.count - num + torch.arange(num, device=device)
        return torch.arange(self.seen - num, self.seen, device=device)

    def capacities(self) -> tuple[int, int]:
        """(K_f, K_q) of this layer at its next routing event."""
        return self.owner.plan.k_full, self.owner.plan.k_quant

    def candidates(self) -> torch.Tensor:
        """(B, C) window ids that the next routing event will rank: [quantized | full | aging out of recent]."""
        return torch.cat([self.quant.ids, self.full_ids, self.aged_windows()], dim=1)

    def aged_windows(self) -> torch.Tensor:
        """(B, a) int32 ids of the windows the next routing event takes out of the recent region."""
        num_aged, device = self.num_aged(), self.full_ids.device
        if self.recent_origin is not None:  # from the device, so a captured event replays
            aged = (self._first_recent() + torch.arange(num_aged, device=device)).to(torch.int32)
        else:
            first_recent = self.grid.window_of(self.recent_start)
            aged = torch.arange(first_recent, first_recent + num_aged, device=device, dtype=torch.int32)
        return aged.expand(self.full_ids.shape[0], -1)

    def candidate_ranks(self, cand_ids: torch.Tensor) -> torch.Tensor:
        return self.owner.scorer.rank(self.scores).gather(1, cand_ids.long())

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        quant = self.quant.nbytes_by_component()
        dormant = sum(self.dormant.nbytes_by_component().values()) if self.dormant is not None else 0
        return {
            **self.fp.nbytes_by_part(),
            "quantized": quant["quantized"],
            "quant_meta": quant["quant_meta"],
            "index": quant["index"] + self.full_ids.nbytes + self.counter_bytes(),
            "ledger": dormant + self.dormant_valid.nbytes,
            "scores": self.scores.nbytes + (self.interval.nbytes if self.interval is not None else 0),
            "staged": self.stage.nbytes() if self.stage is not None else 0,
        }

    def counter_bytes(self) -> int:
        """The device counters of steps at one shape (the fill, the recent origin): bookkeeping, counted as index."""
        return 0 if self.recent_origin is None else self.recent_origin.nbytes + self.fp.count.nbytes

    def tier_counts(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"sink": 0, "recent": 0, "full": 0, "quantized": 0, "evicted": 0}
        omega, left_recent = self.grid.omega, self.grid.window_of(self.recent_start)
        n_full, n_quant = self.full_ids.shape[1], self.quant.num_windows
        staged = self.stage.num_tokens if self.stage is not None else 0  # the prompt not yet routed: recent
        return {"sink": self.sink_k.shape[2], "recent": self.recent_k.shape[2] + staged, "full": n_full * omega,
                "quantized": n_quant * omega, "evicted": (left_recent - n_full - n_quant) * omega - staged}


def _overwrite(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``'s values in ``old``'s storage when the shapes agree."""
    return old.copy_(new) if old.shape == new.shape and old.dtype == new.dtype else new
