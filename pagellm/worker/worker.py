"""A worker: loads the model on its device, sizes and holds the KV cache, executes steps."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from pagellm.attention import select_attention_backend
from pagellm.attention.kv_quant import cache_head_dim
from pagellm.config import CUDA_ONE_GPU, EngineConfig, default_num_threads, resolve_model_source
from pagellm.core.kv_cache_spec import KVCacheConfig, MambaSpec, group_layers
from pagellm.core.scheduler_output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from pagellm.distributed import init_parallel
from pagellm.kernels.machine import Numerics
from pagellm.layers.linear import Linear
from pagellm.layers.moe import SparseMoeBlock
from pagellm.layers.pooler import Pooler
from pagellm.lora.adapter import LoRAAdapter, load_adapter
from pagellm.lora.layers import ModelLoRA, module_shapes
from pagellm.lora_request import AdapterSpec
from pagellm.models.decoder import DecoderForCausalLM, model_sliding_window, state_shapes
from pagellm.pooling_params import PoolingInfo
from pagellm.utils import cdiv
from pagellm.weights.loader import end_of_generation_ids
from pagellm.worker.cache_engine import (
    CacheEngine,
    HostKVMemory,
    KVCacheSpec,
    device_kv_budget,
    step_activation_bytes,
)
from pagellm.worker.cuda_graph import CudaGraphRunner, default_capture_sizes
from pagellm.worker.draft_runner import DraftRunner
from pagellm.worker.host_malloc import TRIM_AFTER_TOKENS, trim, tune_malloc
from pagellm.worker.kv_connector import DiskConnectorWorker, KVConnectorWorker, TcpConnectorWorker
from pagellm.worker.model_loader import DTYPES, ModelLoader
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)




@dataclass(frozen=True, slots=True)

class ModelInfo:
    """What the engine needs to know about the loaded model (plain data, crosses process bounds)."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None  # every layer's (the widest), or None where one attends to all
    dtype: str
    device: str
    block_bytes: int
    kv_cache_dtype: str  # what the cache holds ("auto" resolved)
    num_layers: int = 0
    # Each projection an adapter may target, its parts as (in_features, out_features).
    lora_module_shapes: dict[str, list[tuple[int, int]]] | None = None
    # What the K/V of a block depend on besides its tokens (sha256 hex): KV transfer keys on it.
    kv_fingerprint: str = ""
    is_multimodal: bool = False  # takes images (a vision-language model: ``encode_images``)
    pooling: PoolingInfo | None = None  # runner="pooling": how prompts become vectors
    is_encoder: bool = False  # bidirectional: prompts run whole, no prefix caching
    end_of_generation_ids: tuple[int, ...] = ()  # the checkpoint's own (weights/loader.py), EOS aside
    # The KV cache's layer groups (core/kv_cache_spec.py): the engine's KVCacheManager takes them.
    kv_cache_config: KVCacheConfig | None = None
    # Tokens per block: the configured size, or more where a state layer's state needs a larger page.
    block_size: int = 0


