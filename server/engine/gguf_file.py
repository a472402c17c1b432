"""The GGUF file format (llama.cpp's): the header parsed straight from a memory map, the tensor table
checked against the file, and tensor data dequantized.

`gguf.GGUFReader` builds a numpy view per metadata item, which takes seconds for a 50k-token vocabulary and
would be paid on every start, so the header is read here; tensor data goes through
`gguf.quants.dequantize` (every type the installed `gguf` library supports: F32/F16/BF16, Q4_0..Q8_0, the
K-quants, the IQ types). What a LLaMA model is made of (config, names, tokenizer) is
`server.engine.gguf_loader`'s.

Errors are typed: `GGUFFormatError` for files that are not valid GGUF (truncated, corrupt, inconsistent),
`UnsupportedGGUFError` for valid files this engine cannot run (big-endian, v1, a type it cannot read).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_VERSIONS",
    "GGUFError",
    "GGUFFile",
    "GGUFFormatError",
    "GGUFTensorInfo",
    "UnsupportedGGUFError",
    "check_dequantizable",
    "read_gguf",
]

SUPPORTED_VERSIONS = (2, 3)  # v1 counted with 32-bit integers; llama.cpp stopped writing it in 2023
_DEFAULT_ALIGNMENT = 32
# Metadata arrays of strings that are parsed into lists; every other string array (the vocabulary, the
# merges: ~100k strings) is only walked over and recorded by its length, which keeps a start fast.
_PARSED_STRING_ARRAYS = frozenset({"general.languages", "general.tags"})

# Fixed-width metadata value types (GGUFValueType): struct format and width.
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",  # UINT8
    1: "b",  # INT8
    2: "H",  # UINT16
    3: "h",  # INT16
    4: "I",  # UINT32
    5: "i",  # INT32
    6: "f",  # FLOAT32
    7: "?",  # BOOL
    10: "Q",  # UINT64
    11: "q",  # INT64
    12: "d",  # FLOAT64
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """Base class of the errors raised while loading a GGUF file."""


class GGUFFormatError(GGUFError):
    """The file is not a valid GGUF file: wrong magic, truncated, corrupt or inconsistent."""


class UnsupportedGGUFError(GGUFError):
    """A valid GGUF file holding something this engine does not run (architecture, tensor type, ...)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # numpy/torch order (GGUF lists dimensions fastest-first)
    type_id: int  # ggml type id (`gguf.GGMLQuantizationType`)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.type_id)


