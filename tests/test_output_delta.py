"""The engine core's output deltas: whatever the core's ``RequestOutput``s were, the client rebuilds
each one exactly (through pickle, as over the wire), and deltas go only where outputs only grew."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.engine.output_delta import OutputDelta, OutputDeltaDecoder, OutputDeltaEncoder
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _out(rid: str, tokens: list[int], text: str, *, finished: bool = False, n: int = 1, logprobs: bool = False,
         step: int = 0) -> RequestOutput:
    comps = [CompletionOutput(i, text, list(tokens), -0.5 * len(tokens),
                              [{t: Logprob(-1.0, 1, "x")} for t in tokens] if logprobs else None,
                              "length" if finished else None) for i in range(n)]
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=2.0, last_token_time=2.0 + step,
                             finished_time=9.0 if finished else None)
    return RequestOutput(rid, "the prompt", [1, 2, 3], comps, finished, metrics, num_cached_tokens=step % 3)


def _wire(item: RequestOutput | OutputDelta) -> RequestOutput | OutputDelta:
    return pickle.loads(pickle.dumps(item, protocol=5))


def test_a_plain_stream_goes_whole_then_as_deltas_then_whole() -> None:
    enc, dec = OutputDeltaEncoder(), OutputDeltaDecoder()
    outs = [_out("a", [5], "x", step=0), _out("a", [5, 6], "xy", step=1), _out("a", [5, 6, 7], "xyz", step=2),
            _out("a", [5, 6, 7, 8], "xyzw", finished=True, step=3)]
    kinds = []
    for o in outs:
        item = enc.encode(o)
        kinds.append(type(item).__name__)
        assert dec.decode(_wire(item)) == o
    assert kinds == ["RequestOutput", "OutputDelta", "OutputDelta", "RequestOutput"]
    assert len(enc) == 0 and len(dec) == 0  # the finished output forgets the request on both sides


def test_outputs_that_do_not_only_append_go_whole() -> None:
    enc = OutputDeltaEncoder()
    enc.encode(_out("a", [5], "x"))
    assert isinstance(enc.encode(_out("a", [5, 6], "xq")), OutputDelta)
    assert isinstance(enc.encode(_out("a", [9, 6, 7], "xqz")), RequestOutput)  # a token changed
    assert isinstance(enc.encode(_out("a", [9, 6, 7, 8], "Xqzw")), RequestOutput)  # the text changed
    for kw in ({"n": 2}, {"logprobs": True}):
        enc.encode(_out("b", [5], "x", **kw))
        assert isinstance(enc.encode(_out("b", [5, 6], "xy", **kw)), RequestOutput), kw
        enc.forget("b")
    assert len(enc) == 1


def test_a_delta_for_a_request_the_client_forgot_is_dropped() -> None:
    enc, dec = OutputDeltaEncoder(), OutputDeltaDecoder()
    dec.decode(enc.encode(_out("a", [5], "x")))
    dec.forget("a")
    assert dec.decode(enc.encode(_out("a", [5, 6], "xy"))) is None
    assert len(dec) == 0


@st.composite
def _streams(draw: st.DrawFn) -> list[RequestOutput]:
    """Interleaved outputs of a few requests: mostly appends, sometimes a rewrite, a second
    completion or logprobs, each request's last one finished."""
    outs: list[RequestOutput] = []
    for r in range(draw(st.integers(1, 4))):
        tokens: list[int] = []
        text = ""
        steps = draw(st.integers(1, 8))
        for step in range(steps):
            change = draw(st.sampled_from(["append", "append", "append", "rewrite", "n2", "logprobs"]))
            if change == "rewrite" and tokens:
                tokens[0] += 1
                text = "!" + text[1:]
            new = draw(st.lists(st.integers(0, 50), min_size=0, max_size=3))
            tokens = tokens + new
            text = text + "".join(chr(97 + t % 26) for t in new)
            outs.append(_out(f"r{r}", tokens, text, finished=step == steps - 1, n=2 if change == "n2" else 1,
                             logprobs=change == "logprobs", step=step))
    order = draw(st.permutations(range(len(outs))))
    # Interleave requests but keep each request's outputs in order (as the core sends them).
    by_req: dict[str, list[RequestOutput]] = {}
    for o in outs:
        by_req.setdefault(o.request_id, []).append(o)
    merged, cursor = [], {k: 0 for k in by_req}
    for i in order:
        rid = outs[i].request_id
        merged.append(by_req[rid][cursor[rid]])
        cursor[rid] += 1
    return merged


@settings(max_examples=200, deadline=None)
@given(_streams())
def test_every_output_is_rebuilt_exactly(outs: list[RequestOutput]) -> None:
    enc, dec = OutputDeltaEncoder(), OutputDeltaDecoder()
    for o in outs:
        assert dec.decode(_wire(enc.encode(o))) == o
    assert len(enc) == 0 and len(dec) == 0
