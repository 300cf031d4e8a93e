"""A GGUF file's metadata and tensor views, parsed with `struct` from a memory map.

The `gguf` package's reader builds a numpy view for every part of every metadata value: for
a 49K-token vocabulary and its merges that is seconds on each load. This parser reads the
same layout (GGUF versions 2 and 3, little-endian) in one pass over Python bytes; the tensors
keep the package's quantisation tables and the views its `quants.dequantize` takes."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # GGUF value types but string (8) and array (9)
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {code: np.dtype(fmt) for code, fmt in _SCALARS.items() if code != 7}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its name, GGML type (a `gguf.GGMLQuantizationType`) and data as the
    `gguf` reader gives it (elements for F16/F32/F64 and the integer types, the blocks'
    bytes for the quantised ones), a read-only view of the file."""

    name: str
    tensor_type: object
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> a Python value; arrays as lists) and the tensors in file order."""

    fields: dict[str, object]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads the GGUF layout from `buf` at `pos`; ValueError past its end."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"the file ends at byte {self.size}, inside the metadata")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str) -> object:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)  # type: ignore[arg-type]
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _ARRAY_DTYPES:  # numbers in one read
            dtype = _ARRAY_DTYPES[item]  # type: ignore[index]
            start = self.take(dtype.itemsize * count)  # type: ignore[operator]
            return np.frombuffer(self.buf, dtype, count, start).tolist()  # type: ignore[arg-type]
        if count > self.size - self.pos:  # every item takes at least one byte
            raise ValueError(f"an array of {count} items cannot fit in the file")
        return [self.value(item) for _ in range(count)]  # type: ignore[arg-type]


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor views of the GGUF file at `path`; ValueError for a file that is
    not GGUF 2 or 3, is big-endian, or is truncated or inconsistent."""
    import gguf

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if bytes(buf[cur.take(4):4]) != b"GGUF":
        raise ValueError("the file does not start with the bytes 'GGUF'")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian "
                         "file reads as a huge version)")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > cur.size or n_fields > cur.size:  # type: ignore[operator]
        raise ValueError(f"{n_tensors} tensors and {n_fields} metadata keys cannot fit in "
                         "the file")
    fields: dict[str, object] = {}
    for _ in range(n_fields):  # type: ignore[call-overload]
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))  # type: ignore[arg-type]
    infos = []
    for _ in range(n_tensors):  # type: ignore[call-overload]
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]  # type: ignore[call-overload]
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment must be a power of two, got {align!r}")
    start = -(-cur.pos // align) * align
    t = gguf.GGMLQuantizationType
    plain = {t.F16: np.float16, t.F32: np.float32, t.F64: np.float64, t.I8: np.int8,
             t.I16: np.int16, t.I32: np.int32, t.I64: np.int64}  # stored as elements
    return GGUFFile(fields, [_tensor(buf, start, *info, gguf, plain) for info in infos])


def _tensor(buf: mmap.mmap, start: int, name: str, dims: list[int], kind: int, offset: int,
            gguf, plain: dict) -> GGUFTensor:  # noqa: ANN001 - the gguf module
    qtype = gguf.GGMLQuantizationType(kind)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    elements = math.prod(dims)
    shape = tuple(reversed(dims))
    if qtype in plain:
        dtype, count = np.dtype(plain[qtype]), elements
    else:
        dtype, count = np.dtype(np.uint8), elements * type_size // block
        shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    at = start + offset
    if at + count * dtype.itemsize > len(buf):
        raise ValueError(f"tensor {name} ({count * dtype.itemsize} bytes at byte {at}) runs "
                         f"past the end of the file ({len(buf)} bytes)")
    return GGUFTensor(name, qtype, np.frombuffer(buf, dtype, count, at).reshape(shape))
