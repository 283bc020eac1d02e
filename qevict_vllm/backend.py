"""vLLM's CPU attention with QEvict: every request's attention runs on its own QEvict cache.

The stock backend still writes each step's keys and values into vLLM's paged cache (``do_kv_cache_update``);
when the QEvict connector is active and this step's metadata is bound, each request's new tokens also go into
its QEvict cache, and its attention output is the engine's: the prompt attended in full and scored over its
last queries, then decode steps over [low-bit windows | sinks | full windows | recent], routed every Ω tokens
per layer. A request whose budget holds every token has no QEvict cache and gets the stock kernel's output.
Without the connector (or in vLLM's warm-up runs) it is the stock backend, unchanged.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import connector


class QEvictCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        registry = connector.ACTIVE.get("worker")
        if attn_metadata is None or registry is None or not _bound():
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        index = extract_layer_index(layer.layer_name)
        starts = attn_metadata.query_start_loc.tolist()
        first_blocks = attn_metadata.block_table[:, 0].tolist()
        rows = [(starts[row], starts[row + 1], registry.find(first_blocks[row]).cache)
                for row in range(len(starts) - 1) if starts[row] < starts[row + 1]]
        if any(cache is None for *_, cache in rows):
            # A request vLLM serves alone (its budget holds every token) reads its own blocks: the stock kernel
            # over the batch, whose rows of QEvict's requests are overwritten below.
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
        d = self.head_size
        for begin, end, cache in rows:
            if cache is None:
                continue
            # vLLM: [tokens, heads, D] -> the engine's (B=1, heads, tokens, D)
            q = query[begin:end].view(end - begin, -1, d).transpose(0, 1).unsqueeze(0)
            k = key[begin:end].view(end - begin, -1, d).transpose(0, 1).unsqueeze(0)
            v = value[begin:end].view(end - begin, -1, d).transpose(0, 1).unsqueeze(0)
            keys, values = cache.update(k, v, index)
            out = cache.layers[index].attend(registry.view.attention[index], q, keys, values, self.scale, 0.0)
            output[begin:end].view(end - begin, -1, d).copy_(out[0])  # (1, tokens, heads, D) -> [tokens, heads, D]
        return output


class QEvictCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return QEvictCPUAttentionImpl


def _bound() -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return has_kv_transfer_group() and get_kv_transfer_group().has_connector_metadata()
