"""From updated sequences to ``RequestOutput``: incremental detokenization, stop strings, the
stream interval, and output building for samples (``n``, ``best_of``) and beams.

vLLM keeps this in the front end's ``OutputProcessor``; here it runs beside the engine core's step
loop (so stop strings end sequences in the same step and free their blocks at once) and is called
by ``LLMEngine`` after each ``update_from_output``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

from pagellm.detokenizer import IncrementalDetokenizer, find_stop_string
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagellm.tokenizer import Tokenizer

# Ends one sequence from outside the step (the scheduler's ``finish_seq``).
FinishSeq = Callable[[SequenceGroup, Sequence, SequenceStatus], None]


# The stream interval by load: a server's per-chunk work (an output through the front end, an SSE
# event written and read) is paid per stream per output, on the cores the forward uses. A step with
# few requests streaming sends every token (a lone stream's tokens are never held back); from
# AUTO_STREAMS_PER_TOKEN * 2 on, one more token per that many streams, up to AUTO_MAX_INTERVAL
# (at 4 the API server's CPU per W64 run is 0.55x of every token's: docs/performance.md).
AUTO_STREAMS_PER_TOKEN = 8
AUTO_MAX_INTERVAL = 4


def interval_for(num_streams: int) -> int:
    """The stream interval of a step in which ``num_streams`` requests got tokens."""
    return max(1, min(AUTO_MAX_INTERVAL, num_streams // AUTO_STREAMS_PER_TOKEN))


class OutputProcessor:
    """Per-request output state (detokenizers, what the last output carried) and the outputs."""

    def __init__(self, tokenizer: Tokenizer, stream_interval: int | None, finish_seq: FinishSeq) -> None:
        self.tokenizer = tokenizer
        # None: by load (``interval_for``); the interval of the step being processed.
        self.fixed_interval = stream_interval
        self.stream_interval = stream_interval or 1
        self._finish_seq = finish_seq
        self._detok: dict[int, IncrementalDetokenizer] = {}  # seq_id -> its detokenizer
        # Output tokens (of the longest sequence) the last RequestOutput of a request carried; 0
        # until one carried text. Only kept with a stream interval above 1.
        self._sent: dict[str, int] = {}
        # Prompt logprobs as outputs carry them, built (and detokenized) once per request.
        self._prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = {}

    def add_request(self, group: SequenceGroup) -> None:
        seq = group.seqs[0]
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                         group.sampling_params.skip_special_tokens)

    def forget(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._detok.pop(seq.seq_id, None)
        self._sent.pop(group.request_id, None)
        self._prompt_logprobs.pop(group.request_id, None)

    def process(self, updated: list[SequenceGroup]) -> list[RequestOutput]:
        """The step's outputs: timing, detokenization and stop strings for every group that got a
        token, then an output for each one whose output is due."""
        now = time.monotonic()
        outputs = []
        if self.fixed_interval is None:
            self.stream_interval = interval_for(len(updated))
        for group in updated:
            m = group.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if group.beam_state is None:  # beams are decoded once, when the search is over
                for seq in group.seqs:
                    self.detokenize(group, seq)
            if group.is_finished():
                m.finished_time = now
            if self._output_due(group):
                outputs.append(self.make_output(group))
        return outputs

    def detokenize(self, group: SequenceGroup, seq: Sequence) -> None:
        """Feed ``seq``'s new tokens to its detokenizer (a fork gets its own on first sight) and
        apply stop strings; a run of accepted drafts goes token by token and is cut after the
        token that completes one, as if the drafts after it had never been accepted."""
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                           group.sampling_params.skip_special_tokens)
            self._detok[seq.seq_id] = detok
        new = seq.output_token_ids[detok.num_output_tokens:]
        if len(new) > 1 and seq.run_cumulative:
            for i, token in enumerate(new):
                if self._apply_stop_strings(group, seq, detok, detok.step([token]), i == len(new) - 1):
                    break
        elif new:
            self._apply_stop_strings(group, seq, detok, detok.step(new), True)
        if seq.run_cumulative:
            seq.run_cumulative = []

    def _apply_stop_strings(self, group: SequenceGroup, seq: Sequence, detok: IncrementalDetokenizer, delta: str,
                            last: bool) -> bool:
        """Whether ``delta`` (the text of the tokens just fed) completes a stop string: if so the text
        and, before the ``last`` token fed this step, the tokens end there, and so does ``seq``. A
        token that already stopped ``seq`` (EOS, a stop token id) keeps its reason."""
        params = group.sampling_params
        if not (delta and params.stop) or (last and seq.status == SequenceStatus.FINISHED_STOPPED):
            return False
        stops = cast(list[str], params.stop)  # SamplingParams.__post_init__ made it a list
        hit = find_stop_string(detok.text, len(delta), stops, params.include_stop_str_in_output)
        if hit is None:
            return False
        detok.text = detok.text[:hit[1]]
        seq.stop_reason = hit[0]
        if not last:
            seq.truncate_output(detok.num_output_tokens)
        if seq.is_finished():  # the same token (or a later one of the run) also hit max_tokens or EOS
            seq.status = SequenceStatus.FINISHED_STOPPED
        else:
            self._finish_seq(group, seq, SequenceStatus.FINISHED_STOPPED)
        return True

    def _output_due(self, group: SequenceGroup) -> bool:
        """Whether this step's output goes out under the stream interval: every token until the
        first text, then every ``stream_interval`` tokens, and the end (stop strings can only cut
        the last one); an output held back is carried by the next, as outputs are cumulative.
        A ``True`` also records the output as sent, so ask once per step."""
        if self.stream_interval == 1:
            return True
        n = max(seq.num_output_tokens for seq in group.seqs)
        sent = self._sent.get(group.request_id, 0)
        if group.is_finished() or sent == 0 or n - sent >= self.stream_interval:
            # A first token can decode to no text yet (a split character, a held-back space): a
            # stream's first chunk must not wait N more steps for it (seconds, in a prefill phase).
            has_text = any((d := self._detok.get(seq.seq_id)) is not None and d.text for seq in group.seqs)
            self._sent[group.request_id] = n if has_text else 0
            return True
        return False

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The request's cumulative output now (the ``n`` best of ``best_of`` once finished)."""
        if group.beam_state is not None:
            return self._make_beam_output(group)
        seqs = group.seqs
        params = group.sampling_params
        if len(seqs) > params.n:
            # best_of > n: the n best by cumulative logprob once finished (a preview before).
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob) if group.is_finished() else seqs
            seqs = seqs[:params.n]
        completions = []
        for i, seq in enumerate(seqs):
            logprobs = None
            if params.logprobs is not None:
                logprobs = [{t: Logprob(lp, rank, self.tokenizer.decode([t], False)) for t, (lp, rank) in d.items()}
                            for d in seq.output_logprobs]
            completions.append(CompletionOutput(
                index=i, text=self._detok[seq.seq_id].text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        return self._request_output(group, completions)

    def _make_beam_output(self, group: SequenceGroup) -> RequestOutput:
        """A beam search's finished hypotheses, best first (none until the search is over)."""
        assert group.beam_state is not None
        hyps = group.beam_state.finished if group.is_finished() else []
        completions = [CompletionOutput(index=i, text=self.tokenizer.decode(h.output_token_ids, True),
                                        token_ids=list(h.output_token_ids), cumulative_logprob=h.cum_logprob,
                                        logprobs=None, finish_reason=h.finish_reason)
                       for i, h in enumerate(hyps)]
        return self._request_output(group, completions)

    def _request_output(self, group: SequenceGroup, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             outputs=completions, finished=group.is_finished(), metrics=group.metrics,
                             num_cached_tokens=group.num_cached_tokens, prompt_logprobs=self.prompt_logprobs(group),
                             pooled=group.pooled)

    def prompt_logprobs(self, group: SequenceGroup) -> list[dict[int, Logprob] | None] | None:
        """vLLM's ``RequestOutput.prompt_logprobs`` once the whole prompt is computed."""
        done = self._prompt_logprobs.get(group.request_id)
        if done is None and group.prompt_logprobs_done:
            done = [None if d is None else {t: Logprob(lp, rank, self.tokenizer.decode([t], False))
                                            for t, (lp, rank) in d.items()} for d in group.prompt_logprobs or [None]]
            self._prompt_logprobs[group.request_id] = done
        return done
