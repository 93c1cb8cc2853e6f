"""The safetensors reader against the ``safetensors`` library's own loader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm.mapped_files import read_rows, release_pages
from pagellm.weights.loader import read_safetensors

from conftest import mapped_kib


def test_read_safetensors_equals_the_library_for_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t.{dt}".replace("torch.", ""): (torch.randn(7, 33, generator=g) * 100).to(dt)
               for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool)}
    tensors["empty"] = torch.zeros(0, 5)
    tensors["scalar"] = torch.tensor(3.5)
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    got = dict(read_safetensors(path))
    want = load_file(path)
    assert got.keys() == want.keys() == tensors.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    import mmap

    with pytest.MonkeyPatch.context() as mp:  # where no mapping can be made, the bytes are read
        mp.setattr(mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(12, "Cannot allocate memory")))
        read = dict(read_safetensors(path))
        assert all(torch.equal(read[name], t) and read[name].dtype == t.dtype for name, t in want.items())
    with open(path, "r+b") as f:  # a file cut short is an error naming the tensor, not garbage
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ValueError, match="cut short"):
        dict(read_safetensors(path))


def _rss_file_kib() -> int:
    """This process's resident pages of mapped files (a tmpfs file's count as shared memory)."""
    with open("/proc/self/status") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("RssFile", "RssShmem")))


def test_a_read_tensor_holds_only_the_pages_read_and_writes_stay_in_the_process(tmp_path):
    """Each tensor maps its own bytes: nothing resident until read, its pages dropped by
    ``release_pages`` (and read again from the file after), a write never reaching the file."""
    path = str(tmp_path / "m.safetensors")
    want = torch.arange(16 * 2**20, dtype=torch.int32).reshape(-1, 1024)  # 64 MiB
    save_file({"big": want, "small": torch.ones(3)}, path)
    before = _rss_file_kib()
    got = dict(read_safetensors(path))
    assert _rss_file_kib() - before < 8 * 1024, "nothing is read until used"
    assert torch.equal(got["big"], want)
    read = _rss_file_kib() - before
    assert read > 60 * 1024, f"the 64 MiB read count in the RSS ({read} KiB)"
    release_pages(got["big"])
    assert _rss_file_kib() - before < 8 * 1024, "released pages leave the RSS"
    assert torch.equal(got["big"], want)  # (read again)
    release_pages(want)  # a tensor not mapped: nothing happens to it
    assert torch.equal(got["big"], want)
    got["big"][0, 0] = -1
    assert torch.equal(load_file(path)["big"], want), "a write stays in this process"


def test_rows_of_a_mapped_tensor_are_read_without_mapping_a_page(tmp_path):
    """An embedding's lookup (``read_rows``, and ``Rows16.gather_rows`` over it) reads its rows from
    the file: equal to the rows written, none of the mapping's pages resident after. (Touching one
    row through the mapping maps the page cache's folio around it: 2 MiB on a kernel with large
    folios, so a long prompt's lookup made a 192 MiB embedding resident.)"""
    import torch.nn.functional as F

    from pagellm.quantization.rows16 import Rows16

    path = str(tmp_path / "m.safetensors")
    want = (torch.randn(8192, 512, generator=torch.Generator().manual_seed(0)) * 10).to(torch.bfloat16)  # 8 MiB
    save_file({"embed": want}, path)
    got = dict(read_safetensors(path))["embed"]
    ids = torch.tensor([[5, 8191, 5], [0, 4000, 77]])
    rows = read_rows(got, [5, 8191, 0])
    assert rows is not None and rows.dtype == torch.bfloat16 and torch.equal(rows, want[[5, 8191, 0]])
    looked_up = Rows16(got).gather_rows(ids)
    assert looked_up.dtype == torch.float32 and torch.equal(looked_up, F.embedding(ids, want).float())
    assert torch.equal(Rows16(got).take(4000, 8192).gather_rows(torch.tensor([0, 77])), want[[4000, 4077]].float())
    spread = torch.arange(0, 8192, 41)  # 200 rows of 1 KiB, each on a page of its own
    assert torch.equal(Rows16(got).gather_rows(spread), want[spread].float())
    assert mapped_kib(path) == 0, "no page of the mapping was made resident (through it: >= 800 KiB)"
    assert torch.equal(got[spread], want[spread]) and mapped_kib(path) >= 800  # (the check can fail)
    assert read_rows(want, [1]) is None  # (a tensor not mapped: the caller indexes it)
    with pytest.raises(IndexError, match="out of range"):
        read_rows(got, [8192])


