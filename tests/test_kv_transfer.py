"""KV transfer with the disk connector: a prefix cache that survives the engine. Greedy tokens
after a restart equal a run without it (loaded blocks are used: counted, and prompts shorter
than their prefix's saved blocks are not recomputed); damaged, foreign and missing files are
ignored and recomputed, or end the request with an error under the ``fail`` policy; a size cap
of 0 saves nothing; invariants hold after every step and every block is free at the end."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import time

import pytest
import torch

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs, KVTransferConfig

from conftest import assert_cache_pressure, build_tiny_checkpoint, run_to_completion

NEW = 8
BS = 16


def prompts(seed: int = 0) -> list[list[int]]:
    """Requests sharing long prefixes (some longer than a step's budget below), and strangers."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(300)]
    out = [shared + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    out += [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 90))] for _ in range(3)]
    out.append(shared[:200])  # a prefix of the others' prefix, ending mid-block
    return out


def engine(model: str, store: str | None, policy: str = "recompute", max_size_gib: float = 1.0, **kw) -> LLMEngine:
    kvt = None if store is None else {"kv_connector": "DiskConnector", "kv_load_failure_policy": policy,
                                      "kv_connector_extra_config": {"path": store, "max_size_gib": max_size_gib}}
    args = dict(model=model, dtype="float32", block_size=BS, max_num_batched_tokens=128,
                long_prefill_token_threshold=64, kv_transfer_config=kvt)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def greedy(eng: LLMEngine, ps: list[list[int]]) -> dict[str, list[int] | str | None]:
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                         ignore_eos=True))
    done = run_to_completion(eng)
    return {rid: (out.error if out.error else out.outputs[0].token_ids) for rid, out in done.items()}


def close(eng: LLMEngine) -> None:
    eng.executor.collective_rpc("kv_wait_for_save")
    eng.shutdown()


@pytest.fixture(scope="module")
def model(ckpt_root) -> str:
    return build_tiny_checkpoint(ckpt_root, "llama")


@pytest.fixture(scope="module")
def reference(model) -> dict:
    eng = engine(model, None)
    try:
        return greedy(eng, prompts())
    finally:
        eng.shutdown()


def block_files(store: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f.endswith(".kvblock"))


