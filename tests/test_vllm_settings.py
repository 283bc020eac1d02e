"""How a vLLM user switches QEvict on (qevict_vllm.options): checked before vLLM starts, without vLLM installed."""

import pytest

import qevict_vllm
from qevict_vllm.settings import config_from


def test_the_options_switch_on_the_connector_with_blocks_of_one_window():
    options = qevict_vllm.options(budget=0.2, bits=2)
    assert options["block_size"] == 32 and options["enable_prefix_caching"] is False
    transfer = options["kv_transfer_config"]
    assert transfer["kv_connector"] == "QEvictConnector"
    assert transfer["kv_connector_module_path"] == "qevict_vllm.connector"
    assert transfer["kv_connector_extra_config"] == {"budget": 0.2, "bits": 2}
    config = config_from(transfer["kv_connector_extra_config"], block_size=32)
    assert (config.omega, config.bits, config.budget) == (32, 2, 0.2)


@pytest.mark.parametrize("settings, block_size, message", [
    ({"budjet": 0.2}, None, r"unknown QEvict settings \['budjet'\]; allowed: .*'budget'"),
    ({"budget": -1}, None, r"budget must be a number in \(0, 1\]"),
    ({"budget": 1.5}, None, r"budget must be a number in \(0, 1\] \(got 1.5\)"),
    ({"bits": 3}, None, r"bits must be one of \(2, 4\)"),
    ({"kernels": "cpu"}, None, r"does not read \['kernels'\]"),
    ({"omega": 8}, 32, r"omega must equal vLLM's KV block size \(32\): a window is one block"),
])
def test_a_bad_setting_is_refused_naming_what_is_allowed(settings, block_size, message):
    with pytest.raises(ValueError, match=message):
        if block_size is None:
            qevict_vllm.options(**settings)
        else:
            config_from(settings, block_size)
