"""``EngineArgs``: every engine argument under vLLM's name (``LLM(**kwargs)`` and the CLI flags), split
into the per-concern configs by ``create_engine_config``."""

from __future__ import annotations

import argparse
import re
import types
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pagellm.config.cache import DEFAULT_KV_CACHE_MEMORY, CacheConfig, KVCacheDType
from pagellm.config.device import CUDA_ONE_GPU, Device, DeviceConfig
from pagellm.config.engine import EngineConfig
from pagellm.config.kv_transfer import KVTransferConfig
from pagellm.config.lora import LoRAConfig
from pagellm.config.model import DType, LoadFormat, ModelConfig, PoolerConfig, Quantization, Runner
from pagellm.config.multimodal import MultiModalConfig
from pagellm.config.observability import ObservabilityConfig
from pagellm.config.parallel import ExecutorBackend, ParallelConfig
from pagellm.config.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy
from pagellm.config.speculative import SpeculativeConfig
from pagellm.config.structured_outputs import ReasoningParserName, StructuredOutputsConfig
from pagellm.utils import parse_size, reject_unknown

_HELP = {
    "model": "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct GGUF)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "compute dtype; auto = per machine on CPU (bfloat16 GEMMs where pagellm's kernel measures faster, "
             "else float32, the HF-exact oracle; then int8 GEMMs for a GGUF checkpoint where faster still), "
             "bfloat16 on CUDA",
    "quantization": "gguf: keep a GGUF checkpoint's quantized weights at their width and run int8 GEMMs "
                    "(activations rounded to int8 per 32 or 256 values; AVX512-VNNI, AVX2 or plain C); "
                    "awq, gptq: the same for an AWQ or GPTQ checkpoint (found from its config.json without it); "
                    "q8_0: quantize an HF checkpoint's projections on load to GGUF Q8_0 blocks (8 bits per "
                    "weight and a scale per 32) for the same kernel; default: none",
    "load_format": "auto: the checkpoint's weights; dummy: only its config.json (and tokenizer), every weight "
                   "random (a benchmark at a model's shape without its weights)",
    "kv_cache_memory": "KV cache byte budget, e.g. 2GiB, reserved at start-up (ignored with "
                       "--num-gpu-blocks-override; default: a cap of 2GiB, or less where max_num_seqs sequences "
                       "of max_model_len tokens need less, whose memory is taken as blocks are first used)",
    "num_gpu_blocks_override": "exact number of KV blocks (on any device)",
    "gpu_memory_utilization": "on a CUDA device without --kv-cache-memory: the share of its memory the weights, a "
                              "step's activations and the KV cache may take, the KV cache getting the rest "
                              "(default 0.9)",
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
    "num_scheduler_steps": "multi-step decoding: a decode-only step with nothing waiting runs up to this many forward "
                           "passes per schedule, each sampling in the worker (less host work per token; an arrival "
                           "waits up to N-1 passes); steps with penalties, min_tokens, structured output or beams "
                           "run one pass (default: 1)",
    "data_parallel_size": "independent engine replicas behind one front end, requests sent to the least loaded",
    "distributed_executor_backend": "uni (in-process), mp (a process per rank on this machine) or ray (a Ray actor "
                                    "per rank, any node); default: uni for one worker, else mp",
    "kv_cache_dtype": "K/V cache element type: auto (the model's dtype; float16 with bfloat16 or int8 GEMMs on a "
                      "CPU), float32, float16, bfloat16 or int8 (one scale per token and KV head); 16 bits halve "
                      "attention's memory traffic, int8 takes 0.53x of that",
    "disable_hybrid_kv_cache_manager": "one block table for every layer: sliding-window layers keep every token's "
                                       "K/V instead of giving back what their window left (default: off)",
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
                       "and its end): fewer, larger stream chunks for less front-end and client work; 1 = every token; "
                       "default: by load, every token while under 16 requests stream in a step, then one more token "
                       "per 8 such requests, at most 4",
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
    load_format: LoadFormat = "auto"
    runner: Runner = "generate"
    pooler_config: dict | str | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
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
    stream_interval: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend | None = None
    async_scheduling: bool = False
    num_scheduler_steps: int = 1
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
            num_scheduler_steps=self._num_scheduler_steps(),
        )
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, seed=self.seed,
                              max_model_len=self.max_model_len, served_model_name=self.served_model_name,
                              quantization=self.quantization, load_format=self.load_format, runner=self.runner,
                              pooler_config=PoolerConfig.from_any(self.pooler_config)),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=budget,
                              size_to_model=self.kv_cache_memory is None,
                              num_gpu_blocks_override=self.num_gpu_blocks_override,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching,
                              swap_space=None if self.swap_space is None else float(self.swap_space),
                              num_cpu_blocks_override=self.num_cpu_blocks_override,
                              kv_cache_dtype=self.kv_cache_dtype,
                              disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager),
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

    def _num_scheduler_steps(self) -> int:
        """Multi-step samples in the one worker between schedules: what needs the engine (or other
        ranks) at every token is refused by name."""
        n = self.num_scheduler_steps
        if n > 1:
            unsupported = {"tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                           "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1,
                           "async_scheduling": self.async_scheduling,
                           "speculative_config": self.speculative_config is not None,
                           "kv_transfer_config": self.kv_transfer_config is not None}
            for name, on in unsupported.items():
                if on:
                    raise ValueError(f"num_scheduler_steps={n} does not combine with {name}")
        return n

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
