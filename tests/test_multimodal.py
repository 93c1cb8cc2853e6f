"""Vision-language models (LLaVA-1.5) against HF ``generate`` on a tiny random checkpoint, and the
encoder cache and budget under scheduling pressure: chunked prefill across an image, preemption by
recompute and swap, prefix caching keyed by images, parallel sampling and beams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import BeamSearchParams

from conftest import assert_cache_pressure, build_tiny_llava

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def llava(ckpt_root) -> str:
    return build_tiny_llava(ckpt_root)


@pytest.fixture(scope="module")
def hf_llava(llava):
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(llava)


def _hf_greedy(hf_llava, prompt: str, images: list, max_tokens: int = 10, **kw) -> list[int]:
    model, proc = hf_llava
    inputs = proc(text=prompt, images=images or None, return_tensors="pt", **kw)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _requests(images):
    """One image, two images, a text-only row, and images of other sizes (resized by the processor)."""
    return [("Describe <image> briefly.", [images[0]]),
            ("<image> and <image>: which is brighter?", [images[1], images[2]]),
            ("A prompt without any image.", []),
            ("Small <image> then big <image> end", [images[3], images[4]])]


@pytest.fixture(scope="module")
def images():
    return [_image(40, 70, 0), _image(56, 56, 1), _image(90, 30, 2), _image(14, 14, 3), _image(300, 200, 4)]


def _prompt(text: str, imgs: list) -> object:
    return {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text


def _vision_calls(llm: LLM) -> list[int]:
    """The batch size of every vision-tower forward the worker runs (a hook, not the product's counter)."""
    calls: list[int] = []
    tower = llm.llm_engine.executor.worker.model_runner.model.vision_tower
    tower.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    return calls


def test_float32_greedy_equals_hf_with_images_and_text_rows_in_one_batch(llava, hf_llava, images):
    requests = _requests(images)
    llm = LLM(llava, dtype="float32")
    outs = llm.generate([_prompt(t, im) for t, im in requests], GREEDY, use_tqdm=False)
    for (text, imgs), out in zip(requests, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf_llava, text, imgs), text
    # Each image's placeholders were expanded as HF's processor expands them.
    model, proc = hf_llava
    assert outs[1].prompt_token_ids == proc(text=requests[1][0], images=requests[1][1])["input_ids"][0]


def test_a_siglip_tower_and_a_qwen2_text_model_equal_hf(ckpt_root, images):
    """LLaVA's other towers and text families: SigLIP (no class token, a biased patch embedding,
    every patch kept) over a Qwen2 decoder (biased q/k/v)."""
    import transformers

    path = build_tiny_llava(ckpt_root, text_type="qwen2", tower="siglip")
    hf = (transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(),
          transformers.AutoProcessor.from_pretrained(path))
    requests = _requests(images)
    outs = LLM(path, dtype="float32").generate([_prompt(t, im) for t, im in requests], GREEDY, use_tqdm=False)
    for (text, imgs), out in zip(requests, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, text, imgs), text


def test_the_same_image_is_encoded_once_and_shared(llava, images):
    llm = LLM(llava, dtype="float32")
    calls = _vision_calls(llm)
    same = [_prompt("One <image>", [images[0]]), _prompt("Two <image>", [images[0]]),
            _prompt("Three <image> and <image>", [images[0], images[1]])]
    outs = llm.generate(same, GREEDY, use_tqdm=False)
    assert sum(calls) == 2, calls  # images[0] once, images[1] once
    enc = llm.llm_engine.scheduler.encoder
    assert enc.misses == 2 and enc.hits == 2
    alone = LLM(llava, dtype="float32", mm_processor_cache_gb=0)
    alone_calls = _vision_calls(alone)
    assert [o.outputs[0].token_ids for o in alone.generate(same, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]
    assert sum(alone_calls) == 4  # caching off: every request encodes its own


def test_chunked_prefill_across_an_image_and_a_tight_encoder_budget(llava, images):
    """A chunk of 8 tokens never holds a 16-token image: chunks start inside it (the rows come
    from the encoder cache); a budget of one image a step splits a two-image prompt's encoding."""
    requests = _requests(images)
    prompts = [_prompt(t, im) for t, im in requests]
    ref = [o.outputs[0].token_ids for o in LLM(llava, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(llava, dtype="float32", max_num_batched_tokens=8, max_num_encoder_input_tokens=16,
              encoder_cache_size=16, enable_prefix_caching=False)
    calls = _vision_calls(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert calls == [1] * 5  # one image per step (the budget), each image once
    image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    assert outs[0].prompt_token_ids.count(image_id) == 16  # > 8: a chunk starts inside the image


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tight_cache_changes_nothing(llava, images, mode):
    requests = _requests(images) * 2
    prompts = [_prompt(t, im) for t, im in requests]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(llava, dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(llava, dtype="float32", num_gpu_blocks_override=12, block_size=8, preemption_mode=mode,
              max_num_batched_tokens=64, encoder_cache_size=48)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_cache_pressure(llm.llm_engine, mode)


def test_prefix_cache_never_shares_kv_between_different_images(llava, images):
    """Blocks wholly before the image are shared with a request showing another image; from the
    block where the image starts on, nothing is (vLLM's per-block keys); the same image hits."""
    llm = LLM(llava, dtype="float32", block_size=4)
    text = "A shared preamble of a dozen words or so, before the image: <image> and tell me everything about it"
    first = llm.generate([_prompt(text, [images[0]])], GREEDY, use_tqdm=False)[0]
    other = llm.generate([_prompt(text, [images[1]])], GREEDY, use_tqdm=False)[0]
    again = llm.generate([_prompt(text, [images[0]])], GREEDY, use_tqdm=False)[0]
    image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    offset = first.prompt_token_ids.index(image_id)
    assert offset >= 8 and other.num_cached_tokens == offset // 4 * 4  # the blocks before the image, only
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    fresh = LLM(llava, dtype="float32", block_size=4).generate([_prompt(text, [images[1]])], GREEDY, use_tqdm=False)
    assert other.outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_prefix_cache_stops_where_a_second_image_differs(llava, images):
    """Two requests with the same text and first image and different second images: the second is
    cached up to the block where its second image starts (the first image's blocks included), no
    further, and its tokens are a fresh engine's."""
    llm = LLM(llava, dtype="float32", block_size=4)
    text = "Look at <image> first, and then, after a few more words of text, at <image> and compare them"
    first = llm.generate([_prompt(text, [images[0], images[1]])], GREEDY, use_tqdm=False)[0]
    second = llm.generate([_prompt(text, [images[0], images[2]])], GREEDY, use_tqdm=False)[0]
    image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    ids = second.prompt_token_ids
    second_image = next(i for i in range(ids.index(image_id) + 1, len(ids)) if ids[i] == image_id != ids[i - 1])
    assert second_image >= ids.index(image_id) + 16 + 4  # (past the first image's 16 tokens and a block of text)
    assert second.num_cached_tokens == second_image // 4 * 4
    fresh = LLM(llava, dtype="float32", block_size=4).generate([_prompt(text, [images[0], images[2]])], GREEDY,
                                                                 use_tqdm=False)
    assert second.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    assert first.prompt_token_ids == ids  # (the same text: only the second image tells them apart)


def test_parallel_sampling_and_beams_with_images(llava, hf_llava, images):
    text, imgs = "Describe <image> briefly.", [images[0]]
    llm = LLM(llava, dtype="float32")
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([_prompt(text, imgs)], sampled, use_tqdm=False)[0]
    tight = LLM(llava, dtype="float32", num_gpu_blocks_override=10, block_size=8, preemption_mode="swap")
    again = tight.generate([_prompt(text, imgs), _prompt(text, imgs)], sampled, use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in out.outputs]
    assert_cache_pressure(tight.llm_engine, "swap")
    model, proc = hf_llava
    inputs = proc(text=text, images=imgs, return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(**inputs, max_new_tokens=6, num_beams=2, num_return_sequences=2, do_sample=False,
                            length_penalty=1.0, early_stopping=True)
    beams = llm.beam_search([_prompt(text, imgs)], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    n = inputs["input_ids"].shape[1]
    assert [s.output_token_ids for s in beams[0].sequences] == [h[n:].tolist() for h in hf]


def test_chat_image_parts_put_the_placeholder_where_vllm_does(llava, hf_llava, images):
    import base64
    import io

    llm = LLM(llava, dtype="float32")
    buf = io.BytesIO()
    images[0].save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = {"type": "text", "text": "What is in it?"}
    by_pil = llm.chat([{"role": "user", "content": [question, {"type": "image_pil", "image_pil": images[0]}]}],
                      GREEDY, use_tqdm=False)[0]
    by_url = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}],
                      GREEDY, use_tqdm=False)[0]
    assert "<image>\nWhat is in it?" in by_pil.prompt  # (a template that renders no image parts: placeholders first)
    assert by_pil.outputs[0].token_ids == by_url.outputs[0].token_ids == \
        _hf_greedy(hf_llava, by_pil.prompt, [images[0]], add_special_tokens=False)


def test_bad_image_requests_are_refused_naming_the_problem(llava, tiny_llama, images):
    llm = LLM(llava, dtype="float32", limit_mm_per_prompt={"image": 2}, max_num_encoder_input_tokens=16)
    cases = [(_prompt("no placeholder", [images[0]]), "1 image"),
             (_prompt("<image><image><image>", images[:3]), "limit_mm_per_prompt"),
             ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "PIL.Image"),
             ({"prompt": "<image>", "multi_modal_data": {"video": [images[0]]}}, "'image'")]
    for prompt, needle in cases:
        with pytest.raises(ValueError, match=needle):
            llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        LLM(build_tiny_llava(str(__import__("pathlib").Path(llava).parent), image_size=70), dtype="float32",
            max_num_encoder_input_tokens=16).generate([_prompt("<image>", [images[0]])], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        LLM(tiny_llama).generate([_prompt("<image>", [images[0]])], GREEDY, use_tqdm=False)


def _png_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def image_host(tmp_path_factory, images):
    """A local HTTP server with one image (``/cat.png``); every other path is a 404."""
    import functools
    import http.server
    import threading

    root = tmp_path_factory.mktemp("www")
    images[1].save(root / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    httpd.shutdown()


def test_server_images_with_the_openai_client_and_hostile_inputs(llava, images, image_host, tmp_path):
    import httpx
    import openai
    from test_server import _Server

    from pagellm.config import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.chat_utils import MediaConnector

    host, www = image_host
    engine = AsyncLLM.from_engine_args(EngineArgs(model=llava, dtype="float32", limit_mm_per_prompt={"image": 2}))
    srv = _Server(engine, None, media=MediaConnector(allowed_local_media_path=str(www), max_bytes=60_000))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)

        def ask(*parts: dict) -> str:
            r = client.chat.completions.create(model="tiny", max_tokens=10, temperature=0,
                                               messages=[{"role": "user", "content": list(parts)}],
                                               extra_body={"ignore_eos": True})
            return r.choices[0].message.content or ""

        text = {"type": "text", "text": "What is in it?"}
        offline = LLM(llava, dtype="float32").chat(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]}, text]}], GREEDY,
            use_tqdm=False)[0].outputs[0].text
        assert ask({"type": "image_url", "image_url": {"url": _png_url(images[0])}}, text) == offline
        by_http = ask({"type": "image_url", "image_url": {"url": f"{host}/cat.png"}}, text)
        by_file = ask({"type": "image_url", "image_url": {"url": f"file://{www}/cat.png"}}, text)
        by_data = ask({"type": "image_url", "image_url": {"url": _png_url(images[1].convert("RGB"))}}, text)
        assert by_http == by_file == by_data
        (tmp_path / "secret.png").write_bytes(b"x")
        hostile = [("data:image/png;base64,aGVsbG8=", "not an image"),
                   ("data:image/png;base64,@@@", "base64"),
                   (_png_url(_image(300, 300, 9)), "larger than"),
                   (f"{host}/missing.png", "HTTP 404"),
                   ("http://127.0.0.1:9/x.png", "fetching the image failed"),
                   (f"file://{tmp_path}/secret.png", "outside --allowed-local-media-path"),
                   ("ftp://example.com/x.png", "data:, http(s)://")]
        for url, needle in hostile:
            body = {"model": "tiny", "messages": [{"role": "user", "content": [
                text, {"type": "image_url", "image_url": {"url": url}}]}]}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (url, r.text)
            assert "messages[0].content[1]" in r.json()["error"]["message"]
        three = [{"type": "image_url", "image_url": {"url": _png_url(images[0])}}] * 3
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": [*three, text]}]})
        assert r.status_code == 400 and "limit_mm_per_prompt" in r.text, r.text
        assert ask({"type": "image_url", "image_url": {"url": _png_url(images[0])}}, text) == offline  # still serving
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        encoded = [line for line in metrics.splitlines() if "encoder_cache_misses" in line and line[0] != "#"]
        assert encoded and float(encoded[0].split()[-1]) == 2, encoded  # six requests, two distinct images
        assert "encoder_seconds" in metrics and "encoder_cache_usage_perc" in metrics
    finally:
        srv.stop()
        engine.shutdown()


