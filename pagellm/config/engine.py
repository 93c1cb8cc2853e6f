"""All configs of one engine, as the layers below the entrypoints see them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.config.cache import CacheConfig
from pagellm.config.device import DeviceConfig
from pagellm.config.kv_transfer import KVTransferConfig
from pagellm.config.lora import LoRAConfig
from pagellm.config.model import ModelConfig
from pagellm.config.multimodal import MultiModalConfig
from pagellm.config.observability import ObservabilityConfig
from pagellm.config.parallel import ParallelConfig
from pagellm.config.scheduler import SchedulerConfig
from pagellm.config.speculative import SpeculativeConfig
from pagellm.config.structured_outputs import StructuredOutputsConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All configs of one engine, as the layers below the entrypoints see them."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    kv_transfer: KVTransferConfig | None = None
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
