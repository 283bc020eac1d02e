"""The one place the plugin reaches into vLLM's private API: handing a request's blocks back to the pool.

vLLM frees a running request's blocks only for attention types that skip tokens (sliding windows), through
``remove_skipped_blocks``, which asks the layer type how many tokens it skips; full attention skips none, so there
is no public way to free a range. ``SingleTypeKVCacheManager._remove_blocks_in_range`` is what those attention
types call. tests/vllm_plugin/test_vllm_contract.py fails loudly when vLLM changes it.
"""

from __future__ import annotations


def free_block_range(manager, req_id: str, first: int, stop: int) -> int:
    """Blocks [first, stop) of ``req_id`` back to ``manager``'s pool (null blocks in their place) -> how many."""
    blocks = manager.req_to_blocks.get(req_id, [])
    before = sum(not b.is_null for b in blocks)
    manager._remove_blocks_in_range(req_id, first, stop)
    return before - sum(not b.is_null for b in blocks)
