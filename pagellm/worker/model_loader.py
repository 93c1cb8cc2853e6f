"""Model construction for one worker: the weights built and loaded (sharded where parallel), the
GEMM numerics chosen per machine and the projections packed for them, the compiled ops selected, and
the refusals of what a model cannot run with (vLLM's ``model_loader``)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.config import EngineConfig, resolve_model_source
from pagellm.config.model import AT_WIDTH
from pagellm.distributed import PipelineStage, TensorParallelGroup
from pagellm.kernels import gemm, gemm_int8
from pagellm.kernels.machine import Numerics, choose_numerics, cpu_info
from pagellm.layers.custom_op import select_kernels
from pagellm.layers.linear import Linear
from pagellm.layers.moe import SparseMoeBlock
from pagellm.models import BASE_MODELS, architecture, get_model_class
from pagellm.models.cpu_packing import pack_for_cpu
from pagellm.models.decoder import DecoderForCausalLM
from pagellm.pooling_params import PoolingInfo
from pagellm.quantization.gguf_quant import KERNEL_TYPES
from pagellm.quantization.quant_config import QuantScheme, quant_scheme
from pagellm.quantization.rows16 import Rows16
from pagellm.weights import freq_factors, iter_weights, load_model_config
from pagellm.weights.dummy import initialize_dummy_weights
from pagellm.weights.loader import projection_dtype
from pagellm.weights.pooling_setup import resolve_pooling
from pagellm.worker.cache_engine import HostKVMemory
from pagellm.worker.host_malloc import trim

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def first_layer_linears(model: DecoderForCausalLM) -> list[Linear]:
    """The projections of this pipeline stage's first layer, one per weight shape: what the numerics
    are chosen from. The probe's answer depends only on shapes, and a mixture-of-experts layer's
    experts all share two (timing each of 64 would repeat one measurement 64 times)."""
    layer = model.get_submodule(f"model.layers.{model.model.start}")
    shapes: dict[tuple[int, ...], Linear] = {}
    for m in layer.modules():
        if isinstance(m, Linear):
            shapes.setdefault(tuple(m.weight.shape), m)
    return list(shapes.values())


def quantized_weight_types(model: DecoderForCausalLM) -> dict[tuple[str, int | None], int]:
    """``(stored type, int8 kernel format or None)`` -> how many projections hold such blocks, before
    packing (what the start-up ``numerics:`` line reports; a 16-bit LM head kept beside AWQ / GPTQ
    projections has a line of its own)."""
    counts: dict[tuple[str, int | None], int] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.kept_blocks is not None:
            fmt = m.blocks_format()
            for b in m.kept_blocks.parts.values():
                if not isinstance(b, Rows16):
                    key = (b.type_name, None) if fmt is None else (b.packed_name, b.packing_format())
                    counts[key] = counts.get(key, 0) + 1
    tied = model.tied_head_blocks  # (packed for the LM head with the rest, if the kernel takes it)
    if tied is not None and not isinstance(tied, Rows16):
        key = (f"{tied.type_name} (tied LM head)", tied.kernel_format() if gemm_int8.supported() else None)
        counts[key] = counts.get(key, 0) + 1
    return counts


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: its weights packed for ``numerics``, its ops' kernels selected."""

    model: DecoderForCausalLM
    hf_config: Any
    path: str  # the checkpoint (directory or .gguf file)
    numerics: Numerics


