"""The KV connector that carries each request's life to QEvict and gives vLLM its blocks back.

vLLM builds this connector twice. On the scheduler side, ``build_connector_meta`` turns each step's
``SchedulerOutput`` into a small ``StepMeta`` (which requests start, with their first block, prompt length and
``max_tokens``; which forwards are prompt chunks; which requests end), and hands back to vLLM's pool the blocks of a
running request that its QEvict cache has already read (``FREED`` counts them), but for its budget's worth: the
first blocks, as many as its QEvict cache may hold bytes (plans.py; the first is also the request's identity in
the block table), stay allocated, so vLLM's admission and KV-usage metrics count QEvict's store (``KEPT``). A
request whose budget holds every token keeps all its blocks and gets no QEvict cache. On the worker side
``bind_connector_metadata`` hands the step to the request registry (requests.py) before the forward, where
attention (backend.py) finds it. QEvict loads and saves nothing, so the transfer hooks do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import settings
from .model_view import ModelView
from .plans import Plans, block_bytes
from .requests import Requests
from .vllm_blocks import free_block_range

ACTIVE: dict[str, Requests] = {}  # the worker's registry, once its connector exists ("worker")
FREED: dict[str, int] = {}  # blocks handed back to vLLM's pool, per request (scheduler side)
KEPT: dict[str, int] = {}  # blocks kept allocated for the request's QEvict store, per request (scheduler side)


def _trim(counts: dict[str, int]) -> None:
    while len(counts) > 4096:  # a long-running server: keep the recent requests' counts only
        counts.pop(next(iter(counts)))


@dataclass
class StepMeta(KVConnectorMetadata):
    started: list[tuple[str, int, int, int | None]] = field(default_factory=list)  # id, first block, prompt, max
    scheduled: list[tuple[str, int, int]] = field(default_factory=list)  # id, computed tokens, scheduled tokens
    ended: list[str] = field(default_factory=list)


class QEvictConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        settings.check_engine(vllm_config)
        self.config = settings.config_from(extra, vllm_config.cache_config.block_size)
        self._manager = None
        self._requests: dict[str, tuple[int, int | None, int | None]] = {}  # scheduler: prompt, max_tokens, kept
        view = ModelView.from_vllm(vllm_config)
        if role == KVConnectorRole.WORKER:
            ACTIVE["worker"] = Requests(view, self.config, vllm_config.model_config.max_model_len)
        else:
            self._plans = Plans(view, self.config, vllm_config.model_config.max_model_len)
            self._block_bytes = block_bytes(kv_cache_config)

    # -- scheduler side ------------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        (manager,) = kv_cache_manager.coordinator.single_type_managers  # one full-attention group (checked)
        self._manager = manager
        self.block_size = manager.block_size

    def _track(self, req_id: str, prompt: int, max_tokens: int | None) -> None:
        kept = self._plans.of(self._plans.length(prompt, max_tokens)).kept_blocks(self._block_bytes)
        self._requests[req_id] = (prompt, max_tokens, kept)
        if kept is not None:
            KEPT[req_id] = kept
            _trim(KEPT)

    def _free_read_blocks(self, req_id: str, computed: int) -> None:
        """The blocks after the kept ones, up to the last complete one before ``computed``, go back to the pool:
        the worker's QEvict cache read them in an earlier forward, and nothing attends to vLLM's copy any more."""
        kept = self._requests.get(req_id, (0, None, None))[2]
        if kept is None:  # vLLM serves it alone
            return
        freed = free_block_range(self._manager, req_id, kept, computed // self.block_size)
        if freed:
            FREED[req_id] = FREED.get(req_id, 0) + freed
            _trim(FREED)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False  # nothing is loaded from outside

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output) -> StepMeta:
        meta = StepMeta()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            prompt, max_tokens = len(new.prompt_token_ids or []), params.max_tokens if params is not None else None
            self._track(new.req_id, prompt, max_tokens)
            meta.started.append((new.req_id, new.block_ids[0][0], prompt, max_tokens))
            meta.scheduled.append((new.req_id, new.num_computed_tokens,
                                   scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                # Preempted, its blocks freed, and now recomputed from its first token (prompt and the tokens it
                # generated): a fresh QEvict cache reads that sequence as its prompt; its worker cache was closed
                # when it was preempted.
                prompt, max_tokens, _ = self._requests.get(req_id, (0, None, None))
                done = cached.num_output_tokens[i]
                meta.started.append((req_id, cached.new_block_ids[i][0][0], prompt + done,
                                     None if max_tokens is None else max(1, max_tokens - done)))
            meta.scheduled.append((req_id, computed, scheduler_output.num_scheduled_tokens[req_id]))
            self._free_read_blocks(req_id, computed)
        finished = scheduler_output.finished_req_ids
        for req_id in finished:
            self._requests.pop(req_id, None)
        meta.ended = sorted(finished | (scheduler_output.preempted_req_ids or set()))
        return meta

    # -- worker side ---------------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: StepMeta) -> None:
        super().bind_connector_metadata(connector_metadata)
        registry = ACTIVE["worker"]
        for req_id in connector_metadata.ended:
            registry.close(req_id)
        for req_id, first_block, prompt_len, max_tokens in connector_metadata.started:
            registry.open(req_id, first_block, prompt_len, max_tokens)
        for req_id, computed, scheduled in connector_metadata.scheduled:
            registry.schedule(req_id, computed, scheduled)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
