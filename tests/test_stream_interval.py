"""Streaming with a stream interval (vLLM's ``stream_interval``): a request's output goes out with
every token until its first text, then every N tokens, and at its end; what goes out is what the
every-token stream had at that point, and the final outputs are the same."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from test_server import NAME, _Server

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.core_client import AsyncEngineClient
from pagellm.engine.output_processor import OutputProcessor
from pagellm.outputs import RequestOutput

from conftest import run_to_completion

MAX_TOKENS = 11
REQUESTS = {
    "greedy": ({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True)),
    # several completions: the interval counts the longest one's tokens
    "n2": ({"prompt_token_ids": [9, 10, 11]}, SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=MAX_TOKENS,
                                                              ignore_eos=True)),
    # logprobs held back with their tokens come out in the next output
    "logprobs": ({"prompt_token_ids": [12, 13]}, SamplingParams(temperature=0, logprobs=2, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True)),
}


def _args(tiny_llama: str, interval: int | None) -> EngineArgs:
    return EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256, stream_interval=interval)


def _stream_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in REQUESTS.items():
        engine.add_request(rid, prompt, params)
    streams: dict[str, list[RequestOutput]] = {rid: [] for rid in REQUESTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id].append(out)
    run_to_completion(engine)  # (idle: checks every block came back)
    return streams


def _count(out: RequestOutput) -> int:
    return max(len(c.token_ids) for c in out.outputs)


def _view(out: RequestOutput) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.logprobs, c.finish_reason, c.cumulative_logprob) for c in out.outputs]


@pytest.fixture(scope="module")
def every_token(tiny_llama) -> dict[str, list[RequestOutput]]:
    return _stream_all(LLMEngine.from_engine_args(_args(tiny_llama, 1)))


def test_interval_one_sends_every_token(every_token):
    for rid, outs in every_token.items():
        assert [_count(o) for o in outs] == list(range(1, MAX_TOKENS + 1)), rid


@pytest.mark.parametrize("interval", [2, 3, 5])
def test_outputs_every_interval_tokens_and_the_same_final(tiny_llama, every_token, interval):
    streams = _stream_all(LLMEngine.from_engine_args(_args(tiny_llama, interval)))
    for rid, outs in streams.items():
        # every token up to the first output with text (in any completion), then every interval
        first_text = next((_count(o) for o in every_token[rid] if any(c.text for c in o.outputs)), MAX_TOKENS)
        expected_counts = sorted({*range(1, first_text + 1), *range(first_text + interval, MAX_TOKENS, interval),
                                  MAX_TOKENS})
        assert [_count(o) for o in outs] == expected_counts, rid
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        # Each output is the every-token stream's output at the same count: nothing is lost or
        # changed by holding outputs back, only fewer of them go out.
        by_count = {_count(o): _view(o) for o in every_token[rid]}
        for o in outs:
            assert _view(o) == by_count[_count(o)], (rid, _count(o))


def test_tokens_without_text_go_out_every_step_until_the_first_text():
    """The rule alone (the tiny models' first tokens all decode to text): tokens that make no text
    yet (a split UTF-8 character) do not hold a stream's first chunk back ``interval`` steps."""
    seq = SimpleNamespace(seq_id=0, num_output_tokens=0)
    detok = SimpleNamespace(text="")
    group = SimpleNamespace(request_id="r", seqs=[seq], is_finished=lambda: False)
    processor = OutputProcessor(None, 3, None)  # type: ignore[arg-type]
    processor._detok[0] = detok  # type: ignore[assignment]
    sent = []
    for n in range(1, 12):
        seq.num_output_tokens = n
        detok.text = "x" * max(0, n - 3)  # the first text comes with the fourth token
        if processor._output_due(group):  # type: ignore[arg-type]
            sent.append(n)
    assert sent == [1, 2, 3, 4, 7, 10]


def test_stream_interval_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="stream_interval"):
        _args(tiny_llama, 0).create_engine_config()


def test_server_streams_chunks_every_interval(tiny_llama):
    """Over the engine-core process and the HTTP server (the delta encoding sees held-back
    outputs): the streamed text is the non-streamed text, in fewer chunks."""
    client = AsyncEngineClient.start(_args(tiny_llama, 4))
    srv = _Server(client, None)  # type: ignore[arg-type]
    try:
        body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        whole = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        pieces = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(pieces) == whole
        assert len(pieces) == 4  # tokens 1, 5, 9 and the end (10)
    finally:
        srv.stop()
        client.shutdown()


def test_default_interval_grows_with_load_and_a_lone_stream_gets_every_token(tiny_llama):
    """No ``stream_interval`` given: a lone request streams every token; 20 requests decoding in
    the same steps stream every second token (1 per 8 streams, rounded down), each output being
    what the every-token stream had at that count, the finals the same."""
    prompts = {f"r{i}": {"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(20)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def stream(interval: int | None, rids: list[str]) -> dict[str, list[RequestOutput]]:
        engine = LLMEngine.from_engine_args(_args(tiny_llama, interval))
        for rid in rids:
            engine.add_request(rid, prompts[rid], params)
        streams: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                streams[out.request_id].append(out)
        run_to_completion(engine)
        return streams

    lone = stream(None, ["r0"])["r0"]
    assert [_count(o) for o in lone] == list(range(1, MAX_TOKENS + 1))
    loaded, reference = stream(None, list(prompts)), stream(1, list(prompts))
    held_back = 0
    for rid, outs in loaded.items():
        counts = [_count(o) for o in outs]
        held_back += MAX_TOKENS - len(counts)
        assert counts[-1] == MAX_TOKENS and outs[-1].finished, rid
        by_count = {_count(o): _view(o) for o in reference[rid]}
        assert all(_view(o) == by_count[_count(o)] for o in outs), rid
    # The pressure happened: 20 streams in a step send every second token after the first text.
    assert held_back >= 20 * (MAX_TOKENS // 2 - 1), held_back