VARIANTS = {
    "default": {},
    # A pool of 40 blocks for 8 requests of up to 340 tokens: preemption (recompute and swap) and
    # loads competing for blocks.
    "tight_cache": {"num_gpu_blocks_override": 40, "preemption_mode": "recompute"},
    "tight_cache_swap": {"num_gpu_blocks_override": 40, "preemption_mode": "swap"},
    "worker_process": {"distributed_executor_backend": "mp"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_restart_loads_the_saved_prefix_and_greedy_tokens_are_unchanged(model, reference, tmp_path, variant):
    store = str(tmp_path / "kv")
    mode = VARIANTS[variant].get("preemption_mode")
    first = engine(model, store, **VARIANTS[variant])
    assert greedy(first, prompts()) == reference
    assert first.scheduler.make_stats().kv_blocks_saved > 0
    assert_cache_pressure(first, mode)
    close(first)
    files = block_files(store)
    assert files, "nothing saved"
    second = engine(model, store, **VARIANTS[variant])  # a new engine: its device cache is empty
    assert greedy(second, prompts()) == reference
    stats = second.scheduler.make_stats()
    assert_cache_pressure(second, mode)
    assert stats.kv_blocks_loaded >= 300 // BS, "the shared prefix was recomputed, not loaded"
    assert stats.kv_load_failures == 0
    # Every loaded token counts as a prefix hit: the shared 18 blocks, for the first request at least.
    assert stats.prefix_cache_hits >= (300 // BS) * BS
    close(second)


def test_int8_cache_blocks_are_saved_and_loaded_whole(model, tmp_path):
    """An int8 cache's blocks carry each row's scale inside them (kv_cache_dtype="int8"): a restart
    loads them and gives the tokens the first engine gave."""
    store = str(tmp_path / "kv")
    first = engine(model, store, kv_cache_dtype="int8")
    assert first.executor.worker.cache_engine.kv.dtype == torch.int8
    want = greedy(first, prompts())
    close(first)
    second = engine(model, store, kv_cache_dtype="int8")
    assert greedy(second, prompts()) == want
    stats = second.scheduler.make_stats()
    assert stats.kv_blocks_loaded >= 300 // BS and stats.kv_load_failures == 0
    close(second)


def chain_files(store: str, tokens: list[int]) -> list[str]:
    """The block files of ``tokens``' full blocks, in prefix order (the block hash chain)."""
    from pagellm.core.block_pool import hash_block_tokens
    from pagellm.core.kv_connector import block_file_name

    (fingerprint_dir,) = os.listdir(store)
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS])
        out.append(os.path.join(store, fingerprint_dir, block_file_name(parent)))
    return out


@pytest.mark.parametrize("damage", ["truncated", "flipped_byte", "foreign", "deleted_after_start"])
def test_damaged_and_foreign_files_are_ignored_and_recomputed(model, reference, tmp_path, damage):
    store = str(tmp_path / "kv")
    ps = prompts()
    first = engine(model, store)
    greedy(first, ps[:1])
    close(first)
    files = chain_files(store, ps[0])
    assert all(os.path.exists(f) for f in files)
    bad = files[3]
    if damage == "truncated":
        with open(bad, "r+b") as f:
            f.truncate(os.path.getsize(bad) // 2)
    elif damage == "flipped_byte":  # one payload byte: only the checksum can tell
        with open(bad, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x01]))
    elif damage == "foreign":  # another block's (valid) file under this block's name
        shutil.copyfile(files[5], bad)
    damaged = pathlib.Path(bad).read_bytes() if damage != "deleted_after_start" else None
    second = engine(model, store)
    if damage == "deleted_after_start":  # listed when the engine started, gone when loaded
        os.unlink(bad)
    assert greedy(second, ps) == reference
    close(second)
    stats = second.scheduler.make_stats()
    # One request loads the shared prefix (its sharers wait for it, then hit it in the device cache):
    # its 3 blocks before the bad one arrive, the other 15 are recomputed.
    assert stats.kv_blocks_loaded == 3 and stats.kv_load_failures == len(files) - 3, stats
    # The damaged file was removed; the recomputed block was saved again, whole.
    assert os.path.exists(bad) and (damaged is None or pathlib.Path(bad).read_bytes() != damaged)


def test_fail_policy_ends_the_request_with_an_error_and_frees_its_blocks(model, tmp_path):
    store = str(tmp_path / "kv")
    ps = prompts()[:1]
    first = engine(model, store)
    want = greedy(first, ps)
    close(first)
    with open(chain_files(store, ps[0])[3], "r+b") as f:
        f.truncate(10)
    second = engine(model, store, policy="fail")
    got = greedy(second, ps)  # (run_to_completion checks every block is free)
    assert isinstance(got["r0"], str) and "KV connector" in got["r0"]
    close(second)
    third = engine(model, store, policy="fail")  # the bad file is gone now: a clean partial hit
    assert greedy(third, ps) == want
    close(third)


def test_size_cap_zero_saves_nothing_and_a_small_cap_evicts_least_recently_used(model, reference, tmp_path):
    store = str(tmp_path / "kv")
    eng = engine(model, store, max_size_gib=0)
    assert greedy(eng, prompts()) == reference
    close(eng)
    assert block_files(store) == []
    block_bytes = eng.model_info.block_bytes
    cap_blocks = 5
    eng = engine(model, store, max_size_gib=(cap_blocks * (block_bytes + 100)) / 2**30)
    assert greedy(eng, prompts()) == reference
    close(eng)
    assert 0 < len(block_files(store)) <= cap_blocks


def test_another_engine_fingerprint_never_sees_the_blocks(model, reference, tmp_path, ckpt_root):
    store = str(tmp_path / "kv")
    eng = engine(model, store)
    greedy(eng, prompts())
    close(eng)
    other = engine(model, store, kv_cache_dtype="float16")  # other K/V values: another directory
    greedy(other, prompts())
    assert other.scheduler.make_stats().kv_blocks_loaded == 0
    close(other)
    assert len(os.listdir(store)) == 2


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="path"):
        KVTransferConfig(kv_connector_extra_config={})
    with pytest.raises(ValueError, match="kv_connector"):
        KVTransferConfig(kv_connector="Nope", kv_connector_extra_config={"path": "/tmp/x"})
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="both", kv_connector_extra_config={"path": "/tmp/x"})
    with pytest.raises(ValueError, match="max_size_gib"):
        KVTransferConfig(kv_connector_extra_config={"path": "/tmp/x", "max_size_gib": -1})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(enable_prefix_caching=False,
                   kv_transfer_config='{"kv_connector_extra_config": {"path": "/tmp/x"}}').create_engine_config()


