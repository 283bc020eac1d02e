"""What a decode step would launch on a GPU, counted on the CPU (bench/launches.py): the counter on hand-built cases,
and the GPU paths' plain and routing steps held to today's counts, so a change that adds kernels to every layer of
a step fails here and says where it went (a replayed CUDA graph still pays a launch slot per kernel)."""

from __future__ import annotations

import pytest
import torch

from bench.common import Variant
from bench.launches import CountLaunches, in_bfloat16, steps_of
from tests.conftest import random_prompt, tiny_model


def test_the_counter_counts_writes_not_views_allocations_or_no_op_conversions():
    x = torch.ones(4, 6)
    with torch.inference_mode(), CountLaunches() as counter:  # as decode steps run
        x.view(6, 4), x[:, 1:].t(), x.to(torch.float32), torch.empty(3)  # no kernel
        y = x * 2  # new storage
        y.add_(1)  # in place
        x.to(torch.bfloat16)  # a real conversion
    assert dict(counter.launched) == {"aten.mul": 1, "aten.add_": 1, "aten.to": 1}


# kernels per layer beyond FullKV's static cache in a plain decode step and a routing step of a 2-layer bfloat16
# model, as counted at the commit that set them; lower them when a change removes launches
PLAIN_STEP_BOUND = {"qevict@torch": 37.5, "qevict@triton": 0}
ROUTING_STEP_BOUND = {"qevict@torch": 138, "qevict@triton": 64}


@pytest.mark.parametrize("spec", sorted(PLAIN_STEP_BOUND))
def test_a_decode_step_launches_no_more_than_today(spec):
    model = in_bfloat16(tiny_model("llama", 2))
    prompt = random_prompt(300)
    base = sum(steps_of(model, Variant.parse("fullkv_static"), None, prompt, 4)["plain"].values())
    counted = steps_of(model, Variant.parse(spec), 0.3, prompt, 96)
    beyond = (sum(counted["plain"].values()) - base) / model.config.num_hidden_layers
    assert beyond <= PLAIN_STEP_BOUND[spec], dict(counted["plain"])
    routing = (sum(counted["routing"].values()) - base) / model.config.num_hidden_layers
    assert beyond < routing <= ROUTING_STEP_BOUND[spec], dict(counted["routing"])  # an event moves windows too
    if spec.endswith("@triton"):  # its four kernels, once per layer, in place of the model's attention
        kernels = ("_split_kernel", "_fp_kernel", "_merge_kernel", "_fold_kernel")
        assert [counted["plain"][f"triton:{name}"] for name in kernels] == [2] * 4
        assert "aten.scaled_dot_product_attention" not in counted["plain"]
