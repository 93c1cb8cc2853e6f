"""The Hugging Face tokenizer of a model (directory or GGUF-embedded) and its chat template."""

from __future__ import annotations

from typing import Any

from pagellm.config import ModelSource, resolve_model_source


class Tokenizer:
    """Thin wrapper over ``transformers.AutoTokenizer``: encode, decode, chat template, EOS."""

    def __init__(self, source: ModelSource, tokenizer: str | None = None, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        if tokenizer is not None:
            tok_source = resolve_model_source(tokenizer)
        else:
            tok_source = source
        if tok_source.is_gguf:
            self.hf = AutoTokenizer.from_pretrained(tok_source.directory, gguf_file=tok_source.gguf_file)
        else:
            self.hf = AutoTokenizer.from_pretrained(tok_source.path)
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
