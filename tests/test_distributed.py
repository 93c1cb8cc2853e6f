"""Executors past one process: tensor parallelism (mp and Ray), data-parallel replicas, failures.

Tolerance: greedy token ids must be equal. Logprobs may differ in the last bits: a row-parallel
layer sums the ranks' partial products (all-reduce) in a different order than one GEMM sums them,
so the cumulative logprobs are compared with a tolerance of 1e-3.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagellm import LLM, LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.protocol import EngineDeadError
from pagellm.executor import WorkerError

from conftest import build_tiny_checkpoint, run_to_completion
from test_hf_parity import random_prompts

NEW_TOKENS = 24


def greedy(path: str, prompts: list[list[int]], **kwargs) -> list[tuple[list[int], float]]:
    """Token ids and cumulative logprob per prompt; invariants checked every step; workers stopped."""
    kwargs.setdefault("kv_cache_memory", "64MiB")
    # float32: the exact numerics these comparisons need (``auto`` may choose bfloat16 GEMMs per
    # machine and per thread count, and bfloat16 rounding magnifies a split reduction's order).
    kwargs.setdefault("dtype", "float32")
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, **kwargs))
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        done = run_to_completion(engine)
    finally:
        engine.shutdown()
    return [(done[str(i)].outputs[0].token_ids, done[str(i)].outputs[0].cumulative_logprob)
            for i in range(len(prompts))]


def assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-3)


# Uneven shards: 3 KV heads (6 query heads) and 99 intermediate features over 2 ranks.
CHECKPOINTS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "llama-tied": dict(arch="llama", tie=True),
    "llama-uneven": dict(arch="llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                         intermediate_size=99),
    # The other families: windows and soft-caps per rank's heads, Phi-3's fused projections split per
    # part, every expert's intermediate features split between the ranks (experts are not replicated).
    "gemma2": dict(arch="gemma2"),
    "phi3": dict(arch="phi3"),
    "mixtral": dict(arch="mixtral"),
    "qwen2_moe": dict(arch="qwen2_moe"),
}


def checkpoint(root: str, name: str) -> str:
    spec = dict(CHECKPOINTS[name])
    arch = spec.pop("arch")
    if name == "llama-uneven":
        root = os.path.join(root, "uneven")
    return build_tiny_checkpoint(root, arch, **spec)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_mp_matches_tp1(ckpt_root, name):
    path = checkpoint(ckpt_root, name)
    prompts = random_prompts(6, seed=11, hi=90)
    want = greedy(path, prompts)
    assert_same(greedy(path, prompts, tensor_parallel_size=2, distributed_executor_backend="mp"), want)


def test_tp2_under_chunking_and_swap_preemption_matches_tp1(ckpt_root):
    """Chunks of 16 tokens and a pool so small that sequences are swapped out and back in: the
    ranks apply the same block copies to their shards of the cache."""
    path = checkpoint(ckpt_root, "qwen2")
    prompts = random_prompts(8, seed=5, hi=60)
    want = greedy(path, prompts)
    got = greedy(path, prompts, tensor_parallel_size=2, max_num_batched_tokens=16, long_prefill_token_threshold=16,
                 num_gpu_blocks_override=24, block_size=8, preemption_mode="swap", num_cpu_blocks_override=64)
    assert_same(got, want)


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-tied"])
def test_pp2_mp_matches_one_worker(ckpt_root, name):
    """Two pipeline stages (a layer each), hidden states passed between processes."""
    path = checkpoint(ckpt_root, name)
    prompts = random_prompts(6, seed=11, hi=90)
    assert_same(greedy(path, prompts, pipeline_parallel_size=2), greedy(path, prompts))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pp2_under_chunking_and_preemption_matches_one_worker(ckpt_root, mode):
    path = checkpoint(ckpt_root, "qwen2")
    prompts = random_prompts(8, seed=5, hi=60)
    tight = dict(max_num_batched_tokens=16, long_prefill_token_threshold=16, num_gpu_blocks_override=24,
                 block_size=8, preemption_mode=mode, num_cpu_blocks_override=64)
    assert_same(greedy(path, prompts, pipeline_parallel_size=2, **tight), greedy(path, prompts, **tight))


def test_pp2_tp2_matches_one_worker(ckpt_root):
    """Four ranks: two stages, each split over two tensor-parallel ranks (uneven shards)."""
    path = checkpoint(ckpt_root, "llama-uneven")
    prompts = random_prompts(4, seed=2, hi=60)
    assert_same(greedy(path, prompts, pipeline_parallel_size=2, tensor_parallel_size=2), greedy(path, prompts))


def test_pp_errors_name_the_field(ckpt_root):
    path = checkpoint(ckpt_root, "llama")
    before = _children()
    with pytest.raises(WorkerError, match="exceeds the model's 2 layers"):
        LLM(path, pipeline_parallel_size=3)
    assert _wait_gone(list(_children() - before)) == []
    with pytest.raises(ValueError, match="enable_lora"):
        EngineArgs(pipeline_parallel_size=2, enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


@pytest.mark.slow
def test_pp2_matches_one_worker_on_smollm2(smollm2_path):
    prompts = random_prompts(4, seed=3, hi=120)
    assert_same(greedy(smollm2_path, prompts, pipeline_parallel_size=2), greedy(smollm2_path, prompts))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pp2_tp2_on_smollm2_under_chunking_and_preemption_matches_one_worker(smollm2_path, mode):
    """The real model in four ranks (two stages of two tensor-parallel shards) under chunks of 32
    tokens and a cache too small for every sequence at once."""
    prompts = random_prompts(5, seed=8, hi=90)
    tight = dict(max_num_batched_tokens=32, long_prefill_token_threshold=32, num_gpu_blocks_override=20,
                 block_size=16, preemption_mode=mode, num_cpu_blocks_override=64)
    assert_same(greedy(smollm2_path, prompts, pipeline_parallel_size=2, tensor_parallel_size=2, **tight),
                greedy(smollm2_path, prompts, **tight))


@pytest.mark.slow
def test_tp2_mp_matches_tp1_on_smollm2(smollm2_path):
    prompts = random_prompts(4, seed=3, hi=120)
    assert_same(greedy(smollm2_path, prompts, tensor_parallel_size=2), greedy(smollm2_path, prompts))


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_dp2_matches_dp1(tiny_llama, backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    prompts = random_prompts(10, seed=8, hi=80)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(tiny_llama, kv_cache_memory="64MiB", dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    with LLM(tiny_llama, kv_cache_memory="64MiB", data_parallel_size=2, distributed_executor_backend=backend,
             dtype="float32") as llm:
        engine = llm.llm_engine
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
        assert got == want
        assert all(r.stats["steps"] > 0 for r in engine.replicas), "one replica got no request"
        assert engine.outstanding == [0, 0]
        for r in engine.replicas:
            assert r.kv_cache_manager.num_free_blocks == r.kv_cache_manager.num_blocks


def test_dp_routes_a_cached_prefix_to_the_replica_that_holds_it(tiny_llama):
    """Both replicas idle: the tie-break would pick replica 0, the prefix cache picks replica 1."""
    def run(engine, rid: str, ids: list[int]):
        engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2))
        replica = engine._replica_of[rid]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return replica, done[rid]

    prefix = list(range(100, 164))  # 4 blocks of 16 tokens
    with LLM(tiny_llama, kv_cache_memory="64MiB", data_parallel_size=2) as llm:
        engine = llm.llm_engine
        engine.add_request("x", {"prompt_token_ids": [7] * 40}, SamplingParams(max_tokens=2))  # replica 0 busy
        replica, _ = run(engine, "p", prefix + [1, 2, 3])
        assert replica == 1
        replica, out = run(engine, "q", prefix + [4, 5, 6])
        assert engine.outstanding == [0, 0]
        assert replica == 1 and out.num_cached_tokens == len(prefix)


# ---------------------------------------------------------------------- failures
def _children() -> set[int]:
    """Pids whose parent is this process (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (only its exit status is left)
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pids: list[int], seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def kill_mid_generation(llm: LLM, pid: int) -> BaseException | None:
    """Generate long outputs, SIGKILL ``pid`` after a few steps; return what ``generate`` raised.

    The thread join is a hang guard (the engine must fail, not wait forever), not a speed check."""
    engine = llm.llm_engine
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            llm.generate([[5, 6, 7, i] for i in range(8)], SamplingParams(max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=run)
    t.start()
    while engine.stats["steps"] < 3 and t.is_alive():
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "generate still blocked 120 s after a worker was killed"
    return result[0]


def assert_failed_cleanly(engine: LLMEngine, error: BaseException | None, pids: list[int]) -> None:
    assert isinstance(error, EngineDeadError), error
    assert "died" in str(error)
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", [1, 2, 3])
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.shutdown()
    assert _wait_gone(pids) == []


def test_killed_mp_worker_fails_requests_and_leaves_no_process(tiny_llama):
    before = _children()
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="mp", kv_cache_memory="64MiB")
    engine = llm.llm_engine
    pids = engine.executor.worker_pids()
    assert set(pids) <= _children()
    error = kill_mid_generation(llm, pids[1])
    assert_failed_cleanly(engine, error, pids)
    assert _children() - before == set()


def test_worker_exception_is_reported_and_kills_engine(tiny_llama):
    with LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="mp", kv_cache_memory="64MiB") as llm:
        engine = llm.llm_engine
        with pytest.raises(WorkerError, match="AttributeError"):
            engine.executor.collective_rpc("no_such_method")
        with pytest.raises(EngineDeadError, match="no_such_method"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            llm.generate("hello", use_tqdm=False)
        pids = engine.executor.worker_pids()
    assert _wait_gone(pids) == []


def test_start_up_error_names_the_problem_and_leaves_no_process(tiny_llama):
    before = _children()
    with pytest.raises(WorkerError, match="exceeds the model's 2 KV heads"):
        LLM(tiny_llama, tensor_parallel_size=3, distributed_executor_backend="mp")
    assert _wait_gone(list(_children() - before)) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'mp' or 'ray'"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=-1), "data_parallel_size"),
])
def test_bad_parallel_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).create_engine_config()


