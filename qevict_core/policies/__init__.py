"""Eviction baselines, one file each, all on :class:`~qevict_core.policies.base.Policy`."""

from .adakv import AdaKV
from .base import Policy, ScoreInputs
from .criticalkv import CriticalKV
from .defensivekv import DefensiveKV
from .h2o import H2O
from .layer_defensivekv import LayerDefensiveKV
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

__all__ = ["AdaKV", "CriticalKV", "DefensiveKV", "H2O", "LayerDefensiveKV", "Policy", "ScoreInputs", "SnapKV",
           "StreamingLLM"]