def test_building_a_model_imports_no_compiler(tiny_llama):
    """The model is built on the meta device and loaded: a random init there would import torch's
    Python meta kernels and torch._dynamo with them (~70 MiB of RSS, a second of start-up)."""
    code = ("import sys\nfrom pagellm import LLM\n"
            f"LLM({tiny_llama!r}, kv_cache_memory='16MiB', max_model_len=256)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_dummy_load_format_reads_only_the_config(ckpt_root, tmp_path):
    """vLLM's ``load_format="dummy"``: a directory with a config and a tokenizer but no weights runs,
    every weight in ``[-1e-3, 1e-3)``, the same tokens for the same seed; what cannot hold is refused."""
    import shutil

    from pagellm import LLM, SamplingParams
    from pagellm.config import EngineArgs
    from pagellm.layers.norm import RMSNorm

    from conftest import build_tiny_checkpoint

    src = build_tiny_checkpoint(ckpt_root, "llama")
    shape = tmp_path / "shape"
    shutil.copytree(src, shape, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert not any(f.endswith(".safetensors") for f in os.listdir(shape))
    kw = dict(dtype="float32", num_gpu_blocks_override=16, load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = []
    for seed in (3, 3):
        llm = LLM(str(shape), seed=seed, **kw)
        model = llm.llm_engine.executor.worker.model_runner.model
        norms = torch.cat([m.weight.detach().flatten() for m in model.modules() if isinstance(m, RMSNorm)])
        embed = model.model.embed_tokens.weight.detach()
        for w in (norms, embed):
            assert w.min() >= -1e-3 and w.max() < 1e-3 and w.std() > 1e-4  # (uniform: std 1e-3 / sqrt(3))
        outs.append(llm.generate([{"prompt_token_ids": [1, 5, 9, 200]}], params, use_tqdm=False)[0].outputs[0])
    assert len(outs[0].token_ids) == 5 and outs[0].token_ids == outs[1].token_ids
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs(model=str(shape), load_format="zeros").create_engine_config()
    with pytest.raises(ValueError, match="load_format='dummy' has no stored blocks for quantization='gguf'"):
        EngineArgs(model=str(shape), load_format="dummy", quantization="gguf").create_engine_config()


QUANTIZED = {  # each method's quantization_config as its tool writes it, and the refusal's naming of it
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
                 "quant_method='awq' (bits=4, group_size=128, zero_point=True, version='gemv')"),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32, "desc_act": True, "sym": False,
                   "checkpoint_format": "gptq"},
                  "quant_method='gptq' (bits=3, group_size=32, sym=False, desc_act=True, checkpoint_format='gptq')"),
    "gptq-marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
                    "quant_method='gptq' (bits=4, group_size=128, checkpoint_format='marlin')"),
    "compressed-tensors-nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                                "weights": {"num_bits": 4, "type": "float",
                                                                            "strategy": "tensor_group",
                                                                            "group_size": 16}}}},
                                 "quant_method='compressed-tensors' (format='nvfp4-pack-quantized', group_0: weights "
                                 "float4 symmetric per tensor_group 16, activations none)"),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            "quant_method='fp8' (activation_scheme='dynamic', weight_block_size=[128, 128])"),
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_quantized_hf_checkpoints_are_refused_at_start_up_by_name(ckpt_root, tmp_path, method):
    """A quantized HF directory is refused before any weight is read (this one has none), naming the
    method and the options that decide its layout."""
    import json
    import re
    import shutil

    from pagellm import LLM

    from conftest import build_tiny_checkpoint

    path = tmp_path / method
    shutil.copytree(build_tiny_checkpoint(ckpt_root, "llama"), path, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"], named = QUANTIZED[method]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(named) + " is not supported yet"):
        LLM(str(path), dtype="float32", num_gpu_blocks_override=16)