def test_default_backend_is_mp_past_one_worker():
    assert EngineArgs().create_engine_config().parallel.distributed_executor_backend == "uni"
    assert EngineArgs(tensor_parallel_size=2).create_engine_config().parallel.distributed_executor_backend == "mp"
    assert EngineArgs(data_parallel_size=2).create_engine_config().parallel.distributed_executor_backend == "mp"


def test_missing_ray_gives_install_hint(monkeypatch):
    import sys

    from pagellm.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pagellm\[ray\]"):
        import_ray()


# ---------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tp2_ray_matches_tp1(ray_cluster, ckpt_root, name):
    path = checkpoint(ckpt_root, name)
    prompts = random_prompts(6, seed=12, hi=90)
    assert_same(greedy(path, prompts, tensor_parallel_size=2, distributed_executor_backend="ray"),
                greedy(path, prompts))


def test_pp2_ray_matches_one_worker(ray_cluster, ckpt_root):
    path = checkpoint(ckpt_root, "qwen3")
    prompts = random_prompts(6, seed=13, hi=90)
    assert_same(greedy(path, prompts, pipeline_parallel_size=2, distributed_executor_backend="ray"),
                greedy(path, prompts))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pp2_ray_under_chunking_and_preemption_matches_one_worker(ray_cluster, ckpt_root, mode):
    path = checkpoint(ckpt_root, "qwen2")
    prompts = random_prompts(8, seed=5, hi=60)
    tight = dict(max_num_batched_tokens=16, long_prefill_token_threshold=16, num_gpu_blocks_override=24,
                 block_size=8, preemption_mode=mode, num_cpu_blocks_override=64)
    assert_same(greedy(path, prompts, pipeline_parallel_size=2, distributed_executor_backend="ray", **tight),
                greedy(path, prompts, **tight))


