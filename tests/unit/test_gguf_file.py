"""engine/loader/gguf_file.py against the `gguf` package's own reader (GGUFReader): every
metadata value and every tensor's type, shape, offset and bytes, on files written by
gguf.GGUFWriter (each value type, float and quantized tensors, a custom alignment) and on the
real SmolLM2 GGUF; bad files get a ValueError that says what is wrong."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.loader.gguf_file import GGUFFile


def _reference(path):
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, r.tensors


def _assert_same(path) -> GGUFFile:
    ours = GGUFFile(path)
    fields, tensors = _reference(path)
    assert list(ours.fields) == list(fields)
    for key, want in fields.items():
        got = ours.fields[key]
        assert type(got) is type(want) and got == want, (key, got, want)
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for got, want in zip(ours.tensors, tensors):
        assert got.tensor_type == want.tensor_type and list(got.shape) == want.shape.tolist(), got.name
        assert (got.n_elements, got.n_bytes, got.data_offset) == (want.n_elements, want.n_bytes, want.data_offset)
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        assert np.array_equal(got.data, want.data), got.name
    return ours


def _write(path, *, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, 2, 3, 70000])
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.strs", ["a", "Ġb c", "", "日本"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    w.add_tensor("vec", rng.standard_normal(48).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_matches_the_gguf_package(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    _write(path, alignment=alignment)
    ours = _assert_same(path)
    assert ours.get("t.strs") == ["a", "Ġb c", "", "日本"] and ours.get("missing", 7) == 7
    q8 = next(t for t in ours.tensors if t.name == "q8")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (4, 64)
    assert not q8.data.flags.writeable          # a read-only view of the file


@pytest.mark.smollm2
def test_the_smollm2_gguf_matches_the_gguf_package():
    from engine.loader.default_model import default_model_path

    ours = _assert_same(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and ours.fields["general.architecture"] == "llama"


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        GGUFFile(tmp_path / "missing.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFFile(tmp_path / "not.gguf")
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="versions 2 and 3"):
        GGUFFile(tmp_path / "v1.gguf")
    (tmp_path / "be.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(tmp_path / "be.gguf")
    whole = tmp_path / "t.gguf"
    _write(whole)
    data = whole.read_bytes()
    (tmp_path / "header.gguf").write_bytes(data[:200])       # cut inside the metadata
    with pytest.raises(ValueError, match="truncated or corrupt header"):
        GGUFFile(tmp_path / "header.gguf")
    (tmp_path / "tensors.gguf").write_bytes(data[:-100])      # cut inside the last tensor
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(tmp_path / "tensors.gguf")


def test_the_open_benchmark_refuses_a_file_that_is_not_gguf(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "model_open.py"
    (tmp_path / "model.bin").write_bytes(b"x")
    run = subprocess.run([sys.executable, str(script), "--model", str(tmp_path / "model.bin")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "is not a .gguf file" in run.stderr
