"""Built-in selectors, one module per algorithm; importing this package registers them."""
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
