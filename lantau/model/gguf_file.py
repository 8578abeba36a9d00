"""A GGUF file's header read with `struct`: the metadata (each value decoded when asked for)
and the tensors (memory-mapped numpy views, as gguf.GGUFReader gives them).

gguf.GGUFReader builds a numpy view per metadata element, which makes a tokenizer's vocabulary
and merges (about 100,000 strings in the default model) the slowest part of reading a config.
Here an array of strings is walked by its length prefixes only, and nothing is decoded until
asked.

Every read is checked against the file's size, so a truncated or corrupt file raises
`GGUFFormatError` saying where, never a short array or a walk through a corrupt length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_DEFAULT_ALIGNMENT = 32
_UINT32, _UINT64 = struct.Struct("<I"), struct.Struct("<Q")

# Fixed-size value types: their struct format (little-endian)
_SCALARS: dict[int, struct.Struct] = {
    int(t): struct.Struct("<" + fmt)
    for t, fmt in (
        (GGUFValueType.UINT8, "B"), (GGUFValueType.INT8, "b"), (GGUFValueType.BOOL, "?"),
        (GGUFValueType.UINT16, "H"), (GGUFValueType.INT16, "h"),
        (GGUFValueType.UINT32, "I"), (GGUFValueType.INT32, "i"), (GGUFValueType.FLOAT32, "f"),
        (GGUFValueType.UINT64, "Q"), (GGUFValueType.INT64, "q"), (GGUFValueType.FLOAT64, "d"),
    )
}  # fmt: skip
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
# the fewest bytes an element of each type takes: strings and arrays carry a length
_MIN_BYTES = {**{t: s.size for t, s in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}

# numpy item types of the tensor types gguf.GGUFReader gives as typed arrays; others are bytes
_TENSOR_ITEMS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The file is not a readable little-endian GGUF file; the message says what is wrong."""


@dataclass(frozen=True)
class GGUFValue:
    """A metadata value where it lies in the file: decoded by `contents()`."""

    file: GGUFFile
    type: int
    offset: int  # of the value (after its type id)
    count: int  # elements of an array; 1 otherwise

    def contents(self) -> Any:
        """The value: int, float, bool, str, or a list of them (nested for arrays of arrays).
        UnicodeDecodeError for a string that is not UTF-8."""
        return self.file._decode(self.type, self.offset)[0]


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray  # read-only view: typed for float/int types, bytes (rows, row bytes) else


