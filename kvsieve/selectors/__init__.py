"""Built-in selectors, one folder per selector family (config and algorithm, plain-PyTorch reference,
pointers to its kernels; shared page machinery in ``common``); importing this package registers them."""
from __future__ import annotations

from .block_select import BlockSelectConfig, BlockSelectSelector
from .dsa import DSAConfig, DSASelector, IndexerInputs
from .oracle_topk import OracleTopKConfig, OracleTopKSelector
from .quest import QuestConfig, QuestSelector
from .rocketkv import RocketKVConfig, RocketKVSelector
from .skip_softmax import SkipSoftmaxConfig, SkipSoftmaxSelector
from .snapkv import SnapKVConfig, SnapKVSelector
from .streaming import StreamingConfig, StreamingSelector

__all__ = [
    "BlockSelectConfig", "BlockSelectSelector", "OracleTopKConfig", "OracleTopKSelector", "QuestConfig",
    "QuestSelector", "RocketKVConfig", "RocketKVSelector", "SkipSoftmaxConfig", "SkipSoftmaxSelector", "SnapKVConfig", "SnapKVSelector", "StreamingConfig",
    "StreamingSelector",
]
