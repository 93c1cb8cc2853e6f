"""Engine configuration: one frozen dataclass per concern (one module each), all validated on construction.

``EngineArgs`` is the flat, user-facing bag of arguments (vLLM's names, also the CLI flags);
``EngineArgs.create_engine_config()`` splits it into the per-concern configs the layers read.
"""

from pagellm.config.cache import DEFAULT_KV_CACHE_MEMORY, CacheConfig, KVCacheDType
from pagellm.config.device import CUDA_ONE_GPU, Device, DeviceConfig, default_num_threads
from pagellm.config.engine import EngineConfig
from pagellm.config.engine_args import EngineArgs, as_cli_message
from pagellm.config.kv_transfer import KVTransferConfig
from pagellm.config.lora import LoRAConfig
from pagellm.config.model import (
    BUNDLED_FILE,
    BUNDLED_PACKAGE,
    QUANTIZATIONS,
    DType,
    ModelConfig,
    ModelSource,
    PoolerConfig,
    PoolingType,
    Quantization,
    Runner,
    bundled_model_path,
    resolve_model_source,
)
from pagellm.config.multimodal import MultiModalConfig
from pagellm.config.observability import ObservabilityConfig
from pagellm.config.parallel import ExecutorBackend, ParallelConfig
from pagellm.config.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy
from pagellm.config.speculative import SPEC_METHODS, SpeculativeConfig
from pagellm.config.structured_outputs import ReasoningParserName, StructuredOutputsConfig

__all__ = [
    "BUNDLED_FILE", "BUNDLED_PACKAGE", "CUDA_ONE_GPU", "DEFAULT_KV_CACHE_MEMORY", "QUANTIZATIONS", "SPEC_METHODS",
    "CacheConfig", "DType", "Device", "DeviceConfig", "EngineArgs", "EngineConfig", "ExecutorBackend",
    "KVCacheDType", "KVTransferConfig", "LoRAConfig", "ModelConfig", "ModelSource", "MultiModalConfig",
    "ObservabilityConfig", "ParallelConfig", "PoolerConfig", "PoolingType", "PreemptionMode", "Quantization",
    "ReasoningParserName", "Runner", "SchedulerConfig", "SchedulingPolicy", "SpeculativeConfig",
    "StructuredOutputsConfig", "as_cli_message", "bundled_model_path", "default_num_threads",
    "resolve_model_source",
]