def test_remote_media_can_be_turned_off():
    from pagellm.entrypoints.chat_utils import MediaConnector

    with pytest.raises(ValueError, match="turned off"):
        MediaConnector(allow_remote_media=False).load_image("https://example.com/cat.png")
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        MediaConnector().load_image("file:///etc/hostname")


def test_encoder_stats_reach_prometheus_and_the_step_trace(llava, images):
    llm = LLM(llava, dtype="float32", trace=True)
    llm.generate([_prompt("One <image>", [images[0]]), _prompt("Two <image>", [images[0]])], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    stats = engine.scheduler.make_stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (1, 1)
    assert stats.encoder_cache_usage == 0.0  # nothing running holds an image
    assert engine.iteration_stats.encoder_seconds > 0
    steps = [e for e in llm.get_trace()["traceEvents"] if e.get("name", "").startswith("step")]
    assert sum(e["args"].get("images_encoded", 0) for e in steps) == 1


# ---- Qwen2-VL / Qwen2.5-VL: dynamic resolution and M-RoPE ---------------------------------------
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=[False, True], ids=["qwen2-vl", "qwen2.5-vl"])
def qwen_vl(request, ckpt_root):
    """``(path, HF model, tokenizer, image processor)``."""
    import transformers

    from conftest import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(ckpt_root, v25=request.param)
    cls = transformers.Qwen2_5_VLForConditionalGeneration if request.param else \
        transformers.Qwen2VLForConditionalGeneration
    return (path, cls.from_pretrained(path, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(path), transformers.AutoImageProcessor.from_pretrained(path))


def _hf_qwen(qwen_vl, prompt: str, images: list, max_tokens: int = 10) -> tuple[list[int], list[int]]:
    """HF ``generate`` on the processor's inputs: ``(prompt ids, greedy tokens)``. Each image's one
    ``<|image_pad|>`` becomes grid / 4 of them, as Qwen2VLProcessor expands it."""
    _, model, tok, ip = qwen_vl
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, kw = tok(prompt)["input_ids"], {}
    if images:
        out = ip(images=images, return_tensors="pt")
        sizes = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [x for t in ids for x in ([t] * next(sizes) if t == pad else [t])]
        kw = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             mm_token_type_ids=(input_ids == pad).int(), max_new_tokens=max_tokens, do_sample=False,
                             **kw)
    return ids, gen[0, len(ids):].tolist()


