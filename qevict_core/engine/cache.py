"""QEvict's cache (Sections 4.1-4.3, Algorithm 1) as a transformers ``Cache``: one ``QEvictLayer`` per layer
(qevict_layer.py), the routing clock they share, the tier plan, the scorer and the attention backend, each chosen
once when the cache is built."""

from __future__ import annotations

import torch

from .. import backends
from .budget import KVShape, plan_tiers
from .layout import WindowGrid
from .quant import UNFIT
from .cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig
from ..events import RoutingEvent
from .layer_stack import StackedLayer, row_tensors
from .qevict_layer import QEvictLayer
from .rope import Rope
from .row_move import decide_rows, settle
from .scorers import make_scorer


class RoutingSchedule:
    """The one place that owns the routing clock: every layer routes in the same forward."""

    def __init__(self, omega: int):
        self.omega = omega
        self.seen = 0
        self.last_route: int | None = None
        self.routing_now = False

    def begin_forward(self, num_tokens: int, hold: bool = False) -> None:
        """``hold``: a chunk of the prompt before its last, which never routes (prompt_stage.py)."""
        self.routing_now = self.routes_at(num_tokens, hold)
        self.seen += num_tokens
        if self.routing_now:
            self.last_route = self.seen

    def routes_at(self, num_tokens: int, hold: bool = False) -> bool:
        """Whether a forward of ``num_tokens`` more routes."""
        return not hold and (self.last_route is None or self.seen + num_tokens - self.last_route >= self.omega)


