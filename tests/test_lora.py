"""Multi-LoRA: a batch mixing the base model and several PEFT adapters gives, per request, Hugging
Face ``PeftModel``'s greedy tokens for that adapter alone (float32), also with one slot and under
preemption; adapters never share cached K/V with each other or with stale weights; bad adapters
are clear errors; the scheduler's ``max_loras`` rule."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from pagellm import LLM, LLMEngine, LoRARequest, SamplingParams
from pagellm.config import EngineArgs
from pagellm.core.lora_admission import LORA_MAX_SKIPS

from conftest import build_tiny_checkpoint, require_int8_kernel, run_to_completion
from conftest_core import fake_step, make_group, make_scheduler
from test_hf_parity import random_prompts

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out: str, seed: int, targets: list[str], r: int = 8, rslora: bool = False) -> str:
    """A PEFT adapter with random (non-zero) A and B, so it changes the outputs."""
    if not os.path.exists(out):
        torch.manual_seed(seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        cfg = peft.LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False, use_rslora=rslora)
        peft.get_peft_model(base, cfg).save_pretrained(out)
    return out


def hf_greedy(base_path: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter).eval() if adapter else base
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
            outs.append(g[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(ckpt_root, request):
    arch = request.param
    path = build_tiny_checkpoint(ckpt_root, arch)
    adapters = [make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"]),
                make_adapter(path, f"{path}-lora-all", 2, ALL, r=4, rslora=True),
                make_adapter(path, f"{path}-lora-mlp", 3, ["gate_proj", "down_proj"], r=16)]
    prompts = random_prompts(8, seed=11, hi=60)
    # Request i runs on adapter i % 4 (3: the base model).
    which = [adapters[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
    refs = {a: hf_greedy(path, a, prompts) for a in [*adapters, None]}
    want = [refs[w][i] for i, w in enumerate(which)]
    return path, prompts, which, want


def _run(path, prompts, which, **kw):
    kw.setdefault("kv_cache_memory", "64MiB")
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", enable_lora=True, **kw))
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ids = {a: i + 1 for i, a in enumerate(sorted({w for w in which if w}))}
    for i, (p, w) in enumerate(zip(prompts, which, strict=True)):
        lora = LoRARequest(os.path.basename(w), ids[w], w) if w else None
        engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=lora)
    done = run_to_completion(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine


@pytest.mark.parametrize("in_features,part_outs,rows,segments", [
    (576, [576, 192, 192], 64, [(0, 5, 0), (5, 21, 1), (30, 64, 3)]),  # fused qkv, decode runs, base rows between
    (1536, [576], 300, [(0, 300, 2)]),                                  # one prompt chunk
    (40, [24, 8], 9, [(1, 9, 0)]),                                      # widths off the vector path
])
def test_lora_updates_equal_the_per_adapter_formula(in_features, part_outs, rows, segments):
    """Both versions of a projection's update (the compiled grouped kernel where it builds, and the
    torch one) against ``x A_p^T B_p^T`` per part written out, with slots of two ranks."""
    from pagellm.lora.layers import LoRAContext, LoRASlots

    gen = torch.Generator().manual_seed(0)
    ctx = LoRAContext()
    slots = LoRASlots(ctx, 4, in_features, part_outs, 16, torch.device("cpu"))
    weights = {}
    for slot in range(4):
        r = 8 if slot == 1 else 16
        weights[slot] = {p: (torch.randn(r, in_features, generator=gen), torch.randn(o, r, generator=gen))
                         for p, o in enumerate(part_outs)}
        slots.load(slot, weights[slot])
    ctx.segments = segments
    ctx.segment_tensor = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    x = torch.randn(rows, in_features, generator=gen)
    y0 = torch.randn(rows, sum(part_outs), generator=gen)
    want = y0.clone()
    for start, end, slot in segments:
        want[start:end] += torch.cat([x[start:end] @ a.T @ b.T for a, b in weights[slot].values()], dim=1)
    for got in (slots.add(x, y0.clone()), slots.add_native(x, y0.clone())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("config", ["mixed", "one_slot", "tight_cache"])
def test_mixed_batches_match_peft(setup, config):
    path, prompts, which, want = setup
    kw = {"mixed": dict(max_loras=3), "one_slot": dict(max_loras=1),
          "tight_cache": dict(max_loras=2, num_gpu_blocks_override=14, max_num_batched_tokens=48)}[config]
    got, engine = _run(path, prompts, which, **kw)
    assert got == want
    assert len({tuple(w) for w in want}) > 4, "the adapters must change the outputs"
    if config == "tight_cache":
        assert engine.scheduler.num_preemptions > 0
    stats = engine.get_stats()
    assert stats["lora_registered"] == 3 and stats["lora_slot_loads"] >= 3 and stats["lora_active"] == 0
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_adapters_never_share_cached_blocks_and_reloads_get_no_stale_hits(ckpt_root, tmp_path):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    a = make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"])
    b = make_adapter(path, f"{path}-lora-all", 2, ALL, r=4, rslora=True)
    prompt = random_prompts(1, seed=5, lo=80, hi=80)[0]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", enable_lora=True, max_loras=2,
                                                   kv_cache_memory="64MiB"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def hits(rid, lora):
        before = engine.scheduler.prefix_cache_stats.hits
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
        out = run_to_completion(engine)[rid]
        return engine.scheduler.prefix_cache_stats.hits - before, out.outputs[0].token_ids

    name_dir = str(tmp_path / "same-name")
    shutil.copytree(a, name_dir)
    assert hits("a1", LoRARequest("x", 1, name_dir))[0] == 0
    assert hits("a2", LoRARequest("x", 1, name_dir))[0] > 0  # the same adapter again: its own blocks
    assert hits("b", LoRARequest("y", 2, b))[0] == 0  # another adapter, same prompt: nothing shared
    assert hits("base", None)[0] == 0
    # The same name and id, other weights (reloaded after an unload): no stale K/V (a hash of the
    # name would hit the blocks "x" cached before); the same weights as a cached adapter under
    # another name do share them (the K/V are the same).
    c = make_adapter(path, f"{path}-lora-mlp", 3, ["gate_proj", "down_proj"], r=16)
    assert engine.remove_lora(1)
    shutil.rmtree(name_dir)
    shutil.copytree(c, name_dir)
    n, tokens = hits("reloaded", LoRARequest("x", 1, name_dir))
    assert n == 0
    assert hits("c", LoRARequest("z", 3, c)) == (64, tokens)


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(ckpt_root, tmp_path):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    big = make_adapter(path, f"{path}-lora-r32", 4, ["q_proj"], r=32)
    # An adapter made for a wider model: its A has more input features than this model's layers.
    from safetensors.torch import load_file, save_file

    foreign = str(tmp_path / "foreign")
    shutil.copytree(make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"]), foreign)
    weights = load_file(os.path.join(foreign, "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_A" in k)
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] * 2)
    save_file(weights, os.path.join(foreign, "adapter_model.safetensors"))
    llm = LLM(path, dtype="float32", enable_lora=True, kv_cache_memory="64MiB")
    for lora, match in ((LoRARequest("gone", 1, str(tmp_path / "nope")), "not a directory"),
                        (LoRARequest("big", 2, big), "max_lora_rank"),
                        (LoRARequest("foreign", 3, foreign), "base model needs")):
        with pytest.raises(ValueError, match=match):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(path, dtype="float32", kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False,
                       lora_request=LoRARequest("qv", 1, make_adapter(path, f"{path}-lora-qv", 1, ["q_proj"])))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=path, enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()


def test_max_loras_passes_over_a_request_without_losing_its_place_and_it_cannot_starve():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=8, max_loras=1)
    groups = [make_group(rid, 4, max_tokens=n, lora_id=lora, tokens=[i + 10] * 4)
              for i, (rid, n, lora) in enumerate((("a", 40, 1), ("b", 2, 2), ("c", 2, 0), ("d", 2, 1)))]
    for g in groups:
        sched.add_request(g)
    out, _ = fake_step(sched)
    # b's adapter would be a second one: c (base) and d (a's adapter) go first, b keeps its place.
    assert {s.request_id for s in out.scheduled} == {"a", "c", "d"}
    assert [g.request_id for g in sched.waiting] == ["b"]
    more = [make_group(f"n{i}", 4, max_tokens=2, tokens=[i + 30] * 4) for i in range(20)]
    lora_of = {g.request_id: g.lora_id for g in groups + more}
    for _ in range(LORA_MAX_SKIPS + 4):
        if more:
            sched.add_request(more.pop())
        fake_step(sched)
    # After LORA_MAX_SKIPS passes nobody overtakes b: once a finishes, b runs.
    assert sched.lora.skips[groups[1].request_id] == LORA_MAX_SKIPS
    while sched.has_unfinished_requests():
        out, _ = fake_step(sched)
        assert len({lora_of[s.request_id] for s in out.scheduled} - {0}) <= 1
    assert groups[1].seqs[0].num_output_tokens == 2


def test_server_picks_the_adapter_by_model_and_loads_and_unloads(ckpt_root):
    """The ``openai`` client names the adapter in ``model``; adapters are listed, loaded and
    unloaded over HTTP (bad path: 400; unknown: 404; in use by a running stream: 409)."""
    import httpx
    import openai
    from test_server import _Server

    from pagellm.engine.async_llm import AsyncLLM

    path = build_tiny_checkpoint(ckpt_root, "llama")
    qv = make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"])
    allm = make_adapter(path, f"{path}-lora-all", 2, ALL, r=4, rslora=True)
    prompt = [int(t) for t in random_prompts(1, seed=9, lo=20, hi=20)[0]]
    with LLM(path, dtype="float32", enable_lora=True, max_loras=2, kv_cache_memory="64MiB") as llm:
        p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        want = {name: llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False, lora_request=lora)[0]
                .outputs[0].text for name, lora in (("base", None), ("qv", LoRARequest("qv", 1, qv)),
                                                          ("all", LoRARequest("all", 2, allm)))}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32", enable_lora=True, max_loras=2,
                                                  kv_cache_memory="64MiB"))
    srv = _Server(engine, None)
    try:
        base = srv.url + "/v1"
        for name, lora_path in (("qv", qv), ("all", allm)):
            assert httpx.post(base + "/load_lora_adapter", json={"lora_name": name, "lora_path": lora_path}
                              ).status_code == 200
        r = httpx.post(base + "/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/dir"})
        assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
        models = httpx.get(base + "/models").json()["data"]
        assert [m["id"] for m in models[1:]] == ["qv", "all"] and models[1]["parent"] == models[0]["id"]
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)
        for name in ("qv", "all"):
            c = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "logprobs": None})
            assert c.choices[0].text == want[name] != want["base"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        stream = client.completions.create(model="qv", prompt=prompt, max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        assert httpx.post(base + "/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 409
        stream.close()
        deadline = time.monotonic() + 10
        while httpx.post(base + "/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 409:
            assert time.monotonic() < deadline, "the aborted stream never released its adapter"
        assert httpx.post(base + "/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404
        assert "qv" not in {m["id"] for m in httpx.get(base + "/models").json()["data"]}
    finally:
        srv.stop()
        engine.shutdown()


@pytest.mark.slow
def test_smollm2_mixed_batch_matches_peft(smollm2_path, tmp_path):
    """The bundled SmolLM2 (float32 over its dequantized GGUF weights, as Hugging Face reads them)
    with three PEFT adapters and the base model in one batch: each request equals PeftModel's."""
    from test_hf_parity import SMOL_PROMPTS

    directory, name = os.path.split(smollm2_path)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    adapters = []
    for i, (targets, r) in enumerate(((["q_proj", "v_proj"], 8), (ALL, 4), (["gate_proj", "down_proj"], 16))):
        torch.manual_seed(i)
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(hf, cfg)
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.data *= 0.2  # a sizeable update that still leaves the model talking
        model.save_pretrained(str(tmp_path / f"a{i}"))
        hf = model.unload()
        adapters.append(str(tmp_path / f"a{i}"))
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:8]]
    which = [adapters[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
    def greedy(model, p):
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        return g[0, len(p):].tolist()

    want, base = [], []
    for p, w in zip(prompts, which, strict=True):
        base.append(greedy(hf, p))
        model = peft.PeftModel.from_pretrained(hf, w).eval() if w else hf
        want.append(greedy(model, p))
        hf = model.unload() if w else hf
    got, _ = _run(None, prompts, which, max_loras=3, kv_cache_memory="256MiB")
    assert got == want
    assert sum(w != b for w, b in zip(want, base, strict=True)) >= 3, "the adapters must change the outputs"


def test_a_16_bit_model_keeps_its_adapters_in_its_dtype(ckpt_root):
    """A float16 model (no CPU kernel: the torch path in float16) multiplies its activations by
    adapter slots of its own dtype, logprob-close to the float32 engine with the same adapter."""
    from test_numerics import check_logprobs_close

    from pagellm.lora.layers import lora_modules

    path = build_tiny_checkpoint(ckpt_root, "llama")
    adapter = make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"])
    prompts = random_prompts(4, seed=13, hi=60)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    runs = {}
    for dtype in ("float32", "float16"):
        engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype=dtype, enable_lora=True,
                                                       kv_cache_memory="64MiB"))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=LoRARequest("qv", 1, adapter))
        done = run_to_completion(engine)
        runs[dtype] = [(done[str(i)].outputs[0].token_ids,
                        [{t: lp[t].logprob for t in sorted(lp, key=lambda t: lp[t].rank)[:5]}
                         for lp in done[str(i)].outputs[0].logprobs]) for i in range(len(prompts))]
        slots = [m.lora for m in lora_modules(engine.executor.worker.model).values()]
        assert slots and all(s.At.dtype == getattr(torch, dtype) for s in slots)
    check_logprobs_close(runs["float16"], runs["float32"])