def _qwen_requests(images):
    """Images of several sizes (other grids, windows that are cut), two in one prompt, text alone."""
    return [(f"Describe {VISION} briefly.", [images[4]]),
            (f"{VISION} and {VISION}: which is brighter?", [images[1], images[0]]),
            ("A prompt without any image.", []),
            (f"Tall {VISION} then wide {VISION} end", [images[2], images[3]])]


def test_qwen2_vl_float32_greedy_equals_hf_at_every_image_size(qwen_vl, images):
    requests = _qwen_requests(images)
    outs = LLM(qwen_vl[0], dtype="float32").generate([_prompt(t, im) for t, im in requests], GREEDY,
                                                       use_tqdm=False)
    for (text, imgs), out in zip(requests, outs, strict=True):
        ids, tokens = _hf_qwen(qwen_vl, text, imgs)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens, text


def test_qwen2_vl_chunks_inside_images_and_preemption_keep_the_mrope_positions(qwen_vl, images):
    """Chunks of 5 tokens start inside every image (M-RoPE positions of a partial image), and a
    tight cache recomputes or swaps requests whose images are behind them."""
    prompts = [_prompt(t, im) for t, im in _qwen_requests(images)] * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(qwen_vl[0], dtype="float32").generate(prompts, params,
                                                                                   use_tqdm=False)]
    for mode in ("recompute", "swap"):
        llm = LLM(qwen_vl[0], dtype="float32", max_num_batched_tokens=64, long_prefill_token_threshold=5,
                  num_gpu_blocks_override=24, block_size=8, preemption_mode=mode)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        assert_cache_pressure(llm.llm_engine, mode)