class QEvictCache(ReportingCache):
    """Three-tier recoverable cache for one generation of at most ``max_length`` tokens."""

    method = "qevict"
    chunked_prefill = "staged"

    def __init__(self, model, config: QEvictConfig, max_length: int, batch_size: int = 1):
        self.config = config
        self.scorer = make_scorer(config)
        shape = KVShape.from_model(model, batch_size, config)
        param = next(model.parameters())
        self.backend = backends.choose(config.kernels, param.device, param.dtype)  # chosen once, for every step
        self.plan = plan_tiers(self.plan_shape(shape), config, max_length, interval_table=self.scorer.keeps_interval)
        self.rope = Rope.from_model(model)
        self.schedule = RoutingSchedule(config.omega)
        self.grid = WindowGrid(config.sinks, config.omega)  # where every layer's windows lie
        self._moves: torch.Tensor | None = None
        # Routing events' scale check, read after each event. It and the move counts are written in place: a step
        # replayed from a graph writes where the captured step did.
        self._unfit: torch.Tensor | None = None
        self._unfit_unread = False
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._signed_sin: torch.Tensor | None = None  # the table's sine, first half negated (tier_rope)
        self._deferred: list = []  # the layers whose routing event this forward has reached, moved at its end
        self._stack: StackedLayer | None = None  # every layer's tiers as rows of one storage (layer_stack.py)
        layers = [self.make_layer(i, shape) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, self.plan.budget_bytes)
        self.backend.prepare(self)

    def plan_shape(self, shape: KVShape) -> KVShape:
        """The unit that ``plan_tiers`` sizes: one layer of every KV head (routing decides per layer)."""
        return shape

    def make_layer(self, layer_idx: int, shape: KVShape) -> ReportingLayer:
        return QEvictLayer(layer_idx, self)

    def begin_forward(self, num_tokens: int) -> None:
        self.move_deferred()
        self.schedule.begin_forward(num_tokens, hold=self.staging)
        self._drop_transients()

    def note_unfit(self, windows: torch.Tensor) -> None:
        """Windows (bool, on the device) quantized at this routing event whose scales or zero-points their dtype
        could not hold: remembered, and checked when the host reads the cache (:meth:`check_fit`: the memory report
        the generation loop takes after every step, the summary) rather than read back inside a routing step."""
        unfit = windows.any()
        if self._unfit is None:
            self._unfit = torch.zeros_like(unfit)
        self._unfit.logical_or_(unfit)
        self._unfit_unread = True

    def check_fit(self) -> None:
        """ValueError if a window quantized so far could not be stored: one read back, only after a routing event
        (noted, or the last forward routed: a replayed event notes nothing on the host)."""
        if self._unfit is None or not (self._unfit_unread or self.routed()):
            return
        self._unfit_unread = False
        if bool(self._unfit):
            dtype = self.config.param_dtype(self.shape.dtype)
            raise ValueError(f"the cache's keys or values {UNFIT.format(dtype=dtype)}")

    def routed(self) -> bool:
        return self.schedule.routing_now and not self.plan.uncompressed

    def routes_at(self, num_tokens: int) -> bool:
        return not self.plan.uncompressed and self.schedule.routes_at(num_tokens, hold=self.staging)

    @property
    def replays_steps(self) -> bool:
        return super().replays_steps and self.backend.steps_at_fixed_shape and not self.plan.uncompressed

    @property
    def replays_routing(self) -> bool:
        return self.replays_steps

    def record_routing(self, layer, old: tuple[torch.Tensor, torch.Tensor], aged: torch.Tensor) -> None:
        """A routing event of ``layer`` to record (``config.record_events``): ``old`` copies of its full and
        quantized tiers' ids before the move, ``aged`` (B, n) the windows that left the recent region. Read on the
        host now; while a graph captures the step, after each of its replays (``replayed_records``)."""
        if self.capture_records is not None:
            self.capture_records.append((layer, old, aged))
        else:
            self.replayed_records([(layer, old, aged)])

    def replayed_records(self, records: list) -> None:
        for layer, old, aged in records:  # the tensors a captured step wrote its records into
            self.events.append(RoutingEvent.after_move(layer, old, aged[0].tolist()))

    def stack_of(self, layer) -> StackedLayer | None:
        """The stack of every layer's tiers (layer_stack.py) whose rows ``layer``'s are, if they are (its buffer
        still the stack's storage: only a move, which ends a forward, changes the ids it holds besides)."""
        stack, rows = self._stack, layer.stack_rows
        if stack is None or rows is None or rows[0] != id(stack):
            return None
        same = layer.fp.keys.untyped_storage().data_ptr() == stack.fp.keys.untyped_storage().data_ptr()
        return stack if same else None

    def defer_move(self, layer) -> None:
        """A layer's routing event, left for the end of the forward, when every layer's is decided at once
        (``row_move.decide_rows``) and moved from the layer's own tiers (``own_keys``: what the step attended over
        is a workspace on the PyTorch path). A layer's move touches only its own tiers, which no other layer of the
        forward reads, so nothing changes but the count of operators."""
        self._deferred.append(layer)

    def end_forward(self) -> None:
        self.move_deferred()
        if self.routed() and (self._stack is None or not self._stack.holds(self.layers)):
            self._stack = None  # every layer's tiers as rows of one storage, for the next events (layer_stack.py)
            if StackedLayer.can_hold(self.layers):
                self.note_workspace(sum(t.nbytes for x in self.layers for t in row_tensors(x) if t is not None))
                self._stack = StackedLayer(self.layers)
        self._drop_transients()

    def _drop_transients(self) -> None:
        """This forward's tables (rope, signed sine, the stack's step tables): nothing of them persists to the next."""
        self._rope_table = self._signed_sin = None
        if self._stack is not None:
            self._stack.step_tables = None

    def move_deferred(self) -> None:
        """The deferred routing events: every layer's settled, decided and moved at once (as rows of one stack when
        their tiers are, ``end_forward``; else decided at once and moved layer by layer). At the end of a forward;
        also before anything reads the cache or the next forward starts, for a caller that drove fewer layers than
        the model has (a test driving one layer)."""
        layers, self._deferred = self._deferred, []
        if not layers:
            return
        if self._stack is not None and self._stack.holds(layers):  # every layer's tiers are rows of the stack
            self._stack.move_all()
            return
        self._stack = None
        for layer in layers:
            settle(layer)
        sizes = {(layer.quant.num_windows, layer.full_ids.shape[1], layer.recent_start) for layer in layers}
        decided = decide_rows(layers) if len(sizes) == 1 else [decide_rows([layer])[0] for layer in layers]
        for layer, one in zip(layers, decided):
            layer.move(*layer.own_keys(), one)

    def rope_table(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (seen, D), or (max_length, D) where steps keep one shape: rows of every position, built by the
        first layer to need them and reused by every other layer of this forward (else each layer would compute
        cos/sin of its own quantized positions at every step)."""
        if self._rope_table is None:
            # rows of every position a generation reaches where steps keep one shape, else of those seen so far
            rows = self.max_length if self.backend.steps_at_fixed_shape else self.schedule.seen
            self._rope_table = self.rope.table(self._computing(like), rows)
        return self._rope_table

    def rope_rows(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, N, D) for absolute ``positions`` (B, N), rows of :meth:`rope_table`."""
        cos, sin = self.rope_table(like)
        b, n = positions.shape
        flat = positions.reshape(-1)
        return (cos.index_select(0, flat).view(b, 1, n, -1), sin.index_select(0, flat).view(b, 1, n, -1))

    def tier_rope(self, like: torch.Tensor, window_ids: torch.Tensor,
                  grid: WindowGrid | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sine (B, 1, n·Ω, D) at the positions of the windows ``window_ids`` (B, n) of ``grid``
        (default the cache's), as ``assemble`` rotates a low-bit tier: one lookup per table from the ids as stored,
        in a view of :meth:`rope_table` by window (no positions built; every such window is whole, so the table's
        whole windows hold it). The signed sine is the sine with its first half negated: rotate_half's sign, built
        once per forward for every layer, so the rotation needs no subtraction of its own."""
        grid = grid or self.grid
        cos, sin = self.rope_table(like)
        if self._signed_sin is None:
            self._signed_sin = torch.cat([-sin[:, :sin.shape[1] // 2], sin[:, sin.shape[1] // 2:]], dim=1)
        whole = grid.whole(cos.shape[0])
        b, n = window_ids.shape
        flat = window_ids.reshape(-1)
        return tuple(t[grid.sinks:grid.start(whole)].view(whole, grid.omega, -1)  # (windows, Ω, D)
                     .index_select(0, flat).view(b, 1, n * grid.omega, -1) for t in (cos, self._signed_sin))

    def cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, N, D) for ``positions`` (B, N): rows of this forward's table when a layer already built
        it (decode on the CPU), else from the rotary module (the same numbers; no table of every position)."""
        if self._rope_table is not None:
            return self.rope_rows(like, positions)
        return self.rope.cos_sin(self._computing(like), positions)

    def _computing(self, like: torch.Tensor) -> torch.Tensor:
        """What the rotary module reads for device and dtype: cos and sin in the model's dtype, also where ``like``
        is a 16-bit tier, so that rotation and un-rotation compute as attention does."""
        return like if like.dtype == self.compute_dtype else like.new_empty(0, dtype=self.compute_dtype)

    def note_workspace(self, nbytes: int) -> None:
        table = sum(t.nbytes for t in (*(self._rope_table or ()), self._signed_sin) if t is not None)
        super().note_workspace(nbytes + table)

    def count_moves(self, decision, n_quant: int, n_full: int) -> None:
        """Promotions (Q->F), demotions (F->Q) and evictions, summed over layers and batch rows."""
        evicted = decision.num_candidates * decision.full.shape[0] - decision.full.numel() - decision.quant.numel()
        self.add_moves((decision.full < n_quant).sum(),
                       ((decision.quant >= n_quant) & (decision.quant < n_quant + n_full)).sum(), evicted)

    def add_moves(self, promotions: torch.Tensor, demotions: torch.Tensor, evictions: int) -> None:
        # the evictions by a fill, not a copy from the host (which a CUDA graph could not capture)
        moves = torch.stack([promotions, demotions, torch.full_like(promotions, evictions)])
        # Kept on the device: a host sync per layer and event would stall GPU decoding.
        if self._moves is None:
            self._moves = torch.zeros_like(moves)
        self._moves.add_(moves)

    def drain_events(self) -> list:
        self.move_deferred()
        return super().drain_events()

    def memory_report(self) -> dict:
        self.move_deferred()
        self.check_fit()
        return super().memory_report()

    def summary(self) -> dict:
        self.move_deferred()
        self.check_fit()
        promotions, demotions, evictions = self._moves.tolist() if self._moves is not None else (0, 0, 0)
        return {"promotions": promotions, "demotions": demotions, "evictions": evictions,
                "k_full": self.plan.k_full, "k_quant": self.plan.k_quant, "uncompressed": self.plan.uncompressed}
