"""What crosses the engine core's process boundary each step: a request's first and last outputs
whole, and in between only what the step added.

``RequestOutput`` is cumulative (all token ids and all text so far, the prompt and its ids), so a
streaming request's output grows every step and pickling 64 of them took ~0.6 ms of the core's
single thread per decode step, and unpickling ~0.8 ms of the front end's. Between its first and its
last output a plain request only appends, so the core sends an ``OutputDelta`` (new token ids, new
text, the metrics) and the client rebuilds the cumulative ``RequestOutput`` from the last one it
holds. Everything that does not only append goes whole: more than one completion (``n``, beams),
logprobs (prompt logprobs too), an error, and the finished output (stop strings may cut its text).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class OutputDelta:
    """The step's addition to the single completion of request ``request_id``."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    cumulative_logprob: float | None
    metrics: RequestMetrics | None
    num_cached_tokens: int


def _plain(out: RequestOutput) -> CompletionOutput | None:
    """The single completion of an output that may go as a delta, or ``None``."""
    if out.finished or out.error is not None or len(out.outputs) != 1 or out.prompt_logprobs is not None:
        return None
    c = out.outputs[0]
    return c if c.logprobs is None and c.index == 0 and c.finish_reason is None and c.stop_reason is None else None


class OutputDeltaEncoder:
    """The core's side: the last completion sent per request, to send only what follows it."""

    __slots__ = ("_sent",)

    def __init__(self) -> None:
        self._sent: dict[str, CompletionOutput] = {}

    def encode(self, out: RequestOutput) -> RequestOutput | OutputDelta:
        c = _plain(out)
        prev = self._sent.pop(out.request_id, None)
        if c is None:
            return out
        self._sent[out.request_id] = c
        n = len(prev.token_ids) if prev is not None else 0
        # Append-only is checked, not assumed: a prefix that changed goes whole.
        if prev is None or c.token_ids[:n] != prev.token_ids or not c.text.startswith(prev.text):
            return out
        return OutputDelta(out.request_id, c.token_ids[n:], c.text[len(prev.text):], c.cumulative_logprob,
                           out.metrics, out.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        """An aborted request (a finished one is forgotten by ``encode``)."""
        self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)


class OutputDeltaDecoder:
    """The client's side: the last cumulative output per request, to apply deltas to."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, item: RequestOutput | OutputDelta) -> RequestOutput | None:
        """The cumulative output; ``None`` for a delta of a request this side no longer follows."""
        if isinstance(item, RequestOutput):
            if item.finished:
                self._last.pop(item.request_id, None)
            else:
                self._last[item.request_id] = item
            return item
        prev = self._last.get(item.request_id)
        if prev is None:
            return None
        c = prev.outputs[0]
        out = RequestOutput(prev.request_id, prev.prompt, prev.prompt_token_ids,
                            [CompletionOutput(0, c.text + item.new_text, c.token_ids + item.new_token_ids,
                                              item.cumulative_logprob, None)],
                            False, item.metrics, item.num_cached_tokens)
        self._last[item.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        """A stream that ended early (aborted, disconnected)."""
        self._last.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._last)