@dataclass
class GGUFFile:
    """A parsed GGUF file: its metadata, its tensor table, and a read-only memory map of its data."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    buffer: mmap.mmap = field(repr=False)  # the whole file, read-only; tensors are views into it
    array_lengths: dict[str, int] = field(default_factory=dict)  # every array's length, parsed or not

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 rows, the layout `gguf.quants.dequantize` takes (a view, no copy)."""
        info = self.tensors[name]
        data = np.frombuffer(self.buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its numpy shape; `UnsupportedGGUFError` if its type cannot be read."""
        import gguf

        info = self.tensors[name]
        check_dequantizable(info)
        try:
            values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(info.type_id))
        except NotImplementedError as e:  # a type the probe passed but the full tensor did not
            raise _unsupported_type(info) from e
        return values.reshape(info.shape)


# ----------------------------------------------------------------------------------------- the header
def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and check every tensor lies inside the file (no tensor data is read).

    Raises `FileNotFoundError`, `GGUFFormatError` or `UnsupportedGGUFError` (GGUF v1, big-endian files).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFFormatError(f"{path} is empty; re-download or re-convert the model")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buffer)
    except (struct.error, IndexError, OverflowError, MemoryError) as e:
        raise GGUFFormatError(
            f"{path} is truncated or corrupt (its header could not be parsed: {e}); "
            "re-download or re-convert the model"
        ) from e


class _Cursor:
    """Sequential little-endian reads from a buffer, failing with `GGUFFormatError` past its end."""

    def __init__(self, path: Path, buffer: mmap.mmap) -> None:
        self.path, self.buffer, self.pos, self.size = path, buffer, 0, len(buffer)

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise GGUFFormatError(
                f"{self.path} is truncated or corrupt: a read of {n} bytes at offset {start} runs past the "
                f"end of the file ({self.size} bytes); re-download or re-convert the model"
            )
        self.pos += n
        return start

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buffer, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        start = self.take(n)
        return self.buffer[start : start + n].decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.take(self.unpack("Q"))


def _parse(path: Path, buffer: mmap.mmap) -> GGUFFile:
    cur = _Cursor(path, buffer)
    magic = buffer[:4]
    if magic != b"GGUF":
        raise GGUFFormatError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    cur.take(4)
    version = cur.unpack("I")
    if version & 0xFFFF == 0 and version != 0:
        raise UnsupportedGGUFError(
            f"{path} is a big-endian GGUF file; this engine reads little-endian files only "
            "(re-convert it with llama.cpp's convert_hf_to_gguf.py without --bigendian)"
        )
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedGGUFError(
            f"{path} is GGUF version {version}; supported versions are {SUPPORTED_VERSIONS} "
            "(re-convert the model with a current llama.cpp)"
        )
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        value_type = cur.unpack("I")
        metadata[key] = _read_value(cur, key, value_type, lengths)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise GGUFFormatError(f"{path} is corrupt: general.alignment is {alignment}")
    table: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise GGUFFormatError(f"{path} is corrupt: tensor {name!r} claims {n_dims} dimensions")
        dims = tuple(cur.unpack("Q") for _ in range(n_dims))
        type_id, offset = cur.unpack("I"), cur.unpack("Q")
        table.append((name, tuple(reversed(dims)), type_id, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {
        name: _tensor_info(path, name, shape, type_id, data_start + offset, cur.size)
        for name, shape, type_id, offset in table
    }
    return GGUFFile(path, metadata, tensors, buffer, lengths)


def _read_value(cur: _Cursor, key: str, value_type: int, lengths: dict[str, int]) -> Any:
    if value_type in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[value_type])
    if value_type == _STRING:
        return cur.string()
    if value_type != _ARRAY:
        raise GGUFFormatError(f"{cur.path} is corrupt: metadata {key!r} has unknown value type {value_type}")
    item_type, count = cur.unpack("I"), cur.unpack("Q")
    lengths[key] = count
    if item_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[item_type]
        start = cur.take(count * struct.calcsize(fmt))
        # Per-layer arrays are short; a vocabulary's scores or token types are skipped like strings.
        if count > 4096:
            return None
        return [v for (v,) in struct.iter_unpack(fmt, cur.buffer[start : cur.pos])]
    if item_type == _STRING:
        if key in _PARSED_STRING_ARRAYS:
            return [cur.string() for _ in range(count)]
        for _ in range(count):
            cur.skip_string()
        return None
    # Nested arrays: nothing a LLaMA config needs; walk over them.
    for _ in range(count):
        _read_value(cur, key, item_type, {})
    return None


def _tensor_info(
    path: Path, name: str, shape: tuple[int, ...], type_id: int, offset: int, file_size: int
) -> GGUFTensorInfo:
    import gguf

    if type_id not in gguf.GGMLQuantizationType._value2member_map_:
        raise UnsupportedGGUFError(
            f"{path}: tensor {name!r} has ggml type id {type_id}, which the installed gguf library "
            f"({_gguf_version()}) does not know; upgrade it (pip install -U gguf) or use a file quantized "
            "as F16, Q8_0, Q4_K_M or another common type"
        )
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    if not shape or shape[-1] % block:
        raise GGUFFormatError(
            f"{path} is corrupt: tensor {name!r} of shape {shape} and type {_type_name(type_id)} has rows "
            f"that are not a whole number of {block}-value blocks"
        )
    nbytes = math.prod(shape[:-1]) * (shape[-1] // block) * type_size
    if offset + nbytes > file_size:
        raise GGUFFormatError(
            f"{path} is truncated: tensor {name!r} ends at byte {offset + nbytes} but the file has "
            f"{file_size} bytes; re-download or re-convert the model"
        )
    return GGUFTensorInfo(name, shape, type_id, offset, nbytes)


def _type_name(type_id: int) -> str:
    import gguf

    member = gguf.GGMLQuantizationType._value2member_map_.get(type_id)
    return member.name if member is not None else f"type {type_id}"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gguf {version('gguf')}"
    except PackageNotFoundError:
        return "gguf"


@functools.cache
def _dequantizable(type_id: int) -> bool:
    """Whether `gguf.quants.dequantize` handles this type: tried on one zero block (cheap, public API)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(type_id)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _unsupported_type(info: GGUFTensorInfo) -> UnsupportedGGUFError:
    return UnsupportedGGUFError(
        f"tensor {info.name!r} is stored as {info.type_name}, which {_gguf_version()} cannot dequantize; "
        "use a file quantized as F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 or a K-quant (Q2_K..Q6_K), "
        "or upgrade gguf (pip install -U gguf)"
    )


def check_dequantizable(info: GGUFTensorInfo) -> None:
    if not _dequantizable(info.type_id):
        raise _unsupported_type(info)
