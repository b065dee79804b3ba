"""The cache gate: decides, per model call, whether to run the block stack or reuse a residual.

Pure Python (numpy at most): no torch, no jax, no model names, so every backend and every rank
takes the very same decisions. The menu:

    CMConfig, CacheManager                      the configuration and the gate (seed 001 API)
    TeaCacheConfig, FBCacheConfig, MagCacheConfig, DeepCacheConfig, LimitsConfig
                                                one technique per file
    Signals, Decision, Applied, FailSafe, Reason, PAIR             what goes in and comes out
    TensorOps, NumpyOps                          how the gate handles residuals it cannot see into
    ConfigError                                  raised for invalid configuration, before sampling
"""

from .config import CFG_MODES, OFFLOAD, PAIR_REDUCE, CMConfig
from .decision import COMPUTE, PAIR, SKIP, Applied, Decision, FailSafe, Reason, Signals
from .deepcache import DeepCacheConfig
from .fbcache import METRICS as FB_METRICS
from .fbcache import FBCacheConfig
from .limits import LimitsConfig
from .magcache import MagCacheConfig
from .manager import CacheManager
from .residuals import NumpyOps, TensorOps
from .teacache import TeaCacheConfig
from .teacache_profiles import PROFILES as TEACACHE_PROFILES
from .validate import ConfigError

__all__ = [
    "CFG_MODES", "OFFLOAD", "PAIR_REDUCE", "CMConfig", "COMPUTE", "PAIR", "SKIP", "Applied",
    "Decision", "FailSafe", "Reason", "Signals", "DeepCacheConfig", "FB_METRICS", "FBCacheConfig",
    "LimitsConfig", "MagCacheConfig", "CacheManager", "NumpyOps", "TensorOps", "TeaCacheConfig", "TEACACHE_PROFILES",
    "ConfigError",
]