class GGUFFile:
    """A parsed GGUF file: `fields` (key -> GGUFValue), `tensors` (in file order),
    `data_offset` (where tensor data starts). GGUFFormatError for anything malformed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._size = len(self._map)
        magic, version = self._unpack(_UINT32, 0)[0], self._unpack(_UINT32, 4)[0]
        if magic != GGUF_MAGIC:
            raise GGUFFormatError("bad magic")
        if version & 0xFFFF == 0:  # a byte-swapped small version number
            raise GGUFFormatError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        num_tensors, num_fields = self._unpack(_UINT64, 8)[0], self._unpack(_UINT64, 16)[0]
        offset = 24
        self._check_count(num_fields, 8 + 4 + 1, offset, "metadata fields")
        self.fields: dict[str, GGUFValue] = {}
        for _ in range(num_fields):
            key, offset = self._string(offset)
            (value_type,), offset = self._unpack(_UINT32, offset), offset + 4
            value, offset = self._skip(value_type, offset)
            self.fields[key.decode("utf-8", errors="replace")] = value
        self._check_count(num_tensors, 8 + 4 + 4 + 8, offset, "tensors")
        infos = []
        for _ in range(num_tensors):
            name, offset = self._string(offset)
            (num_dims,), offset = self._unpack(_UINT32, offset), offset + 4
            self._check_count(num_dims, 8, offset, "dimensions")
            dims = struct.unpack_from(f"<{num_dims}Q", self._buf, offset)
            offset += 8 * num_dims
            (raw_type,), (data_at,) = (
                self._unpack(_UINT32, offset),
                self._unpack(_UINT64, offset + 4),
            )
            offset += 12
            infos.append((name.decode("utf-8", errors="replace"), dims, raw_type, data_at))
        alignment = self._alignment()
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("two tensors have the same name")

    def get(self, key: str) -> GGUFValue | None:
        return self.fields.get(key)

    # ------------------------------------------------------------------ header walking

    def _unpack(self, fmt: struct.Struct, offset: int) -> tuple:
        if offset + fmt.size > self._size:
            raise GGUFFormatError(
                f"a read of {fmt.size} bytes at byte {offset} runs past the end of the file "
                f"({self._size} bytes): the file is truncated"
            )
        return fmt.unpack_from(self._buf, offset)

    def _check_count(self, count: int, min_bytes: int, offset: int, what: str) -> None:
        if count * min_bytes > self._size - offset:
            raise GGUFFormatError(
                f"{count} {what} at byte {offset}: more than the rest of the file can hold"
            )

    def _string(self, offset: int) -> tuple[bytes, int]:
        (length,) = self._unpack(_UINT64, offset)
        end = offset + 8 + length
        if end > self._size:
            raise GGUFFormatError(
                f"a string of {length} bytes at byte {offset} runs past the end of the file"
            )
        return bytes(self._buf[offset + 8 : end]), end

    def _skip(self, value_type: int, offset: int) -> tuple[GGUFValue, int]:
        """The value at `offset` (not decoded) and where the next one starts."""
        if value_type not in _MIN_BYTES:
            raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {offset}")
        count = self._unpack(_UINT64, offset + 4)[0] if value_type == _ARRAY else 1
        return GGUFValue(self, value_type, offset, count), self._end(value_type, offset, 1)

    def _end(self, value_type: int, offset: int, count: int) -> int:
        """Where `count` values of `value_type` starting at `offset` end."""
        if value_type in _SCALARS:
            end = offset + count * _SCALARS[value_type].size
            if end > self._size:
                raise GGUFFormatError(f"values at byte {offset} run past the end of the file")
            return end
        if value_type == _STRING:
            buf, size, unpack = self._buf, self._size, _UINT64.unpack_from
            for _ in range(count):
                if offset + 8 > size:
                    raise GGUFFormatError(f"a string at byte {offset} runs past the end")
                offset += 8 + unpack(buf, offset)[0]
            if offset > size:
                raise GGUFFormatError("a string runs past the end of the file")
            return offset
        if value_type != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {offset}")
        for _ in range(count):
            (item_type,), (n,) = self._unpack(_UINT32, offset), self._unpack(_UINT64, offset + 4)
            if item_type not in _MIN_BYTES:
                raise GGUFFormatError(f"unknown array element type {item_type} at byte {offset}")
            self._check_count(n, _MIN_BYTES[item_type], offset + 12, "array elements")
            offset = self._end(item_type, offset + 12, n)
        return offset

    def _decode(self, value_type: int, offset: int) -> tuple[Any, int]:
        """A value and where it ends (the walk checked its extent already)."""
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type]
            return fmt.unpack_from(self._buf, offset)[0], offset + fmt.size
        if value_type == _STRING:
            raw, end = self._string(offset)
            return raw.decode("utf-8"), end
        (item_type,), (count,) = self._unpack(_UINT32, offset), self._unpack(_UINT64, offset + 4)
        offset += 12
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            items = struct.unpack_from(f"<{count}{fmt.format[1:]}", self._buf, offset)
            return list(items), offset + count * fmt.size
        items = []
        for _ in range(count):
            item, offset = self._decode(item_type, offset)
            items.append(item)
        return items, offset

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return _DEFAULT_ALIGNMENT
        value = field.contents() if field.type in _SCALARS else None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise GGUFFormatError(f"general.alignment is {value!r}, not a positive integer")
        return value

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, data_at: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type id {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_elements = int(np.prod(dims, dtype=object))
        if dims and dims[0] % block_size:
            raise GGUFFormatError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks")
        begin = self.data_offset + data_at
        end = begin + num_elements * type_size // block_size
        if end > self._size:
            raise GGUFFormatError(
                f"tensor {name!r} data ends at byte {end}, past the end of the file "
                f"({self._size} bytes): the file is truncated"
            )
        shape = tuple(reversed(dims))
        item = _TENSOR_ITEMS.get(qtype)
        if item is not None:
            data = self._map[begin:end].view(item).reshape(shape)
        else:  # quantized: each row's blocks as bytes
            data = self._map[begin:end].reshape(*shape[:-1], shape[-1] // block_size * type_size)
        return GGUFTensor(name, qtype, tuple(dims), data)
