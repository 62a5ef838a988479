"""The safetensors header, read and checked in our own words before the safetensors library maps a file.

Layout (the safetensors format): 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON
`{name: {"dtype": D, "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data; offsets are relative to the data's start, and the tensors cover the data exactly, without gaps or
overlaps. The library enforces the same rules, but its messages are its own (`incomplete metadata, file not
fully covered`, `unknown variant ...`): this module names what is wrong, with the file and the tensor, and
checks every size against the file's before anything is allocated.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ...converters.errors import BadInput

__all__ = ["TensorEntry", "SafetensorsHeader", "read_header", "read_tensor", "Descriptors", "safetensors_tag", "DTYPE_BITS", "TORCH_DTYPES"]

# bits per element of every dtype the safetensors format defines (sub-byte types pack along the last axis)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
MAX_HEADER_BYTES = 100 * 1000 * 1000  # the library's own limit on the JSON header
# the torch dtype safetensors' own loader gives each one (safetensors.torch._TYPES); the sub-byte float
# types have none that holds one element per value, and are refused by read_tensor
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
                "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E8M0": "float8_e8m0fnu", "C64": "complex64"}


def safetensors_tag(dtype) -> str | None:
    """The safetensors dtype tag of a torch dtype (the inverse of TORCH_DTYPES), None when it has none."""
    return _TAG_OF_TORCH_NAME.get(str(dtype).removeprefix("torch."))


_TAG_OF_TORCH_NAME = {name: tag for tag, name in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]  # in the header's order
    metadata: dict[str, str]
    data_start: int  # byte offset of the data section in the file


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors file's header against the file's size; BadInput naming the file and
    tensor on the first problem."""
    path = Path(path)

    def bad(message: str, tensor: str | None = None) -> BadInput:
        return BadInput(f"cannot read safetensors file: {message}", path=path, tensor=tensor)

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise bad(f"the header claims {n} bytes (more than {MAX_HEADER_BYTES})")
            if 8 + n > size:
                raise bad(f"the header claims {n} bytes, the file holds {size - 8} after the length (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise BadInput(f"cannot read file ({e.strerror or type(e).__name__})", path=path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the header is not UTF-8 (byte {e.start + 8})") from None
    try:
        data = json.loads(text.rstrip(" "))  # writers may pad the header with spaces to align the data
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise bad("the header is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad("the header is not a JSON object")
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad("__metadata__ is not an object of strings")
    data_len = size - 8 - n
    tensors: dict[str, TensorEntry] = {}
    for name, info in data.items():
        if not name:  # no loader can ask for it, and a writer would carry it under no name
            raise bad("a tensor has an empty name")
        if not isinstance(info, dict):
            raise bad("header entry is not an object", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise bad(f"unknown dtype {_show(dtype)}", name)
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise bad(f"shape {_show(shape)} is not a list of sizes", name)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]):
            raise bad(f"data_offsets {_show(offsets)} are not [begin, end]", name)
        begin, end = offsets
        if end > data_len:
            raise bad(f"data ends at byte {end} of the data section, which holds {data_len} (truncated?)", name)
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits != (end - begin) * 8:
            raise bad(f"shape {tuple(shape)} of {dtype} needs {bits / 8:g} bytes, data_offsets hold {end - begin}", name)
        tensors[name] = TensorEntry(dtype, tuple(shape), begin, end)
    position = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != position:
            what = "overlaps the tensor before it" if t.begin < position else f"leaves bytes {position}..{t.begin} unused"
            raise bad(f"data {what}", name)
        position = t.end
    if position != data_len:
        raise bad(f"the tensors cover {position} bytes of data, the file holds {data_len}")
    return SafetensorsHeader(path, tensors, metadata, 8 + n)


def read_tensor(header: SafetensorsHeader, name: str, fd: int, outer: int | None = None):
    """One tensor's bytes read from an open file descriptor of header.path into a tensor of its own: exactly
    the bytes the checked header gives it are allocated, and no mapping of the file outlives the call (peak
    memory stays one tensor, however large the shard). Opening the file with safe_open for each tensor
    parses its header again and maps the whole file; the header here was checked once, by read_header.
    `outer`: read only that index of the first dimension (one expert of a stacked [experts, ...] tensor: a
    contiguous slab of the row-major bytes), shape entry.shape[1:]."""
    import torch

    entry = header.tensors[name]
    dtype = getattr(torch, TORCH_DTYPES.get(entry.dtype, ""), None)
    if dtype is None:
        raise BadInput(f"cannot read tensor (no torch dtype for {entry.dtype})", path=header.path, tensor=name)
    nbytes = entry.end - entry.begin
    shape = tuple(entry.shape)
    begin = entry.begin
    if outer is not None:
        if not shape or not 0 <= outer < shape[0]:
            raise BadInput(f"cannot read index {outer} of a tensor of shape {list(shape)}", path=header.path,
                           tensor=name)
        nbytes //= shape[0]
        begin += outer * nbytes
        shape = shape[1:]
    buf = bytearray(nbytes)
    view, got, offset = memoryview(buf), 0, header.data_start + begin
    try:
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                break
            got += n
    except OSError as e:
        raise BadInput(f"cannot read tensor ({e.strerror or type(e).__name__})", path=header.path,
                       tensor=name) from None
    if got != nbytes:  # the file shrank after its header was read
        raise BadInput(f"cannot read tensor (the file ends {nbytes - got} bytes short of it)", path=header.path,
                       tensor=name)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class Descriptors:
    """Open read-only descriptors of a few files, kept for the next tensor read (descriptors, not maps: a
    kept descriptor holds no memory). The least recently used is closed past `keep`."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._open: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self._open.pop(path, None)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise BadInput(f"cannot read file ({e.strerror or type(e).__name__})", path=path) from None
            while len(self._open) >= self.keep:
                os.close(self._open.pop(next(iter(self._open))))
        self._open[path] = fd  # most recently used last
        return fd

    def close(self) -> None:
        fds, self._open = self._open, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()
