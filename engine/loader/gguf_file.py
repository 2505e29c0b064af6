"""A GGUF file's metadata and tensor index, read in one pass over its header.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: the
SmolLM2 GGUF's tokenizer arrays (49,152 tokens and 48,900 merges) cost it ~5-7 s of CPU
per open, and a `pdserve serve` opened the file several times in its frontend (preflight,
placement, the backend's model config, the tokenizer) and again in every worker. This
reader walks the header with ``struct`` on a read-only mmap (strings decoded straight from
the map, numeric arrays with one ``numpy.frombuffer``): the same values in ~0.1 s.

- ``fields``: metadata key -> Python value (str, int, float, bool, or a list of them), as
  ``gguf``'s ``ReaderField.contents()`` gives it;
- ``tensors``: name, GGML type, shape (GGUF order: innermost first), element and byte
  counts, absolute data offset, and ``data``: a read-only view of the mmap with the dtype and
  shape ``gguf.GGUFReader`` gives (float types as such, quantized ones as the uint8 rows
  ``gguf.quants.dequantize`` takes).

Little-endian GGUF version 2 and 3 (what llama.cpp writes); others get a ValueError that
says so. The tensors' types and block sizes come from the ``gguf`` package.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format (scalars); 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# GGML types stored as plain numpy arrays (by GGMLQuantizationType name); the rest are quantized rows
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any          # gguf.GGMLQuantizationType
    shape: tuple[int, ...]    # GGUF order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int          # absolute, in the file
    data: np.ndarray          # read-only view of the file (see the module docstring)


class GGUFFile:
    """``GGUFFile(path)``: the header parsed, the tensors mapped (not read) from the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(self.path)!r} does not exist; pass the path of a .gguf file")
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError) as e:
            raise ValueError(f"cannot read GGUF {self.path}: a truncated or corrupt header ({e})") from e

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # ------------------------------------------------------------------ parsing
    def _parse(self) -> None:
        m = self._map
        if m[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
        version, = struct.unpack_from("<I", m, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path} is a big-endian GGUF; convert it to little-endian (llama.cpp's "
                             "gguf tools) to load it here")
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are supported "
                             "(re-convert it with a current llama.cpp)")
        n_tensors, n_fields = struct.unpack_from("<QQ", m, 8)
        self._off = 24
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            vtype, = self._unpack("<I")
            fields[key] = self._value(vtype)
        self.fields: Mapping[str, Any] = MappingProxyType(fields)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims, = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", m, self._off)
            self._off += 8 * n_dims
            ttype, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        align = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._off // align) * align
        self.tensors: tuple[GGUFTensor, ...] = tuple(self._tensor(*info, data_start) for info in infos)
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.path} lists a tensor twice; the file is corrupt")

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._off)
        self._off += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        n, = struct.unpack_from("<Q", self._map, self._off)
        start = self._off + 8
        self._off = start + n
        if self._off > len(self._map):
            raise IndexError("a string runs past the end of the file")
        return self._map[start:self._off].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(self._unpack("<I")[0]) for _ in range(count)]
            dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
            arr = np.frombuffer(self._map, dtype=dt, count=count, offset=self._off)
            self._off += dt.itemsize * count
            return arr.tolist()
        fmt = _SCALAR[vtype]
        return self._unpack(fmt)[0]

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: int, offset: int, data_start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError as e:
            raise ValueError(f"tensor {name!r} of {self.path} has GGML type {ttype}, which the installed gguf "
                             "package does not know; upgrade gguf") from e
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block
        start = data_start + offset
        if start + n_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of {self.path}: the file is truncated")
        np_shape = tuple(reversed(dims))
        plain = _PLAIN_TYPES.get(qtype.name)
        if plain is not None:
            data = np.frombuffer(self._map, dtype=plain, count=n_elements, offset=start).reshape(np_shape)
        else:
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start).reshape(
                quant_shape_to_byte_shape(np_shape, qtype))
        return GGUFTensor(name=name, tensor_type=qtype, shape=dims, n_elements=n_elements, n_bytes=n_bytes,
                          data_offset=start, data=data)
