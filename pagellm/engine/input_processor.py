"""From a prompt and its parameters to a validated ``SequenceGroup`` (vLLM's ``Processor``).

Tokenization, the checks that keep a request the engine could never serve out of the scheduler
(each a ``ValueError`` naming the problem), and beam search's parameters turned into what the
engine runs. What depends on the engine's live state (request ids in use, LoRA adapters) stays
in ``LLMEngine.add_request``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.beam_state import BeamSearchState
from pagellm.config import EngineConfig
from pagellm.core.kv_connector import check_kv_transfer_params
from pagellm.core.request_queue import scheduling_policy
from pagellm.engine.mm_processor import MultiModalProcessor, as_images
from pagellm.engine.protocol import PromptType
from pagellm.mm_inputs import MultiModalFeature
from pagellm.sampling_params import BeamSearchParams, SamplingParams
from pagellm.sequence import Sequence, SequenceGroup
from pagellm.tokenizer import Tokenizer, check_token_ids

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int, kv_capacity_tokens: int) -> int:
    """The longest sequence the engine serves: the model's limit (or the user's, checked against
    it), capped to what the KV cache holds and, without chunked prefill, to one step's budget."""
    limit = max_position_embeddings
    requested = config.model.max_model_len
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens")
    max_len = requested or limit
    if max_len > kv_capacity_tokens:
        logger.warning("max_model_len %d capped to the KV cache capacity of %d tokens", max_len, kv_capacity_tokens)
        max_len = kv_capacity_tokens
    sched = config.scheduler
    if not sched.enable_chunked_prefill and max_len > sched.max_num_batched_tokens:
        # Unchunked, a sequence (or its recompute after preemption) must fit one step's budget.
        logger.warning("max_model_len %d capped to max_num_batched_tokens %d (chunked prefill is off)",
                       max_len, sched.max_num_batched_tokens)
        max_len = sched.max_num_batched_tokens
    return max_len


@dataclass(frozen=True)
class InputProcessor:
    """Validates requests against the engine's fixed limits and builds their ``SequenceGroup``."""

    config: EngineConfig
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # every KV block's token slots: no prompt longer than that can ever run
    mm: MultiModalProcessor | None = None  # a vision-language model's image processing
    encoder_limit: int = 0  # the most placeholder tokens one image may take (encoder budget and cache)
    # Every id that ends generation besides the tokenizer's EOS: the checkpoint's (ModelInfo's).
    end_of_generation_ids: tuple[int, ...] = ()

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of any accepted prompt form."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _sampling_params(self, params: SamplingParams | BeamSearchParams | None, priority: int) -> SamplingParams:
        params = params or SamplingParams()
        if isinstance(params, BeamSearchParams):
            # The engine samples nothing for a beam search: each beam reports its top candidates.
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                    n=params.beam_width, logprobs=2 * params.beam_width,
                                    structured_outputs=params.structured_outputs)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        sched = self.config.scheduler
        if priority != 0 and not scheduling_policy(sched.scheduling_policy).by_priority:
            raise ValueError(f"priority={priority} needs a scheduling_policy that ranks by priority ('priority'; "
                             f"this engine's is {sched.scheduling_policy!r})")
        num_samples = params.best_of or params.n
        if num_samples > sched.max_num_seqs:
            raise ValueError(f"best_of/n={num_samples} exceeds max_num_seqs={sched.max_num_seqs}: "
                             "its sequences could never run together")
        return params

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        check_token_ids(ids, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "no room for even one generated token")
        if len(ids) + 1 > self.kv_capacity_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens can never fit in the KV cache "
                             f"({self.kv_capacity_tokens} token slots)")

    def _images(self, request_id: str, prompt: PromptType, ids: list[int]) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's images (``multi_modal_data``) processed, their placeholders expanded in ``ids``."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, []
        if self.mm is None:
            raise ValueError("multi_modal_data: this model takes no images (it is a text model)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with the key 'image' (the modality supported)")
        ids, features = self.mm.process(ids, as_images(data["image"]), request_id)
        for i, f in enumerate(features):
            if f.length > self.encoder_limit:
                raise ValueError(f"multi_modal_data['image'][{i}] takes {f.length} placeholder tokens, more than the "
                                 f"encoder may encode in a step or cache ({self.encoder_limit}: raise "
                                 "max_num_encoder_input_tokens and encoder_cache_size)")
        return ids, features

    def _kv_transfer_params(self, prompt: PromptType) -> dict[str, Any] | None:
        kv_params = prompt.get("kv_transfer_params") if isinstance(prompt, dict) else None
        if kv_params is not None:
            kvt = self.config.kv_transfer
            if kvt is None or kvt.kv_connector != "TcpConnector":
                raise ValueError("kv_transfer_params needs an engine with kv_transfer_config "
                                 '{"kv_connector": "TcpConnector", ...}')
            check_kv_transfer_params(kv_params)
        return kv_params

    def _with_end_of_generation(self, sampling: SamplingParams) -> SamplingParams:
        """The tokenizer's EOS, and (vLLM's rule for generation_config.json's ids) the model's other
        end-of-generation ids as stop token ids, unless ``ignore_eos``: a stop there reports the id as
        its ``stop_reason``, as vLLM's does."""
        eos = self.tokenizer.eos_token_id
        stop_ids = sampling.stop_token_ids or []
        extra = [t for t in self.end_of_generation_ids if t != eos and t not in stop_ids]
        if sampling.ignore_eos or not extra:
            return sampling.clone(eos_token_id=eos)
        return sampling.clone(eos_token_id=eos, stop_token_ids=[*stop_ids, *extra])

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
                new_seq_id: Callable[[], int], arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None) -> SequenceGroup:
        """The request as the scheduler takes it, or a ``ValueError`` naming what is wrong."""
        sampling = self._sampling_params(params, priority)
        text, ids = self.tokenize_prompt(prompt)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")  # vLLM passes it inside the prompt dict
        kv_params = self._kv_transfer_params(prompt)
        ids, features = self._images(request_id, prompt, ids)
        self._check_prompt(ids)
        sampling = self._with_end_of_generation(sampling)
        seq = Sequence(new_seq_id(), ids)
        group = SequenceGroup(request_id, [seq], sampling, arrival_time or time.monotonic(), text, priority, cache_salt)
        group.kv_transfer.params = kv_params
        group.mm_features = features
        if isinstance(params, BeamSearchParams):
            group.beam_state = BeamSearchState(
                params.beam_width, min(params.max_tokens, self.max_model_len - len(ids)), params.length_penalty,
                params.early_stopping, None if params.ignore_eos else self.tokenizer.eos_token_id)
        return group