class Worker:
    """Owns the model, the ``CacheEngine`` and the ``ModelRunner`` of one device.

    Under tensor parallelism there is one worker per rank, each holding its shard of the weights
    and of the KV cache (its KV heads); ``init_method`` is the ``torch.distributed`` rendezvous.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None,
                 device_index: int | None = None) -> None:
        self.config = config
        self.rank = rank
        dev = config.device.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev, device_index) if dev == "cuda" and device_index is not None \
            else torch.device(dev)
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads or default_num_threads())
        elif self.device.index is not None:
            torch.cuda.set_device(self.device)
        par = config.parallel
        if self.device.type == "cuda" and par.tensor_parallel_size * par.pipeline_parallel_size \
                * par.data_parallel_size > 1:
            raise ValueError(CUDA_ONE_GPU)
        self.tp, self.pp = init_parallel(rank, par.tensor_parallel_size, par.pipeline_parallel_size, init_method,
                                         self.device)
        if self.tp.world_size > 1:
            logger.info("tensor-parallel rank %d of %d on %s, all-reduce over %s", self.tp.rank, self.tp.world_size,
                        self.device, "shared memory" if self.tp.shm is not None else "torch.distributed")
        if self.pp.num_stages > 1:
            logger.info("pipeline stage %d of %d (global rank %d)", self.pp.stage, self.pp.num_stages, rank)
        self.loader = ModelLoader(config, self.device, self.tp, self.pp)
        self.numerics = self.loader.numerics  # (the loaded model's, from load_model on)
        self.cache_engine: CacheEngine | None = None
        self.model_runner: ModelRunner | None = None
        self.step_seconds, self.num_steps = 0.0, 0
        self.kv_connector: KVConnectorWorker | None = None  # (built with the cache)
        self._kv_memory: HostKVMemory | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The model's tensors' dtype (the loader's choice for this device and ``dtype``)."""
        return self.loader.dtype

    @property
    def cpu_numerics(self) -> bool:
        """Whether GEMM numerics are chosen per machine (a CPU with its kernels)."""
        return self.loader.cpu_numerics

    def load_model(self) -> ModelInfo:
        cache = self.config.cache
        # A budget the user named is reserved: mapped now and faulted in while the model loads
        # (initialize_cache takes it). The engine's own default is only a cap: its pages fault in
        # as blocks are first written, so a lightly used engine stays small.
        self._kv_memory = HostKVMemory(cache.kv_cache_memory) \
            if self.device.type == "cpu" and cache.num_gpu_blocks_override is None and not cache.size_to_model \
            else None
        self.loader.kv_memory = self._kv_memory
        try:
            # (before the weights: a GGUF file's header is parsed once, and dropped once they are loaded)
            eog_ids = end_of_generation_ids(resolve_model_source(self.config.model.model))
            loaded = self.loader.load_target()
        except BaseException:
            if self._kv_memory is not None:
                self._kv_memory.stop()
            raise
        model, hf_config, self.numerics = loaded.model, loaded.hf_config, loaded.numerics
        arch = hf_config.architectures[0]
        text_config = hf_config.get_text_config()  # (a vision-language model's decoder)
        self.model = model
        self._fit_block_size_to_states(model)
        self.kv_config = self._kv_cache_config(model)
        self.spec = self._kv_spec(model, self.numerics, self.kv_config.layers_per_page)
        self.kv_fp = self._kv_fingerprint(loaded.path, arch)
        self.draft_model: DecoderForCausalLM | None = None
        self.draft_spec: KVCacheSpec | None = None
        spec_cfg = self.config.speculative
        if spec_cfg is not None and spec_cfg.model is not None:
            draft = self.loader.load_draft(spec_cfg.model, text_config.vocab_size)
            self.draft_model, self.draft_spec = draft.model, self._kv_spec(draft.model, draft.numerics)
        self.max_positions = text_config.max_position_embeddings
        self.text_config = text_config
        self.pooling = self.loader.pooling(model, hf_config, loaded.path)
        lora = self.config.lora
        self.model_lora = ModelLoRA(model, lora.max_loras, lora.max_lora_rank, self.device, self.dtype) \
            if lora.enable_lora else None
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by fingerprint, LRU order
        if self.device.type == "cpu":
            # Activations reuse freed memory instead of page-faulting it in every layer. Only now:
            # tuned while loading, the heap kept loading's transients as holes (trimmed, so not
            # resident) that steps' activations then wandered through, faulting more in each step.
            tune_malloc()
        return ModelInfo(
            architecture=arch,
            vocab_size=text_config.vocab_size,
            max_position_embeddings=text_config.max_position_embeddings,
            sliding_window=model_sliding_window(model),
            dtype=self.numerics.name,
            kv_cache_dtype=str(self.spec.dtype).removeprefix("torch."),
            device=str(self.device),
            block_bytes=self.block_bytes,
            num_layers=text_config.num_hidden_layers,
            lora_module_shapes=module_shapes(model),
            kv_fingerprint=self.kv_fp.hex(),
            is_multimodal=hasattr(model, "encode_images"),
            is_encoder=getattr(model, "is_encoder", False),
            pooling=self.pooling,
            end_of_generation_ids=eog_ids,
            kv_cache_config=self.kv_config,
            block_size=self.config.cache.block_size,
        )

    def _kv_fingerprint(self, path: str, arch: str) -> bytes:
        """The identity of this worker's K/V values and layout: model weights (their files'
        paths, sizes and modification times), GEMM numerics, K/V dtype and block shape, tensor
        parallelism. Two engines agreeing on it compute the same K/V for the same tokens."""
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".gguf")))
        stats = [(os.path.realpath(f), st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)]]
        spec = self.spec
        ident = {"format": 1, "arch": arch, "weights": stats, "numerics": self.numerics.name,
                 "kv_dtype": str(spec.dtype), "block": [spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                        spec.block_size],
                 "tp": [self.tp.rank, self.tp.world_size], "device": self.device.type}
        if self.config.model.load_format == "dummy":  # (no weight files: the random weights' seed is their identity)
            ident["dummy_seed"] = self.config.model.seed
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()

    def _fill_lora_slot(self, slot: int, spec: AdapterSpec) -> None:
        """Copy an adapter into a device slot; its tensors are read once and the last
        ``max_cpu_loras`` kept (an engine-checked adapter: a few ms for a small one)."""
        assert self.model_lora is not None, "LoRA slots without enable_lora"
        adapter = self._adapters.pop(spec.fingerprint, None) or load_adapter(spec)
        self._adapters[spec.fingerprint] = adapter
        while len(self._adapters) > self.config.lora.cpu_loras:
            self._adapters.popitem(last=False)
        self.model_lora.load(slot, adapter)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: the target's K/V, and the draft model's when there is one."""
        return self.spec.block_bytes + (self.draft_spec.block_bytes if self.draft_spec is not None else 0)

    def _kv_cache_config(self, model: DecoderForCausalLM) -> KVCacheConfig:
        """The layers' groups by what each can read (its sliding window, or everything). One group
        of every layer where a feature keeps one block table per sequence: pipeline stages, a draft
        model's cache, KV transfer (or ``disable_hybrid_kv_cache_manager``)."""
        inner = model.model
        bs = self.config.cache.block_size
        # (a state layer declares its state's shape: one MambaSpec group block per request)
        windows: list[int | None | MambaSpec | bool] = []
        for la in inner.layers[inner.start:inner.end]:
            layer_states = state_shapes(la)
            if not hasattr(la, "self_attn") and not layer_states:
                windows.append(False)  # (a layer that keeps nothing: Nemotron-H's MLP layers)
                continue
            windows.append(MambaSpec(bs, tuple(shape for shape, _ in layer_states), tuple(d for _, d in layer_states),
                                     cache_states=self.config.cache.enable_prefix_caching)
                           if layer_states else getattr(la.self_attn, "sliding_window", None))
        cfg = self.config
        off = [why for why, on in (("disable_hybrid_kv_cache_manager", cfg.cache.disable_hybrid_kv_cache_manager),
                                   ("pipeline parallelism", self.pp.num_stages > 1),
                                   ("a draft model", cfg.speculative is not None and cfg.speculative.model is not None),
                                   ("KV transfer", cfg.kv_transfer is not None)) if on]
        states = any(isinstance(w, MambaSpec) for w in windows) or False in windows
        if states and (off or cfg.speculative is not None or cfg.cache.kv_cache_dtype == "int8"):
            why = off + (["speculative decoding"] if cfg.speculative is not None else []) \
                + (["kv_cache_dtype='int8'"] if cfg.cache.kv_cache_dtype == "int8" else [])
            raise ValueError("a model with state layers (convolution or recurrent states) does not support "
                             f"{', '.join(why)} yet")
        if off and any(w is not None for w in windows if w is not False):
            logger.info("sliding-window layers keep every token's K/V (one block table for all layers): %s",
                        ", ".join(off))
        return group_layers(windows, bs, hybrid=not off)

    def _kv_spec(self, model: DecoderForCausalLM, numerics: Numerics, num_layers: int | None = None) -> KVCacheSpec:
        """A block's shape; ``num_layers``: the layers a page holds (all of this stage's by default)."""
        inner = model.model
        attn = inner.first_layer.self_attn
        return KVCacheSpec(num_layers=num_layers or inner.end - inner.start, num_kv_heads=attn.num_kv_heads,
                           head_dim=attn.head_dim, block_size=self.config.cache.block_size,
                           dtype=self._kv_cache_dtype(numerics))

    def _kv_cache_dtype(self, numerics: Numerics) -> torch.dtype:
        """``auto``: the model's dtype; with bfloat16 (or int8) GEMMs on a CPU, float16 (16-bit like the
        weights, read directly by the attention kernels, more exact than bfloat16's 8-bit mantissa).
        ``int8`` stays opt-in: it passes the quality gate, but on top of int8 GEMMs it adds
        divergence for a gain within noise on W64 (docs/performance.md)."""
        kv = self.config.cache.kv_cache_dtype
        if kv != "auto":
            return torch.int8 if kv == "int8" else DTYPES[kv]
        sixteen = numerics.int8 or numerics.compute_dtype == torch.bfloat16
        return torch.float16 if self.cpu_numerics and sixteen else self.dtype

    def parallel_info(self) -> dict[str, object]:
        """This worker's place in the tensor-parallel group and what it loaded there: its KV heads,
        GEMM numerics and how many projections each weight format holds (for logs and tests)."""
        formats: dict[str, int] = {}
        for m in self.model.modules() if hasattr(self, "model") else ():
            if isinstance(m, Linear):
                name = "unpacked" if m.weight_format is None else m.weight_format.kind
                formats[name] = formats.get(name, 0) + 1
        return {"rank": self.tp.rank, "world_size": self.tp.world_size, "shm_all_reduce": self.tp.shm is not None,
                "num_kv_heads": self.spec.num_kv_heads if hasattr(self, "spec") else None,
                "numerics": self.numerics.name, "weight_formats": formats}

    def determine_num_blocks(self) -> tuple[int, int]:
        """``(device blocks, CPU swap blocks)`` from the byte budgets or the overrides."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            n = cache.num_gpu_blocks_override
        else:
            budget = self._device_kv_budget() if self.device.type == "cuda" and cache.size_to_model \
                else cache.kv_cache_memory
            n = budget // self.block_bytes
            if n < 1:
                raise ValueError(
                    f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block "
                    f"(one block of {cache.block_size} tokens needs {self.block_bytes} bytes)"
                )
            if cache.size_to_model:  # (and one block to spare, the null block where windows free blocks)
                max_len = self.config.model.max_model_len or self.max_positions
                sched = self.config.scheduler
                per_seq = sum(s.max_blocks_held(max_len, sched.max_num_batched_tokens)
                              for s in self.kv_config.specs if not isinstance(s, MambaSpec))
                n = min(n, sched.max_num_seqs * per_seq + 1 + (not self.kv_config.is_single_full))
        if cache.num_cpu_blocks_override is not None:
            n_cpu = cache.num_cpu_blocks_override
        elif cache.swap_space is None:
            n_cpu = min(n, 4 * 2**30 // self.block_bytes)  # swapped-out work once fit on the device
        else:
            n_cpu = int(cache.swap_space * 2**30) // self.block_bytes
        return n, n_cpu

    def _device_kv_budget(self) -> int:
        """The KV cache a CUDA device holds after the weights, without a budget given (vLLM's
        ``gpu_memory_utilization``)."""
        free, total = torch.cuda.mem_get_info(self.device)
        text = self.text_config
        sched = self.config.scheduler
        activations = step_activation_bytes(sched.max_num_batched_tokens, sched.max_num_seqs, text.hidden_size,
                                            getattr(text, "intermediate_size", 4 * text.hidden_size),
                                            text.vocab_size, self.loader.dtype.itemsize)
        return device_kv_budget(total, total - free, self.config.cache.gpu_memory_utilization, activations)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        memory, self._kv_memory = self._kv_memory, None
        if memory is not None and num_blocks * self.spec.block_bytes > memory.nbytes:
            memory.stop()  # (more blocks than the budget, a caller's choice: a fresh mapping; this one
            memory = None  # must not go on faulting in memory nothing will use)
        graphs = self._cuda_graphs_apply()
        self.cache_engine = CacheEngine(self.spec, num_blocks, self.device, num_cpu_blocks, memory,
                                        scratch_block=graphs)
        # Chosen once for this cache and model dtype: which attention kernels apply here. A pooling run
        # never decodes, so under 16-bit GEMMs its prefill attention may round to bfloat16 tiles too
        # (there is no decoded token whose bits a prefilled one must repeat).
        sixteen = self.numerics.int8 or self.numerics.compute_dtype == torch.bfloat16
        self.attn_backend = select_attention_backend(self.cache_engine.kv_caches[0][0], self.dtype,
                                                     bf16_prefill=self.pooling is not None and self.cpu_numerics
                                                     and sixteen)
        logger.info("attention backend: %r", self.attn_backend)
        self.model_runner = ModelRunner(self.model, self.spec.block_size, self.device, self.attn_backend,
                                        self.tp.is_driver and self.pp.is_last)
        self.model_runner.lora = self.model_lora
        # Each model layer's K/V tensors: its slot of the page its group's blocks index (a state
        # layer's state: a view of the same pages; a layer in no group keeps nothing: empty tensors).
        inner = self.model.model
        held = {i for g in self.kv_config.groups for i in g.layer_ids}
        slots = [self.kv_config.page_slot(i) if i in held else None for i in range(inner.end - inner.start)]
        nothing = (torch.empty(0), torch.empty(0))
        self.layer_caches = [nothing if slot is None else self._state_view(slot[1], spec)
                             if isinstance(spec := self.kv_config.groups[slot[0]].spec, MambaSpec)
                             else self.cache_engine.kv_caches[slot[1]] for slot in slots]
        if len(self.kv_config.groups) > 1:
            states = {g for g, group in enumerate(self.kv_config.groups) if isinstance(group.spec, MambaSpec)}
            self.model_runner.set_kv_groups([0 if slot is None else slot[0] for slot in slots], states,
                                            any(s.cache_states for s in self.kv_config.specs
                                                if isinstance(s, MambaSpec)))
            self.attn_backend.share_prefixes = False
        if self.pooling is not None:
            # (a classification head's: models/bert.py)
            head = getattr(self.model, "classify") if self.pooling.num_labels is not None else None  # noqa: B009
            self.model_runner.pooler = Pooler(self.pooling.pooling_type, self.pooling.normalize, head)
        if graphs:
            self._capture_cuda_graphs()
        kvt = self.config.kv_transfer
        if kvt is not None and kvt.kv_connector == "DiskConnector":
            self.kv_connector = DiskConnectorWorker(kvt.store_dir(self.kv_fp.hex()), self.kv_fp, self.cache_engine)
        elif kvt is not None:
            self.kv_connector = TcpConnectorWorker(self.kv_fp, self.cache_engine, kvt.timeout_s)
        self.draft_cache: CacheEngine | None = None
        if self.draft_model is not None and self.draft_spec is not None:
            self.draft_cache = CacheEngine(self.draft_spec, num_blocks, self.device, num_cpu_blocks)
            backend = select_attention_backend(self.draft_cache.kv_caches[0][0], self.dtype)
            self.model_runner.draft = DraftRunner(self.draft_model, backend, self.draft_cache.kv_caches,
                                                  self.spec.block_size, self.device, self.max_positions)

    def _state_view(self, slot: int, spec: MambaSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """A state layer's states, each ``[num_blocks, *shape]`` of its dtype: state ``i`` in the
        first bytes of each block's K (``i = 0``) or V (``i = 1``) rows of page slot ``slot`` (the
        same bytes swaps and copies move; ``_fit_block_size_to_states`` made them fit). A layer's
        one state comes twice (the pair a layer's cache is)."""
        assert self.cache_engine is not None
        views = []
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
            rows = self.cache_engine.kv[slot, i]
            per_block = rows.view(-1, self.spec.block_size * rows.shape[1] * rows.shape[2])
            if dtype != "cache":
                per_block = per_block.view(DTYPES[dtype])
            views.append(per_block[:, :math.prod(shape)].unflatten(1, shape))
        return views[0], views[-1]

    def _fit_block_size_to_states(self, model: DecoderForCausalLM) -> None:
        """Raise ``block_size`` where a state layer's state (one per half of its page slot: K rows,
        then V rows) needs more bytes than a block of attention K/V holds, as vLLM sizes hybrid
        models' attention blocks to their state pages: to a multiple of 16 tokens."""
        inner = model.model
        states = [s for la in inner.layers[inner.start:inner.end] for s in [state_shapes(la)] if s]
        if not states:
            return
        if any(len(s) > 2 for s in states):
            raise ValueError("a state layer has more than two states (a page slot holds one in K, one in V)")
        cache_dtype = self._kv_cache_dtype(self.numerics)
        attn = inner.first_layer.self_attn
        token_bytes = attn.num_kv_heads * cache_head_dim(attn.head_dim, cache_dtype) * cache_dtype.itemsize
        itemsize = {"cache": cache_dtype.itemsize} | {k: v.itemsize for k, v in DTYPES.items()}
        need = max(cdiv(math.prod(shape) * itemsize[dtype], token_bytes) for s in states for shape, dtype in s)
        cache = self.config.cache
        if need > cache.block_size:
            size = cdiv(need, 16) * 16
            logger.info("block_size raised from %d to %d tokens: a block's page must hold a state layer's state "
                        "(%d bytes)", cache.block_size, size, need * token_bytes)
            self.config = replace(self.config, cache=replace(cache, block_size=size))

    def _cuda_graphs_apply(self) -> bool:
        """Whether decode steps become CUDA graphs: on a GPU unless ``enforce_eager``, for models
        whose forward never reads a tensor on the host (a mixture of experts counts its rows) and
        without LoRA (its rows' adapters are set per step on the host)."""
        if self.device.type != "cuda" or self.config.device.enforce_eager:
            return False
        if len(self.kv_config.groups) > 1:
            logger.info("CUDA graphs off: layers read the block tables of several KV cache groups")
            return False
        if any(isinstance(m, SparseMoeBlock) for m in self.model.modules()) or self.model_lora is not None:
            logger.info("CUDA graphs off: %s", "a mixture-of-experts model" if self.model_lora is None else "LoRA")
            return False
        return True

    def _capture_cuda_graphs(self) -> None:
        assert self.cache_engine is not None and self.model_runner is not None
        assert self.cache_engine.scratch_block is not None
        bs = self.spec.block_size
        max_len = max(self.config.model.max_model_len or 0, self.max_positions)
        sizes = self.config.device.cudagraph_capture_sizes or default_capture_sizes(self.config.scheduler.max_num_seqs)
        graphs = CudaGraphRunner(self.model, self.attn_backend, self.cache_engine.kv_caches, bs, -(-max_len // bs),
                                 self.cache_engine.scratch_block, sizes, self.device)
        graphs.capture()
        self.model_runner.cuda_graphs = graphs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens (``None`` on ranks other than 0, which only compute)."""
        assert self.cache_engine is not None and self.model_runner is not None, "initialize_cache first"
        ops = scheduler_output.cache_ops
        # Before the forward pass: swapped-out blocks may be reused by this very step.
        for slot, spec in scheduler_output.lora_loads.items():
            self._fill_lora_slot(slot, spec)
        for cache in (self.cache_engine, self.draft_cache):
            if cache is not None:
                cache.swap_out(ops.swap_out)
                cache.swap_in(ops.swap_in)
                cache.copy(ops.copy)
        meta, connector = scheduler_output.kv_connector_metadata, self.kv_connector
        transfer = None
        if meta is not None and connector is not None:
            transfer = KVConnectorOutput()
            connector.start_load_kv(meta, transfer)  # (blocks of waiting requests: no step reads them)
        t0 = time.perf_counter()
        out = self.model_runner.execute_model(scheduler_output, self.layer_caches)
        self.step_seconds += time.perf_counter() - t0
        self.num_steps += 1
        num_tokens = sum(s.num_scheduled_tokens for s in scheduler_output.scheduled)
        if self.device.type == "cpu" and num_tokens >= TRIM_AFTER_TOKENS:
            trim()  # (a long step's activations, freed: see host_malloc)
        if transfer is not None:
            assert meta is not None and connector is not None
            connector.save_kv(meta, transfer)
            if out is not None:
                out.kv_connector_output = transfer
        return out

    def pipeline_timings(self) -> dict[str, float]:
        """This rank's steps and seconds: in the model runner, and of those in sending to and
        receiving from (waiting for) the neighbouring pipeline stages."""
        return {"stage": self.pp.stage, "steps": self.num_steps, "step_seconds": self.step_seconds,
                "send_seconds": self.pp.send_seconds, "recv_seconds": self.pp.recv_seconds}

    def kv_wait_for_save(self) -> None:
        """Until every K/V block the connector queued is on disk."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()

    def shutdown(self) -> None:
        """Finish what must outlive the worker (queued K/V saves)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