# ---- TcpConnector: disaggregated prefill/decode between two engines (loopback) -----------------

def tcp_engine(model: str, role: str, timeout_s: float = 30, **kw) -> LLMEngine:
    extra: dict = {"timeout_s": timeout_s}
    if role != "kv_producer":
        extra["port"] = 0  # any free port (engine.kv_receiver.port)
    args = dict(model=model, dtype="float32", block_size=BS, max_num_batched_tokens=128,
                long_prefill_token_threshold=64,
                kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": role,
                                    "kv_connector_extra_config": extra})
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def split(prefill: LLMEngine | None, decode: LLMEngine, ps: list[list[int]], port: int,
          tag: str = "t") -> tuple[dict, dict]:
    """Each prompt on both sides as the proxy sends it: the decode request first (it waits for its
    transfer), the prefill request (one token, its blocks pushed to ``port``). Steps both engines
    in turns, checking invariants; returns both sides' greedy tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(ps):
        decode.add_request(f"d{i}", {"prompt_token_ids": p,
                                     "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": f"{tag}{i}"}}, sp)
        if prefill is not None:
            prefill.add_request(f"d{i}", {"prompt_token_ids": p, "kv_transfer_params": {
                "do_remote_decode": True, "transfer_id": f"{tag}{i}", "remote_host": "127.0.0.1", "remote_port": port}},
                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outs: tuple[dict, dict] = ({}, {})
    for _ in range(20_000):
        busy = False
        for side, eng in enumerate((prefill, decode)):
            if eng is None or not eng.has_unfinished_requests():
                continue
            busy = True
            for out in eng.step():
                if out.finished:
                    outs[side][out.request_id] = out.error or out.outputs[0].token_ids
            eng.scheduler.check_invariants()
        if not busy:
            break
    for eng in (prefill, decode):
        if eng is not None:
            assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    return outs


def test_prefill_decode_split_equals_one_engine(model, reference, tmp_path):
    decode = tcp_engine(model, "kv_consumer")
    prefill = tcp_engine(model, "kv_producer")
    try:
        first, got = split(prefill, decode, prompts(), decode.kv_receiver.port)
        assert {k.replace("d", "r"): v for k, v in got.items()} == reference
        assert {k.replace("d", "r"): v for k, v in first.items()} == {k: v[:1] for k, v in reference.items()}
        stats = decode.scheduler.make_stats()
        # Every prompt's full blocks came over (the shared prefix's once per request that loaded it).
        assert stats.kv_blocks_loaded >= 300 // BS and stats.kv_load_failures == 0
        assert prefill.scheduler.make_stats().kv_blocks_saved > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_side_that_never_sends_costs_a_timeout_then_recompute(model, reference):
    decode = tcp_engine(model, "kv_consumer", timeout_s=0.3)
    try:
        _, got = split(None, decode, prompts(), decode.kv_receiver.port)
        assert {k.replace("d", "r"): v for k, v in got.items()} == reference
        assert decode.scheduler.connector.num_timeouts == len(prompts())
    finally:
        decode.shutdown()


def test_a_decode_side_that_is_gone_leaves_the_prefill_side_clean(model, reference):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefill = tcp_engine(model, "kv_producer", timeout_s=0.5)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i, p in enumerate(prompts()):
            prefill.add_request(f"p{i}", {"prompt_token_ids": p, "kv_transfer_params": {
                "do_remote_decode": True, "transfer_id": f"x{i}", "remote_host": "127.0.0.1", "remote_port": port}}, sp)
        done = run_to_completion(prefill)  # (every block free at the end)
        assert {k.replace("p", "r"): v.outputs[0].token_ids for k, v in done.items()} == \
            {k: v[:1] for k, v in reference.items()}
    finally:
        prefill.shutdown()  # returns: unsent blocks are dropped after the timeout


def test_blocks_from_another_numerics_are_refused_and_recomputed(model, reference):
    decode = tcp_engine(model, "kv_consumer")
    prefill = tcp_engine(model, "kv_producer", kv_cache_dtype="float16")  # other K/V: another fingerprint
    try:
        _, got = split(prefill, decode, prompts(), decode.kv_receiver.port)
        assert {k.replace("d", "r"): v for k, v in got.items()} == reference
        stats = decode.scheduler.make_stats()
        assert stats.kv_blocks_loaded == 0 and stats.kv_load_failures > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_kv_transfer_params_errors_name_the_field(model):
    eng = engine(model, None)
    try:
        with pytest.raises(ValueError, match="TcpConnector"):
            eng.add_request("a", {"prompt_token_ids": [5, 6], "kv_transfer_params": {"do_remote_prefill": True}})
    finally:
        eng.shutdown()
    decode = tcp_engine(model, "kv_consumer")
    try:
        with pytest.raises(ValueError, match="transfer_id"):
            decode.add_request("a", {"prompt_token_ids": [5, 6], "kv_transfer_params": {"do_remote_prefill": True}})
        with pytest.raises(ValueError, match="unknown"):
            decode.add_request("b", {"prompt_token_ids": [5, 6], "kv_transfer_params": {"bogus": 1}})
        assert not decode.has_unfinished_requests()
    finally:
        decode.shutdown()


def test_proxy_serves_the_split_to_the_openai_client(model):
    """``pagellm proxy`` over a prefill server and a decode server (HTTP on loopback, real
    engines on threads): the ``openai`` client's greedy completions, streamed and not, equal one
    engine's; the decode side loaded the prompts' blocks."""
    import socket
    import threading
    import time

    import openai
    import uvicorn

    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.disagg_proxy import build_proxy_app
    from pagellm.entrypoints.openai_server import build_app

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def serve(app) -> tuple[uvicorn.Server, str]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return server, f"http://127.0.0.1:{port}"

    kv_port = free_port()
    common = dict(model=model, dtype="float32", block_size=BS, max_num_batched_tokens=128,
                  long_prefill_token_threshold=64)
    decode = AsyncLLM.from_engine_args(EngineArgs(**common, kv_transfer_config={
        "kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"port": kv_port}}))
    prefill = AsyncLLM.from_engine_args(EngineArgs(**common, kv_transfer_config={
        "kv_connector": "TcpConnector", "kv_role": "kv_producer"}))
    servers = []
    try:
        (s1, decode_url), (s2, prefill_url) = serve(build_app(decode, "tiny", None)), serve(build_app(prefill, "tiny",
                                                                                                       None))
        servers += [s1, s2]
        s3, proxy_url = serve(build_proxy_app(prefill_url, decode_url, "127.0.0.1", kv_port))
        servers.append(s3)
        client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none", max_retries=0, timeout=60)
        ps = prompts()[:3]
        offline = engine(model, None)
        want = []
        for i, p in enumerate(ps):
            offline.add_request(f"o{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                                 ignore_eos=True))
        done = run_to_completion(offline)
        want = [done[f"o{i}"].outputs[0].text for i in range(len(ps))]
        offline.shutdown()
        extra = {"ignore_eos": True}
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0, extra_body=extra)
               .choices[0].text for p in ps[:2]]
        stream = client.completions.create(model="tiny", prompt=ps[2], max_tokens=NEW, temperature=0, stream=True,
                                           extra_body=extra)
        got.append("".join(c.choices[0].text for c in stream if c.choices))
        assert got == want
        assert decode.get_stats_now()["kv_blocks_loaded"] >= 300 // BS
        assert httpx_get(proxy_url + "/health") == 200
    finally:
        for s in servers:
            s.should_exit = True
        decode.shutdown()
        prefill.shutdown()


def httpx_get(url: str) -> int:
    import httpx

    return httpx.get(url, timeout=10).status_code


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_restart_and_split(ckpt_root, tmp_path, arch):
    path = build_tiny_checkpoint(ckpt_root, arch)
    ps = prompts(seed=1)
    ref_engine = engine(path, None)
    want = greedy(ref_engine, ps)
    ref_engine.shutdown()
    store = str(tmp_path / "kv")
    for _ in range(2):  # the second engine loads what the first saved
        eng = engine(path, store)
        assert greedy(eng, ps) == want
        loaded = eng.scheduler.make_stats().kv_blocks_loaded
        close(eng)
    assert loaded > 0
    decode, prefill = tcp_engine(path, "kv_consumer"), tcp_engine(path, "kv_producer")
    try:
        _, got = split(prefill, decode, ps, decode.kv_receiver.port)
        assert {k.replace("d", "r"): v for k, v in got.items()} == want
        assert decode.scheduler.make_stats().kv_blocks_loaded > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_smollm2_restart_and_split_equal_one_engine(smollm2_path, tmp_path):
    """The bundled model in its default numerics (chosen per machine), prompts longer than one
    step's budget: after a restart with the disk cache, and through the prefill/decode split."""
    ps = prompts(seed=2)
    common = dict(dtype="auto", max_num_batched_tokens=128)
    ref_engine = engine(smollm2_path, None, **common)
    want = greedy(ref_engine, ps)
    ref_engine.shutdown()
    store = str(tmp_path / "kv")
    for _ in range(2):
        eng = engine(smollm2_path, store, **common)
        assert greedy(eng, ps) == want
        loaded = eng.scheduler.make_stats().kv_blocks_loaded
        close(eng)
    assert loaded >= 300 // BS
    decode, prefill = tcp_engine(smollm2_path, "kv_consumer", **common), tcp_engine(smollm2_path, "kv_producer",
                                                                                     **common)
    try:
        _, got = split(prefill, decode, ps, decode.kv_receiver.port)
        assert {k.replace("d", "r"): v for k, v in got.items()} == want
        assert decode.scheduler.make_stats().kv_blocks_loaded >= 300 // BS
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_side_dying_mid_transfer(model, reference, policy):
    """The prefill engine's sender gets 5 blocks of each prompt out, then no more and never the
    "done": the decode side waits its timeout, then uses the blocks that came and recomputes the
    rest (or, under ``fail``, ends each request with an error); every block free on both sides."""
    kvt = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"port": 0, "timeout_s": 1.0}}
    decode = LLMEngine.from_engine_args(EngineArgs(model=model, dtype="float32", block_size=BS,
                                                   max_num_batched_tokens=128, long_prefill_token_threshold=64,
                                                   kv_transfer_config=kvt))
    prefill = tcp_engine(model, "kv_producer")
    sender = prefill.executor.worker.kv_connector
    real_put = sender._queue.put
    sent: list[bytes] = []

    def dying_put(item, *a, **kw):  # what a sender killed part-way would have got out
        if item is not None:
            address, msgs = item
            item = (address, [m for m in msgs if m[0] == b"block"][:5])
            sent.extend(bytes(m[2]) for m in item[1])
        return real_put(item, *a, **kw)

    sender._queue.put = dying_put
    # The decode side's timeout runs out once the prefill side is done and every block it sent has
    # arrived, not after 1 s of wall time: on a loaded machine the prefill alone can take longer.
    received = decode.scheduler.connector.received

    def clock() -> float:
        done = not prefill.has_unfinished_requests()
        arrived = done and bool(sent) and all(h in received for h in sent)
        if done and not arrived:
            time.sleep(0.001)  # the receiver's thread is still taking them in
        return time.monotonic() + (2.0 if arrived else -1e9)

    decode.scheduler.connector.clock = clock
    try:
        ps = prompts()[:4]
        _, got = split(prefill, decode, ps, decode.kv_receiver.port)
        stats = decode.scheduler.make_stats()
        assert decode.scheduler.connector.num_timeouts == len(ps)
        if policy == "recompute":
            assert {k.replace("d", "r"): v for k, v in got.items()} == {f"r{i}": reference[f"r{i}"] for i in range(4)}
            assert stats.kv_blocks_loaded >= 5  # what came was used
        else:
            assert all(isinstance(v, str) and "KV connector" in v for v in got.values())
    finally:
        prefill.shutdown()
        decode.shutdown()
