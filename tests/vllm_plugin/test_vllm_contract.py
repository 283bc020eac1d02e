"""What the plugin needs of vLLM's internals, checked against the installed vLLM so that a change there fails here,
loudly, instead of freeing the wrong blocks or missing a preemption (qevict_vllm/vllm_blocks.py, connector.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds .venv-vllm and runs these")


def test_the_private_block_release_is_still_what_the_plugin_calls():
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    method = SingleTypeKVCacheManager._remove_blocks_in_range
    assert list(inspect.signature(method).parameters) == ["self", "request_id", "first_block", "last_block"]
    assert issubclass(FullAttentionManager, SingleTypeKVCacheManager)
    assert "req_to_blocks" in inspect.getsource(SingleTypeKVCacheManager.__init__)


def test_the_scheduler_output_still_says_what_the_connector_reads():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    cached = {f.name for f in dataclasses.fields(CachedRequestData)}
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"} <= cached
    new = {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens"} <= new
    output = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids",
            "preempted_req_ids"} <= output