class ModelLoader:
    """Builds the target (and a draft) model of one worker on its device and parallel group.

    On a CPU the model's tensors stay float32 (the fused kernels' dtype) unless a 16-bit model is
    asked for and no bf16 GEMM kernel runs here; the GEMM numerics are then chosen per model."""

    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallelGroup,
                 pp: PipelineStage) -> None:
        self.config, self.device, self.tp, self.pp = config, device, tp, pp
        if device.type == "cuda" and config.model.quantization == "gguf":
            raise ValueError("quantization='gguf' keeps GGUF blocks for the CPU's int8 kernel; on CUDA a GGUF file's "
                             "weights are dequantized to the model's dtype (leave quantization unset)")
        dtype_name = config.model.dtype
        self.cpu_numerics = device.type == "cpu" and (
            dtype_name in ("auto", "float32") or (dtype_name == "bfloat16" and gemm.bf16_supported()))
        if self.cpu_numerics or dtype_name == "auto":
            dtype_name = "float32" if device.type == "cpu" else "bfloat16"
        self.dtype = DTYPES[dtype_name]
        self.numerics = Numerics(self.dtype, f"{dtype_name} model")  # (where none is chosen per machine)
        self.kv_memory: HostKVMemory | None = None  # paused while GEMMs are timed (set by the worker)
        self._chosen: dict[int, Numerics] = {}  # numerics chosen before a model's weights were loaded
        self._schemes: dict[int, QuantScheme] = {}  # quantized HF checkpoints' packing, by model

    def load_target(self) -> LoadedModel:
        """The served model, its numerics logged and checked against ``quantization``."""
        quantization = self.config.model.quantization
        model, hf_config, source = self._build_model(self.config.model.model, quantization)
        # (Paused: the numerics may be chosen by timing GEMMs, which must have both cores.)
        with self.kv_memory.paused() if self.kv_memory is not None else contextlib.nullcontext():
            numerics, packed_int8 = self._numerics_for(model, self.tp.world_size == 1, quantization)
        if self.cpu_numerics:
            logger.info("numerics: %s GEMMs (float32 between them): %s [%s]", numerics.name, numerics.reason,
                        cpu_info().summary())
        if numerics.int8 and packed_int8 == 0:
            raise ValueError(f"quantization={quantization!r} found no weights the int8 kernel takes in {source.path} "
                             f"(GGUF types {sorted(t.name for t in KERNEL_TYPES)}, AWQ, GPTQ without act-order, "
                             "compressed-tensors)")
        if quantization is not None and not numerics.int8:
            raise ValueError(f"quantization={quantization!r} runs on the CPU with dtype auto, "
                             f"float32 or bfloat16 only (here: {self.device}, dtype {self.config.model.dtype})")
        # Every CustomOp (norms, rotary, activation) gets its kernel or its reference, once.
        kernels_on = select_kernels(model, self.device, self.dtype)
        logger.info("%s ops: %s", "Triton" if self.device.type == "cuda" else "compiled CPU",
                    "on" if kernels_on else "off (PyTorch reference ops)")
        self._refuse_features(model, hf_config.architectures[0])
        return LoadedModel(model, hf_config, source.path, numerics)

    def load_draft(self, path: str, vocab_size: int) -> LoadedModel:
        """The draft model of speculative decoding, with its own numerics."""
        draft, hf_config, source = self._build_model(path, None)
        if hf_config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config model {path!r} has a vocabulary of {hf_config.vocab_size} tokens, "
                             f"the target {vocab_size}: a draft model must share the target's tokenizer")
        numerics, _ = self._numerics_for(draft, True, None)
        if self.cpu_numerics:
            logger.info("draft model numerics: %s GEMMs: %s", numerics.name, numerics.reason)
        select_kernels(draft, self.device, self.dtype)
        return LoadedModel(draft, hf_config, source.path, numerics)

    def _refuse_features(self, model: DecoderForCausalLM, arch: str) -> None:
        """What this model cannot run with, refused at start-up naming the argument."""
        spec = self.config.speculative
        if spec is not None and spec.model is not None and hasattr(model, "encode_images"):
            raise ValueError(f"speculative_config with a draft model: {arch} takes images, which a draft model "
                             "would not see (use method 'ngram' or 'suffix')")
        if self.config.lora.enable_lora and any(isinstance(m, SparseMoeBlock) for m in model.modules()):
            raise ValueError(f"enable_lora: LoRA adapters on a mixture-of-experts model ({arch}) are not supported")

    def _build_model(self, path: str | None, quantization: str | None) -> tuple[DecoderForCausalLM, Any, Any]:
        """``(model, HF config, source)``: built on meta (no random init), materialised
        uninitialised, then every weight loaded (sharded, a rank reads only its slice)."""
        source = resolve_model_source(path)
        hf_config = load_model_config(source)
        scheme = None if source.is_gguf else quant_scheme(hf_config, source.path)
        self._check_quantization(source, scheme, quantization)
        if self.config.model.max_model_len:
            hf_config.get_text_config().max_model_len = self.config.model.max_model_len  # (what longrope decides by)
        arch = hf_config.architectures[0]
        cls = get_model_class(arch)
        if architecture(arch).encoder:
            return self._build_encoder(cls, hf_config, source), hf_config, source
        base = arch in BASE_MODELS  # (no LM head: a pooling runner's; tied, so none is expected)
        if base and self.config.model.runner != "pooling":
            raise ValueError(f"{arch} is a base model without an LM head: it can only embed (runner='pooling')")
        if base:
            hf_config.tie_word_embeddings = True
        with torch.device("meta"):
            num_layers = hf_config.get_text_config().num_hidden_layers
            if self.pp.num_stages > num_layers:
                raise ValueError(f"pipeline_parallel_size={self.pp.num_stages} exceeds the model's "
                                 f"{num_layers} layers")
            model = cls(hf_config, freq_factors(source), tp=self.tp, pp=self.pp)
        model = model.to_empty(device=self.device)
        sharded = self.tp.world_size * self.pp.num_stages > 1
        chosen = self._numerics_before_loading(model, source, sharded, quantization)
        if chosen is not None:
            self._chosen[id(model)] = chosen
        dummy = self.config.model.load_format == "dummy"
        if chosen is not None and not dummy and projection_dtype(source) == torch.bfloat16:
            # The projections are loaded in bfloat16 as the file holds them and packed (or quantized)
            # from there: a float32 copy of every weight (2x the file) is never made.
            logger.info("projections loaded in bfloat16 as %s stores them (numerics chosen from the first "
                        "layer's shapes before loading)", source.path)
            for m in model.modules():
                if isinstance(m, Linear):
                    m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=torch.bfloat16), requires_grad=False)
        if dummy:
            logger.info("load_format='dummy': random weights at %s's shape (its weights are not read)", source.path)
            initialize_dummy_weights(model, self.config.model.seed)
        else:
            # (A quantized module's tensors are read whole, as mappings: its blocks are cut per rank.)
            weights = iter_weights(source, hf_config, lazy=sharded and scheme is None,
                                   keep_gguf_blocks=source.is_gguf and self._int8_possible())
            if scheme is not None:  # (each module's packed tensors gathered into its weight)
                weights = scheme.gather(weights, keep=self._int8_possible())
                if scheme.note and self._int8_possible():
                    logger.info("numerics: %s", scheme.note)
                self._schemes[id(model)] = scheme
            model.load_weights(((n if n.startswith("model.") else f"model.{n}", t) for n, t in weights) if base
                               else weights)
        return (model if chosen is not None else model.to(self.dtype)).eval(), hf_config, source

    def _check_quantization(self, source: Any, scheme: QuantScheme | None, quantization: str | None) -> None:
        """Refuse a ``quantization`` the checkpoint is not, and what a quantized HF one cannot run with."""
        stored = None if scheme is None else scheme.method
        # (gguf also takes an HF checkpoint whose float weights are exactly GGUF blocks)
        if quantization in AT_WIDTH and quantization != stored and (quantization != "gguf" or stored):
            held = f"{stored.upper()} weights" if stored else "no AWQ / GPTQ / compressed-tensors weights"
            raise ValueError(f"quantization={quantization!r}, but {source.path} holds {held}")
        if scheme is None:
            return
        if quantization == "q8_0":
            raise ValueError(f"quantization='q8_0' quantizes a 16/32-bit checkpoint; {source.path} is {scheme.name} "
                             "already (leave quantization unset)")

    def _build_encoder(self, cls: Any, hf_config: Any, source: Any) -> Any:
        """An encoder (``models/bert.py``): the pooling runner's only, one worker; its GEMM numerics
        are chosen in ``_numerics_for``."""
        arch, cfg = hf_config.architectures[0], self.config.model
        if cfg.runner != "pooling":
            raise ValueError(f"{arch} is an encoder: it can only embed or score (runner='pooling')")
        if cfg.quantization is not None:
            raise ValueError(f"quantization={cfg.quantization!r} is not supported for encoder models ({arch})")
        with torch.device("meta"):
            model = cls(hf_config, tp=self.tp, pp=self.pp)
        model = model.to_empty(device=self.device)
        if cfg.load_format == "dummy":
            initialize_dummy_weights(model, cfg.seed)
        else:
            model.load_weights(iter_weights(source, hf_config))
        if model.num_labels is not None and hf_config.type_vocab_size > 1:  # (a cross-encoder reads pairs)
            from transformers import AutoTokenizer

            model.sep_token_id = AutoTokenizer.from_pretrained(cfg.tokenizer or source.path).sep_token_id
        return model.to(self.dtype).eval()

    def _numerics_before_loading(self, model: DecoderForCausalLM, source: Any, sharded: bool,
                                 quantization: str | None) -> Numerics | None:
        """For an HF checkpoint on a CPU, the GEMM numerics chosen before any weight is read (a probe
        times the first layer's shapes, not its values), where the choice lets the projections skip
        float32: bfloat16 GEMMs on a checkpoint stored in bfloat16, or ``quantization="q8_0"``."""
        if quantization == "q8_0":
            if not self.cpu_numerics or source.is_gguf or sharded or not gemm_int8.supported():
                raise ValueError("quantization='q8_0' quantizes an HF checkpoint's projections on load, on one CPU "
                                 "worker with dtype auto, float32 or bfloat16 and a C compiler (a GGUF file keeps "
                                 f"its own types: quantization='gguf'); here: {source.path} on {self.device}, "
                                 f"dtype {self.config.model.dtype}, {self.tp.world_size * self.pp.num_stages} "
                                 "workers")
        elif not self.cpu_numerics or source.is_gguf or sharded or quantization is not None \
                or self.config.model.dtype == "float32" or projection_dtype(source) != torch.bfloat16:
            return None
        shapes = [torch.randn(m.weight.shape) * 0.02 for m in first_layer_linears(model)]
        with self.kv_memory.paused() if self.kv_memory is not None else contextlib.nullcontext():
            numerics = choose_numerics(self.config.model.dtype, shapes, probe=True)
        if quantization == "q8_0":
            return Numerics(numerics.compute_dtype, "quantization='q8_0': projections quantized on load to GGUF Q8_0 "
                            f"blocks for the int8 kernel ({gemm_int8.isa()}); other weights: {numerics.reason}",
                            int8=True)
        return numerics if numerics.compute_dtype == torch.bfloat16 and not numerics.int8 else None

    def _int8_possible(self) -> bool:
        """Whether the numerics may come out int8 (GGUF blocks are then kept at their width)."""
        return (self.cpu_numerics and gemm_int8.supported()
                and (self.config.model.quantization in AT_WIDTH or self.config.model.dtype == "auto"))

    def _at_width(self, linears: list[Linear], probe: bool, quantization: str | None) -> Numerics | None:
        """Int8 GEMMs chosen without timing where a quantized checkpoint's first layer is stored as
        blocks the int8 kernel takes (``None``: choose by ``choose_numerics``). Nothing is left to
        time: a probe would dequantize and pack a layer in every format, a transient GB at 1.7B;
        and the blocks kept at their width take a third to a seventh of a float copy's memory."""
        asked = f"quantization={quantization!r}" if quantization in AT_WIDTH else \
            "dtype auto on a quantized checkpoint" if self.config.model.dtype == "auto" else None
        at_width = sum(m.blocks_format() is not None for m in linears)
        # (Plain C, a CPU without AVX2, runs it at a few % of VNNI's speed: there it is timed.)
        if not asked or at_width == 0 or (quantization not in AT_WIDTH and gemm_int8.isa() == "plain C"):
            return None
        reason = f"{asked}: every projection is stored blocks the int8 kernel ({gemm_int8.isa()}) takes"
        if at_width < len(linears):
            if probe:  # (some dequantized in one process: timed as before)
                return None
            # (E.g. a tensor-parallel rank's share of a projection cut through its blocks: dequantized.)
            # Ranks do not time GEMMs: each would choose by its own clock.
            reason = (f"{asked}: {at_width} of the first layer's {len(linears)} projections are stored blocks the "
                      f"int8 kernel ({gemm_int8.isa()}) takes (not timed: a rank of several)")
        return Numerics(torch.float32, f"{reason}, kept at their width (float32 between them)", int8=True)

    def _numerics_for(self, model: DecoderForCausalLM, probe: bool, quantization: str | None) -> tuple[Numerics, int]:
        """The GEMM numerics for ``model`` (chosen per machine on a CPU, from its first layer's
        shapes; else the worker's) and its weights packed for them; returns how many weights the
        int8 kernel took."""
        numerics = self._chosen.pop(id(model), None) or self.numerics
        if getattr(model, "is_encoder", False):  # (no GGUF blocks: float32 or bfloat16 GEMMs, packed)
            if self.cpu_numerics:
                weights = [m.dense_weight() for m in first_layer_linears(model)]
                numerics = choose_numerics(self.config.model.dtype, weights, probe=probe)
                for m in model.modules():
                    if isinstance(m, Linear):
                        m.pack_for_cpu(numerics.compute_dtype, False)
            return numerics, 0
        if self.cpu_numerics and numerics is self.numerics:
            linears = first_layer_linears(model)
            numerics = self._at_width(linears, probe, quantization) or choose_numerics(
                self.config.model.dtype, [m.dense_weight() for m in linears], probe=probe, quantization=quantization,
                int8_weights=[m.kept_blocks.pack() for m in linears if m.kept_blocks is not None]
                if all(m.blocks_format() is not None for m in linears) else None)
        if numerics.int8 and quantization == "q8_0":  # (each quantized a slice at a time as it is packed)
            layers = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
            done = sum(m.quantize_to_q8_0() for m in layers)
            logger.info("quantization='q8_0': %d of %d projections quantized to Q8_0 as they are packed", done,
                        len(layers))
        weight_types = quantized_weight_types(model)
        packed_int8 = 0
        scheme = self._schemes.pop(id(model), None)
        if self.cpu_numerics:
            # (only beside projections at their width: an act-order checkpoint's run dequantized)
            head_scheme = scheme if numerics.int8 and any(f is not None for _, f in weight_types) else None
            packed_int8 = pack_for_cpu(model, numerics.compute_dtype, numerics.int8, after_each=trim,
                                       head_q8_0=head_scheme is not None)
            trim()
            if head_scheme is not None:
                logger.info("numerics: the LM head (16-bit in the %s checkpoint) quantized to Q8_0 blocks on load for "
                            "the int8 kernel", head_scheme.name)
        if weight_types:
            runs: dict[tuple[str, int], int] = {}  # (type, format or 0: dequantized) -> projections
            for (t, f), n in weight_types.items():
                key = (t, f if numerics.int8 and f else 0)
                runs[key] = runs.get(key, 0) + n
            logger.info("numerics: quantized projections %s", ", ".join(
                f"{t} x{n}: {'int8 GEMMs (' + gemm_int8.format_name(f) + ')' if f else 'dequantized'}"
                for (t, f), n in sorted(runs.items())))
        return numerics, packed_int8

    def pooling(self, model: DecoderForCausalLM, hf_config: Any, path: str) -> PoolingInfo | None:
        """The pooling runner's setup (``None`` for a generating one), refusing what it lacks."""
        cfg = self.config
        if cfg.model.runner != "pooling":
            return None
        unsupported = {"a vision-language model": hasattr(model, "encode_images"),
                       "pipeline parallelism": self.pp.num_stages > 1,
                       "speculative_config": cfg.speculative is not None, "enable_lora": cfg.lora.enable_lora}
        for name, on in unsupported.items():
            if on:
                raise ValueError(f"runner='pooling' does not support {name} yet")
        user = cfg.model.pooler_config
        labels = getattr(model, "num_labels", None)
        if labels is not None:  # a classification head scores its CLS row, nothing to normalize
            if user is not None and (user.pooling_type not in (None, "CLS") or user.normalize):
                raise ValueError(f"pooler_config: {hf_config.architectures[0]} classifies its CLS row "
                                 "(pooling_type CLS, normalize false)")
            return PoolingInfo("CLS", False, labels, False, num_labels=labels)
        pooling_type, normalize = resolve_pooling(path, user.pooling_type if user else None,
                                                  user.normalize if user else None,
                                                  "CLS" if getattr(model, "is_encoder", False) else "LAST")
        text = hf_config.get_text_config()
        matryoshka = getattr(text, "matryoshka_dimensions", None) or bool(getattr(text, "is_matryoshka", False))
        info = PoolingInfo(pooling_type, normalize, text.hidden_size, matryoshka)
        logger.info("pooling runner: %s pooling, %s, %d dimensions", pooling_type,
                    "normalized" if normalize else "not normalized", text.hidden_size)
        return info
