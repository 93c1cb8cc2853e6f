"""The Hugging Face tokenizer of a model (directory or GGUF-embedded) and its chat template."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from pagellm.config import ModelSource, resolve_model_source
from pagellm.utils import cache_dir

logger = logging.getLogger(__name__)


def check_token_ids(ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    """A ``ValueError`` naming ``what`` if an id is not an integer in ``[0, vocab_size)`` (the
    tokenizer and the embedding would fail on it deep inside, or read past the table)."""
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")


def _load_gguf_tokenizer(source: ModelSource):
    """Convert the GGUF-embedded tokenizer once (seconds) and reuse the saved result afterwards."""
    from transformers import AutoTokenizer

    st = os.stat(source.path)
    key = hashlib.sha256(f"{os.path.realpath(source.path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir("tokenizers"), key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # a damaged cache entry must not stop the engine
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    try:
        tok = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    except ValueError as e:  # transformers reads the config of the families it knows only (granitehybrid:
        # "not supported yet"); the tokenizer's conversion needs just the file's tokenizer.* keys
        if "not supported" not in str(e):
            raise
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(source.directory, gguf_file=source.gguf_file)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as e:
        logger.warning("could not cache the converted tokenizer in %s: %s", cached, e)
    return tok


def _backend_decode(hf: Any) -> Any:
    """The ``tokenizers`` library's own ``decode`` where ``hf.decode`` is exactly it: a fast tokenizer
    whose class keeps the library's ``_decode`` and that cleans up no spaces. Detokenizing calls it
    twice per token per stream; ``transformers``' wrapper around it costs more than the decode."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (another transformers layout: its decode, as before)
        return None
    if type(hf)._decode is not TokenizersBackend._decode or hf.clean_up_tokenization_spaces:
        return None
    return getattr(getattr(hf, "_tokenizer", None), "decode", None)


class Tokenizer:
    """Thin wrapper over ``transformers.AutoTokenizer``: encode, decode, chat template, EOS."""

    def __init__(self, source: ModelSource, tokenizer: str | None = None, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        if tokenizer is not None:
            tok_source = resolve_model_source(tokenizer)
        else:
            tok_source = source
        if tok_source.is_gguf:
            self.hf = _load_gguf_tokenizer(tok_source)
        else:
            self.hf = AutoTokenizer.from_pretrained(tok_source.path)
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self.eos_token_id: int | None = self.hf.eos_token_id
        # A vision-language model's image placeholder text (``<image>``; Qwen2-VL's
        # ``<|vision_start|><|image_pad|><|vision_end|>``; set by the engine), else None.
        self.image_placeholder: str | None = None
        self.vocab_size = len(self.hf)
        self._decode = _backend_decode(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._decode is not None:
            return self._decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (Qwen's, Llama 3.1's; not SmolLM2's)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """``template_kwargs``: variables the template reads (vLLM's ``chat_template_kwargs``, e.g.
        ``{"enable_thinking": False}``)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        reserved = set(template_kwargs or ()) & {"conversation", "messages", "tools", "tokenize",
                                                 "add_generation_prompt", "chat_template"}
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools, **(template_kwargs or {}))

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The templated conversation as a prompt dict (text and ids). The template already holds
        the special tokens, so none are added again (no second BOS)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}
