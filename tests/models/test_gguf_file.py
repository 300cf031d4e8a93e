"""The GGUF parser against the `gguf` package's own reader, on a file its writer made with
every kind of metadata value and plain and quantised tensors; and its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import close_gguf

gguf = pytest.importorskip("gguf")

from vegas_spec.models.gguf_file import read_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def write(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A GGUF with scalars of every type, strings, arrays of numbers, strings and arrays,
    and F32, F16, I32 and Q8_0 tensors; returns the tensors' values."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for i, vtype in enumerate((V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32,
                               V.UINT64, V.INT64)):
        w.add_key_value(f"t.int{i}", 7 + i, vtype)
    w.add_key_value("t.f32", 0.25, V.FLOAT32)
    w.add_key_value("t.f64", -1.5, V.FLOAT64)
    w.add_key_value("t.bool", True, V.BOOL)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.ints", [3, -1, 4])
    w.add_array("t.floats", [0.5, 2.0])
    w.add_array("t.tokens", ["<s>", "", "▁the", "\n"])
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    tensors = {"a.f32": rng.standard_normal((3, 5)).astype(np.float32),
               "b.f16": rng.standard_normal((4, 8)).astype(np.float16),
               "c.i32": np.arange(6, dtype=np.int32),
               "d.q8": rng.standard_normal((2, 64)).astype(np.float32)}
    for name, value in tensors.items():
        if name == "d.q8":
            w.add_tensor(name, gguf.quants.quantize(value, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, value)
    close_gguf(w)
    return tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_are_the_gguf_readers(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "m.gguf"
    values = write(path, alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        if key == "t.nested":
            continue  # the gguf reader flattens arrays of arrays; below
        want = theirs.fields[key].contents()
        if isinstance(want, float):
            assert field == pytest.approx(want)
        else:
            assert field == want, key
    assert ours.fields["t.tokens"] == ["<s>", "", "▁the", "\n"]
    assert ours.fields["t.nested"] == [[1, 2], [3]]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        np.testing.assert_array_equal(mine.data, ref.data)
    by_name = {t.name: t for t in ours.tensors}
    for name in ("a.f32", "b.f16", "c.i32"):
        np.testing.assert_array_equal(by_name[name].data, values[name])
    q8 = gguf.quants.dequantize(by_name["d.q8"].data, T.Q8_0)
    np.testing.assert_allclose(q8, values["d.q8"], atol=0.05)


def test_a_cut_file_or_an_unknown_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size, message in ((len(data) - 100, "runs past the end of the file"),
                          (200, "inside the metadata"), (12, "inside the metadata")):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=message):
            read_gguf(cut)
    cut.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf(cut)
    cut.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="does not start with the bytes 'GGUF'"):
        read_gguf(cut)
