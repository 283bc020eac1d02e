"""Bad configurations raise ValueError naming what is allowed."""

import pytest

from qevict_core import QEvictConfig, make_cache
from tests.conftest import KV, tiny_model


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, r"budget must be a number in \(0, 1\] \(got 0\)"),
    ({"budget": -0.1}, r"budget must be a number in \(0, 1\]"),
    ({"budget": 2}, r"budget must be a number in \(0, 1\] \(got 2\)"),
    ({"budget_bytes": 0}, r"budget_bytes must be None \(use budget\) or an integer > 0"),
    ({"q_frac": 1.5}, r"q_frac must be a number in \[0, 1\]"),
    ({"q_frac": -0.1}, r"q_frac must be a number in \[0, 1\]"),
    ({"bits": 3}, r"bits must be one of \(2, 4\)"),
    ({"bits": 4.0}, r"bits must be one of \(2, 4\) \(got 4.0\)"),
    ({"omega": 0}, "omega must be an integer >= 1"),
    ({"sinks": -1}, "sinks must be an integer >= 0"),
    ({"recent": -2}, "recent must be an integer >= 0"),
    ({"scorer": "magic"}, "scorer must be one of .*cumulative.*decay.*keynorm.*pnorm"),
    ({"scale_dtype": "float8"}, "scale_dtype must be one of .*model.*float16.*bfloat16"),
    ({"budget": float("nan")}, r"budget must be a number in \(0, 1\] \(got nan\)"),
    ({"budget": float("inf")}, r"budget must be a number in \(0, 1\] \(got inf\)"),
    ({"q_frac": float("nan")}, r"q_frac must be a number in \[0, 1\] \(got nan\)"),
    ({"coverage": 0.0}, r"coverage must be None \(split by q_frac\) or a number in \(0, 1\]"),
    ({"coverage": 1.2}, r"coverage must be None .* or a number in \(0, 1\]"),
    ({"coverage": float("nan")}, r"coverage must be None .* or a number in \(0, 1\]"),
    ({"coverage": True}, r"coverage must be None .* or a number in \(0, 1\]"),
    ({"pool": -1}, r"pool must be an integer >= 0"),
    ({"pool": 1.5}, r"pool must be an integer >= 0"),
    ({"pool": True}, r"pool must be an integer >= 0"),
    ({"pool": 1, "scorer": "keynorm"}, r"pool needs an attention scorer \('cumulative', 'decay', 'pnorm'\), not keynorm"),
    ({"pool_weight": 0.0}, r"pool_weight must be a number in \(0, 1\]"),
    ({"pool_weight": 1.5}, r"pool_weight must be a number in \(0, 1\]"),
    ({"pool_weight": float("nan")}, r"pool_weight must be a number in \(0, 1\]"),
    ({"pool_weight": True}, r"pool_weight must be a number in \(0, 1\]"),
    ({"pool_direction": "backward"}, r"pool_direction must be one of \('both', 'forward'\)"),
    ({"head_blend": 1.5}, r"head_blend must be a number in \[0, 1\]"),
    ({"head_floor": -0.1}, r"head_floor must be a number in \[0, 1\]"),
    ({"head_floor": float("nan")}, r"head_floor must be a number in \[0, 1\]"),
    ({"budget": "0.2"}, r"budget must be a number in \(0, 1\] \(got '0.2'\)"),
    ({"budget_bytes": 1.5}, "budget_bytes must be None .* or an integer > 0 .got 1.5."),
    ({"promotion": 1}, r"promotion must be True or False \(got 1\)"),
    ({"kernels": "gpu"}, r"kernels must be one of \('auto', 'triton', 'cpu', 'torch'\)"),
])
def test_bad_config_raises_with_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QEvictConfig(**kwargs)


def test_budget_smaller_than_protected_regions():
    model = tiny_model()
    with pytest.raises(ValueError, match="cannot hold the protected regions.*sinks=5, recent=32"):
        make_cache("qevict", model, QEvictConfig(budget=0.05), max_length=300, strict=True)


def test_every_field_is_declared_with_its_group_and_help():
    """One declaration serves the config, the CLI, the studio and the vLLM plugin: every field has a Knob."""
    from qevict_core.config import GROUPS

    knobs = QEvictConfig.knobs()
    assert list(knobs) == list(QEvictConfig.__dataclass_fields__)
    assert all(k.group in GROUPS and len(k.help) > 10 for k in knobs.values())
    assert set(QEvictConfig.knobs("run")) == {"record_events", "kernels"}


def test_unknown_method_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown method 'nope'; methods: \[.*'fullkv'.*'qevict'.*ablations: \[.*'r1'"):
        make_cache("nope", tiny_model(), QEvictConfig(), max_length=100)


def test_config_round_trips_and_rejects_unknown_keys():
    cfg = QEvictConfig(budget=0.1, omega=16, bits=4, scorer="pnorm", promotion=False)
    assert QEvictConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        QEvictConfig.from_dict({"budget": 0.1, "colour": "red"})


def test_cache_refuses_tokens_beyond_max_length():
    import torch

    model = tiny_model()
    cache = make_cache("qevict", model, QEvictConfig(budget=1.0), max_length=20)
    with pytest.raises(ValueError, match="sized for max_length=20"):
        model(torch.zeros(1, 21, dtype=torch.long), **{KV: cache})


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_sampling_rejects_non_finite_or_negative_temperature(temperature):
    from qevict_core import Sampling

    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        Sampling(temperature=temperature)
