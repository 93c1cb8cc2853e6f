"""``LLM``: vLLM's offline API (``generate``, ``chat``) over ``LLMEngine``, with a tqdm progress bar."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from pagellm import scoring
from pagellm.config import EngineArgs
from pagellm.engine.data_parallel import create_engine
from pagellm.engine.protocol import PromptType
from pagellm.entrypoints.chat_utils import MediaConnector, extract_images, template_renders_images
from pagellm.lora_request import LoRARequest
from pagellm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Offline batched generation. ``LLM(model=None)`` loads the bundled SmolLM2-135M-Instruct.

    Every keyword is an engine argument under vLLM's name (see ``EngineArgs``); unknown ones raise
    ``TypeError``.
    """

    def __init__(self, model: str | None = None, chat_template: str | None = None,
                 trace: bool | str | None = None, **kwargs: Any) -> None:
        """``trace``: the step trace, ``True`` (in memory: ``get_trace()``) or a file path it is
        written to after every ``generate`` and at shutdown (see docs/step_trace.md)."""
        if trace is not None:
            kwargs["trace_out" if isinstance(trace, str) else "trace"] = trace
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = create_engine(args, chat_template=chat_template)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes or Ray actors (also done when the process exits)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_trace(self) -> dict[str, Any] | None:
        """The step trace so far as a Chrome Trace document (``None`` unless ``trace`` is on)."""
        return self.llm_engine.get_trace()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer().hf

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: one
        adapter for every prompt, or one (or ``None``: the base model) per prompt."""
        if self.llm_engine.model_info.pooling is not None:
            raise ValueError("this LLM was made with runner='pooling': it embeds prompts (llm.embed), it does not "
                             "generate")
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        for lora in {r for r in loras if r is not None}:  # a bad adapter is refused before anything runs
            self.llm_engine.add_lora(lora)
        for params in params_list:  # a constraint that does not compile is refused before anything runs
            if params.structured_outputs is not None:
                self.llm_engine.structured_outputs.validate(params.structured_outputs)
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0,
                                            lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (``LLM(..., runner="pooling")``), in input order; each prompt is
        prefilled through the scheduler and KV cache like any other (chunked, prefix hits where the
        pooling allows them). ``pooling_params.dimensions`` cuts a Matryoshka model's vectors."""
        info = self.llm_engine.model_info.pooling
        if info is None:
            raise ValueError("LLM.embed needs an LLM made with runner='pooling'")
        params = pooling_params or PoolingParams()
        params.check(info)  # (refused before anything runs)
        ids = []
        try:
            for prompt in _prompt_list(prompts):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(params.apply(o.pooled or [], info)),
                                       o.prompt_token_ids) for o in self._run_engine(ids, use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """One score per pair (vLLM's ``LLM.score``: one ``data_1`` against each ``data_2``, or two
        lists zipped): a cross-encoder's sigmoid of its logit for the pair read as one prompt, or
        an embedding model's cosine similarity of the two texts' vectors (``pagellm/scoring.py``)."""
        kind = scoring.score_kind(self.llm_engine.model_info.pooling)
        pairs = scoring.score_pairs(data_1, data_2)
        if kind == "cross-encoder":
            hf = self.get_tokenizer()
            outs = self.embed([{"prompt_token_ids": scoring.pair_token_ids(hf, a, b)} for a, b in pairs], use_tqdm)
            scores = scoring.scores_of(kind, pairs, [o.outputs.embedding for o in outs])
            return [ScoringRequestOutput(o.request_id, ScoringOutput(s), o.prompt_token_ids)
                    for o, s in zip(outs, scores, strict=True)]
        texts = scoring.unique_texts(pairs)  # (each text embedded once)
        embedded = self.embed(texts, use_tqdm)
        scores = scoring.scores_of(kind, pairs, [o.outputs.embedding for o in embedded])
        by_text = dict(zip(texts, embedded, strict=True))
        return [ScoringRequestOutput(f"{by_text[a].request_id}-{by_text[b].request_id}", ScoringOutput(s),
                                     by_text[a].prompt_token_ids + by_text[b].prompt_token_ids)
                for (a, b), s in zip(pairs, scores, strict=True)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search for every prompt, inside the engine (beams share blocks by reference).

        Each output's ``sequences`` are the ``beam_width`` finished beams, best first by
        ``cum_logprob / generated_len ** length_penalty`` (Hugging Face's rules; see
        ``pagellm.core.beam_search``).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)  # type: ignore[arg-type]
        tok = self.llm_engine.get_tokenizer()
        results = []
        for out in outs:
            seqs = []
            for c in out.outputs:
                tokens = list(out.prompt_token_ids) + c.token_ids
                score = (c.cumulative_logprob or 0.0) / (len(c.token_ids) ** params.length_penalty)
                seqs.append(BeamSearchSequence(tokens=tokens, text=tok.decode(tokens, True),
                                               cum_logprob=c.cumulative_logprob or 0.0, score=score,
                                               finish_reason=c.finish_reason, output_token_ids=c.token_ids,
                                               output_text=c.text))
            results.append(BeamSearchOutput(seqs))
        return results

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        ``chat_template_kwargs``: variables the template reads (``{"enable_thinking": False}``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.get_tokenizer()
        media = MediaConnector.from_config(self.llm_engine.config.multimodal)
        renders = template_renders_images(getattr(tok.hf, "chat_template", None))
        prompts: list[PromptType] = []
        for conv in conversations:
            msgs, images = extract_images(conv, tok.image_placeholder, renders, media)  # type: ignore[arg-type]
            prompt = tok.chat_prompt(msgs, add_generation_prompt, template_kwargs=chat_template_kwargs)
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        if pbar is not None:
                            elapsed = time.perf_counter() - start
                            pbar.postfix = (f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                                            f"output: {n_out / elapsed:.2f} toks/s")
                            pbar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
            engine.write_trace()  # (a no-op unless trace_out is set)
        return [finished[r] for r in request_ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, a dict, or token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