def test_adapters_over_int8_projections_stay_logprob_close(ckpt_root):
    """quantization='q8_0': every projection on the int8 kernel (the output projection writing into
    its layer's dead input), an adapter on all seven added in place: logprob-close to the float32
    engine with the same adapter, and the adapter really changes the int8 run's tokens."""
    require_int8_kernel()
    from test_numerics import MAX_GAP, assert_near_ties

    from pagellm.lora.layers import lora_modules
    from pagellm.quantization.weight_formats import Int8Packed

    path = build_tiny_checkpoint(ckpt_root, "llama")
    adapter = make_adapter(path, f"{path}-lora-all", 2, ALL, r=4, rslora=True)
    prompts = random_prompts(4, seed=17, hi=60)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    runs = {}
    for name, kw, lora in (("float32", dict(dtype="float32"), True), ("int8", dict(quantization="q8_0"), True),
                           ("int8 base", dict(quantization="q8_0"), False)):
        engine = LLMEngine.from_engine_args(EngineArgs(model=path, enable_lora=True, kv_cache_memory="64MiB", **kw))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params,
                               lora_request=LoRARequest("all", 1, adapter) if lora else None)
        done = run_to_completion(engine)
        runs[name] = [(done[str(i)].outputs[0].token_ids,
                       [{t: lp[t].logprob for t in sorted(lp, key=lambda t: lp[t].rank)[:5]}
                        for lp in done[str(i)].outputs[0].logprobs]) for i in range(len(prompts))]
        if name == "int8":
            modules = lora_modules(engine.executor.worker.model)
            assert len(modules) == 8 and all(isinstance(m.weight_format, Int8Packed) for m in modules.values())
        engine.shutdown()
    assert_near_ties(runs["int8"], runs["float32"], MAX_GAP["int8"])
    assert [t for t, _ in runs["int8"]] != [t for t, _ in runs["int8 base"]], "the adapter must change the tokens"