def test_mrope_positions_equal_hfs_rope_index_for_any_chunk(qwen_vl, images):
    from pagellm.models.qwen2_vl import mrope_positions

    _, model, tok, ip = qwen_vl
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    text, imgs = _qwen_requests(images)[3]
    out = ip(images=imgs, return_tensors="pt")
    grids = out["image_grid_thw"]
    ids, _ = _hf_qwen(qwen_vl, text, imgs, max_tokens=1)
    input_ids = torch.tensor([ids])
    hf, delta = model.model.get_rope_index(input_ids, (input_ids == pad).int(), image_grid_thw=grids)
    layout, pos = [], 0
    for t, h, w in grids.tolist():
        pos = ids.index(pad, pos)
        n = t * h * w // 4
        layout.append((pos, n, t, h // 2, w // 2))
        pos += n
    expected = hf[:, 0].tolist()
    for start, n in [(0, len(ids)), (3, 7), (layout[0][0] + 5, 30), (layout[1][0] - 2, 9)]:
        n = min(n, len(ids) - start)
        assert mrope_positions(layout, start, n) == [row[start:start + n] for row in expected], (start, n)
    after = len(ids) + int(delta)  # a generated token's three positions
    assert mrope_positions(layout, len(ids), 1) == [[after]] * 3


def _hf_top5(model, inputs: dict, new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    """HF float32 greedy tokens and each step's top 5 (token -> logprob)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    tops = []
    for scores in out.scores:
        top = torch.log_softmax(scores[0].double(), -1).topk(5)
        tops.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), tops


def test_bfloat16_is_logprob_close_to_hf_float32_with_images(llava, hf_llava, qwen_vl, images):
    """The vision towers run the text model's numerics: bfloat16 GEMMs (where this machine has the
    kernel) stay within HF float32's top 5 wherever greedy tokens diverge."""
    from test_numerics import MAX_GAP, check_logprobs_close

    from conftest import require_bf16_kernel

    require_bf16_kernel()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    model, proc = hf_llava
    cases = [(llava, lambda t, im: proc(text=t, images=im, return_tensors="pt"), model, _requests(images)[:2])]
    q_path, q_model, tok, ip = qwen_vl
    pad = tok.convert_tokens_to_ids("<|image_pad|>")

    def q_inputs(text, imgs):
        ids, _ = _hf_qwen(qwen_vl, text, imgs, max_tokens=1)
        out = ip(images=imgs, return_tensors="pt")
        input_ids = torch.tensor([ids])
        return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=out["pixel_values"],
                    image_grid_thw=out["image_grid_thw"], mm_token_type_ids=(input_ids == pad).int())

    cases.append((q_path, q_inputs, q_model, [r for r in _qwen_requests(images) if r[1]]))
    for path, make_inputs, hf, requests in cases:
        ref = [_hf_top5(hf, make_inputs(t, im), 12) for t, im in requests]
        llm = LLM(path, dtype="bfloat16")
        assert llm.llm_engine.model_info.dtype.startswith("bfloat16"), llm.llm_engine.model_info.dtype
        outs = llm.generate([_prompt(t, im) for t, im in requests], params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, [{t: lp[t].logprob for t in lp} for lp in o.outputs[0].logprobs])
               for o in outs]
        gaps = check_logprobs_close(got, ref)
        assert all(g <= MAX_GAP["tiny_bfloat16"] for g in gaps), f"{path}: divergences at HF logprob gaps {gaps}"


def test_qwen2_vl_chat_places_its_vision_markers(qwen_vl, images):
    """A chat image on a template that renders no image parts becomes Qwen2-VL's own placeholder
    (``<|vision_start|><|image_pad|><|vision_end|>``), as in a prompt written by hand."""
    llm = LLM(qwen_vl[0], dtype="float32")
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1]},
                                                  {"type": "text", "text": "What is it?"}]}], GREEDY, use_tqdm=False)[0]
    assert f"{VISION}\nWhat is it?" in chat.prompt
    ids, tokens = _hf_qwen(qwen_vl, chat.prompt, [images[1]])
    assert chat.outputs[0].token_ids == tokens


def test_a_checkpoint_missing_a_vision_weight_is_refused(llava, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "llava-missing"
    shutil.copytree(llava, bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = next(n for n in weights if "multi_modal_projector.linear_2.weight" in n)
    del weights[name]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 .*multi_modal_projector.linear_2.weight"):
        LLM(str(bad), dtype="float32")