@pytest.mark.slow
def test_pp2_ray_matches_one_worker_on_smollm2(ray_cluster, smollm2_path):
    prompts = random_prompts(4, seed=3, hi=120)
    assert_same(greedy(smollm2_path, prompts, pipeline_parallel_size=2, distributed_executor_backend="ray"),
                greedy(smollm2_path, prompts))


def test_worker_killed_mid_pipeline_fails_every_request_and_leaves_no_process(ckpt_root):
    """The last stage's process is killed while steps run: every request ends with an error (the
    engine dies with a message naming the rank), and no worker process is left."""
    path = checkpoint(ckpt_root, "llama")
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, pipeline_parallel_size=2, dtype="float32",
                                                   kv_cache_memory="64MiB"))
    pids = engine.executor.worker_pids()
    for i, p in enumerate(random_prompts(4, seed=1, hi=60)):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="rank 1"):
        for _ in range(1000):
            engine.step()
    assert not engine.has_unfinished_requests()
    engine.shutdown()
    assert _wait_gone(pids) == []


@pytest.mark.slow
def test_tp2_ray_matches_tp1_on_smollm2(ray_cluster, smollm2_path):
    prompts = random_prompts(4, seed=4, hi=120)
    assert_same(greedy(smollm2_path, prompts, tensor_parallel_size=2, distributed_executor_backend="ray"),
                greedy(smollm2_path, prompts))


def test_killed_ray_worker_fails_requests_and_leaves_no_actor(ray_cluster, tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="64MiB")
    engine = llm.llm_engine
    pids = engine.executor.worker_pids()
    error = kill_mid_generation(llm, pids[1])
    assert_failed_cleanly(engine, error, pids)
    # The placement group was freed: a new engine gets both CPUs again.
    with LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="64MiB") as again:
        assert again.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_cli_generate_with_two_replicas_in_a_fresh_process(tiny_llama):
    """A new process (nothing imported yet) starting replicas in parallel: this once failed in
    transformers' lazy imports, which are not thread-safe."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "generate", "--model", tiny_llama,
                          "--data-parallel-size", "2", "--max-tokens", "4", "--temperature", "0", "Hello", "Bye"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
