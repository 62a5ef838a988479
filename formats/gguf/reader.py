"""GGUF reader: a llama.cpp model file (or a split set `name-0000i-of-0000N.gguf`) as tensor records.

A GGUF holds the whole model: metadata (`{arch}.*` hyper-parameters, `tokenizer.ggml.*`) and tensors in
ggml order under llama.cpp names, each in one ggml type. Reading turns it back into the intermediate:

- names back to Hugging Face names (`blk.0.attn_q.weight` -> `model.layers.0.self_attn.q_proj.weight`),
  llama's Q/K row permutation undone, so every record is in HF layout `[out, in]`;
- config.json from the metadata, tokenizer.json / tokenizer_config.json written from the token tables;
- F32/F16/BF16 tensors as `Dense`; the block types whose structure is a grid (legacy Q4_0..Q8_0 and the
  K types Q2_K..Q6_K) as `Grid`s whose float32 dequantization equals gguf-py's bit for bit, carrying
  the original block bytes as `PackedCodes(layout="ggml:<TYPE>")` so a writer of the same type copies
  blocks instead of re-encoding them; MXFP4 and NVFP4 as float grids (E2M1 codes times E8M0 / E4M3 block
  scales; an NVFP4 weight's `<name>.scale` tensor, which llama.cpp multiplies its matmul by, is the grid's
  "post" global scale, and is not a record of its own), also carrying their block bytes; every other type
  gguf-py can decode (IQ*, TQ*) as `Dense` float32 from `gguf.quants.dequantize` (their codebooks are not
  grids), IQ4_NL and IQ4_XS with their block bytes too (`CodebookDense`) so the same type copies them;
  the 1- and 2-bit types Q1_0, Q2_0, TQ1_0 and TQ2_0 as 2-bit grids `d * (q - z)` decoded as ggml's
  dequantize_row_* (kernels/ggml/lowbit.py; gguf-py has no Q1_0 decoder and gguf 0.19 no Q2_0 at all: its
  reader is given our facts for that type, `_Reader`). Q2_0 is 64-value blocks upstream and 128-value ones in
  PrismML's fork, under one type id: which one a file holds is read from its tensors' byte extents
  (`_resolve_q2_0`), never from the tag.

Files are memory-mapped and tensors are read one at a time. Before gguf-py's reader sees a file, a
bounded walk of its header (`scan_header`) checks every count and length against the bytes that remain,
every string for UTF-8, every tensor's extent and offset as llama.cpp lays them out, and that the tensors
cover the data section; then the metadata is checked against the tensors (shapes, layers, required
tensors: `metadata.check_gguf_tensors`). A bad file is one BadInput naming the key, tensor or offset.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import re
import shutil
import struct
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import torch

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, GridParams, NativeForm, PackedCodes, TensorRecord, unused_zeros
from ...kernels.ggml.kblocks import K_ZERO_POINT, unpack_k_blocks
from ...kernels import floatq
from ...kernels.ggml.layouts import CODEBOOK_LAYOUTS, FP4_LAYOUTS, GGUF_PY_UNKNOWN, LAYOUTS, LOWBIT_LAYOUTS, Q2_0_PRISM
from ...kernels.ggml.lowbit import ZERO_POINT, dequantize_lowbit, unpack_lowbit
from ...kernels.ggml.legacy import unpack_blocks
from .checks import check_gguf_tensors
from .config import config_from_gguf, field_values
from .archs import KV_B_HALVES, arch_by_name, merge_gpt_oss_experts, merge_kv_b, merge_llama4_experts
from .names import expert_member, hf_tensor_name, inverse_permutation, is_expert_stack, is_own_name, qk_row_permutation
from .tokenizer import tokenizer_files_from_gguf
from ...converters.records import ModelSource

__all__ = ["GgufSource", "GgufHeader", "scan_header", "split_parts", "SPLIT_NAME", "GRID_TYPES"]

# a part of a split set, as gguf-split and llama.cpp name them
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_FLOAT = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "F64": (np.float64, torch.float64)}
# ggml's integer types: no model tensor is one (GgufSource._refuse_integer_weights)
_INTEGER = frozenset({"I8", "I16", "I32", "I64"})
# ggml types read as grids: the layout table's block types. Others gguf-py decodes become float32.
GRID_TYPES = tuple(name for name, lay in LAYOUTS.items() if lay.kind != "float")
# tensors llama.cpp derives from the config (the writer recomputes them): skipped, not refused
_DERIVED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# per-tensor scales beside a quantized weight (llama-model.cpp's generic pass: NVFP4's global scale as `.scale`;
# `.input_scale`, an activation scale llama.cpp loads but does not use): read with their weight, not records
_WEIGHT_SCALE = re.compile(r"^(?P<weight>.+)\.(?P<kind>scale|input_scale)$")
_KV_B_HALF = re.compile(r"^blk\.(?P<block>0|[1-9][0-9]*)\.attn_(?P<half>[kv])_b\.weight$")
# gpt-oss's expert stacks (and their biases), which transformers holds fused: archs.merge_gpt_oss_experts
_GPT_OSS_STACK = re.compile(r"^blk\.(?P<block>0|[1-9][0-9]*)\.ffn_(?P<role>gate|up|down)_exps\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class CodebookDense(Dense):
    """An IQ4_NL / IQ4_XS tensor: gguf-py's float32 decoding (a codebook is not a grid), with the file's block
    bytes in HF row order (`PackedCodes` "ggml:<TYPE>", uint8 [rows, row_bytes]) that a GGUF writer of the
    same type copies (formats/gguf/schemes.py: verdict exact)."""

    packed: PackedCodes | None = None

    def permute_rows(self, perm: torch.Tensor) -> "CodebookDense":
        """Rows reordered, values and block bytes alike (a row is whole blocks: exact); the GGUF writer's
        q/k row order, as for a Grid."""
        return CodebookDense(self.tensor[perm], self.packed.take_rows(perm))


_BLOCK_INDEX = re.compile(r"^blk\.(0|[1-9][0-9]*)\.")


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF given any of them (`x-00002-of-00003.gguf` -> parts 1..3); [path] for
    a single file. A missing part raises BadInput naming it."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise BadInput(f"split name says part {int(m['no'])} of {count}", path=path)
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in parts:
        if not p.is_file():
            raise BadInput(f"split GGUF part {p.name} is missing ({count} parts expected)", path=p)
    return parts


# --------------------------------------------------------------------------------------------------
# A bounded walk of the GGUF header, before gguf-py sees the file
# --------------------------------------------------------------------------------------------------
# Layout (llama.cpp ggml/src/gguf.cpp): magic "GGUF", uint32 version, uint64 tensor count, uint64 KV
# count; per KV a string key (uint64 length + UTF-8 bytes), a uint32 value type and the value (arrays:
# uint32 element type, uint64 count, the elements; arrays of arrays are invalid); per tensor a string
# name (< 64 bytes), uint32 n_dims (<= 4), uint64 dims (ne0 first), uint32 ggml type, uint64 offset
# into the data section; the data section starts at the next multiple of general.alignment (uint32,
# a power of two, default 32), and each tensor starts where the one before it ends, padded to the
# alignment (llama.cpp refuses any other offset).
# gguf-py's reader loops once per declared array element and builds numpy views for each, and maps
# tensors without comparing their extent to the file: every count is bounded here by the bytes left.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
_STRING, _ARRAY = 8, 9
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # a one-byte name, n_dims 0, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME = 64  # GGML_MAX_NAME: names are shorter
_MAX_ARRAY = 1 << 24  # elements in one metadata array (real files: ~262k tokens); gguf-py makes a view per element
_DEFAULT_ALIGNMENT = 32


@dataclass
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (ne0 first)
    type_id: int
    offset: int  # into the data section
    nbytes: int
    info_at: int  # byte offset of the tensor info in the file
    block: int = 0  # Q2_0: the block size its byte extent shows (64 upstream, 128 PrismML), else 0


@dataclass
class GgufHeader:
    """What the bounded walk found: scalar metadata values, the tensor infos, where data starts."""
    path: Path
    size: int
    version: int
    kv_types: dict[str, tuple[int, int | None]]  # key -> (value type, element type of an array)
    scalars: dict[str, object]  # scalar and string values
    tensors: list[_TensorInfo]
    alignment: int
    data_offset: int


class _Walk:
    def __init__(self, path: Path, buf, size: int, order: str):
        self.path, self.buf, self.size, self.order, self.pos = path, buf, size, order, 0

    def fail(self, message: str, tensor: str | None = None) -> BadInput:
        return BadInput(message, path=self.path, tensor=tensor)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated header: {what} at byte {self.pos} needs {n} bytes, the file has "
                            f"{max(0, self.size - self.pos)} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return values if len(values) > 1 else values[0]

    def string(self, what: str, limit: int | None = None) -> str:
        at = self.pos
        n = self.unpack("Q", f"the length of {what}")
        if limit is not None and n >= limit:
            raise self.fail(f"{what} at byte {at} is {n} bytes long (llama.cpp allows fewer than {limit})")
        if n > self.size - self.pos:
            raise self.fail(f"{what} at byte {at} says {n} bytes but only {self.size - self.pos} remain in the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {at} is not valid UTF-8 (byte {at + 8 + e.start})") from None

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings in a row, each checked to lie in the file and to be UTF-8."""
        unpack, order, buf, size = struct.unpack_from, self.order + "Q", self.buf, self.size
        pos = self.pos
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"{what}: element {i} of {count} at byte {pos} runs past the end of the file")
            (n,) = unpack(order, buf, pos)
            pos += 8
            if n > size - pos:
                raise self.fail(f"{what}: element {i} of {count} at byte {pos - 8} says {n} bytes but only "
                                f"{size - pos} remain in the file")
            try:
                bytes(buf[pos:pos + n]).decode("utf-8")
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}: element {i} at byte {pos - 8} is not valid UTF-8 "
                                f"(byte {pos + e.start})") from None
            pos += n
        self.pos = pos


def _ggml_type_facts(type_id: int):
    """(type name, elements per block, bytes per block) from gguf-py, or from our layout table for the types this
    llama.cpp has and gguf 0.19 lacks (Q2_0); None for an unknown id."""
    if type_id in GGUF_PY_UNKNOWN:
        lay = GGUF_PY_UNKNOWN[type_id]
        return lay.name, lay.block, lay.nbytes
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return None
    return qtype.name, block, type_size


def _resolve_q2_0(w, tensors: list, data_offset: int, size: int, alignment: int) -> None:
    """Which Q2_0 a file holds, from where its Q2_0 tensors' data ends: upstream's 64-value blocks of 18 bytes or
    PrismML's 128-value blocks of 34 bytes (the same type id 42). Each tensor's extent is the distance to the next
    tensor's offset (the last one's: to the end of the file, less than one alignment of padding after it); the
    variant is the one every Q2_0 tensor of the file fits. A file where none fits is refused; where both fit every
    tensor (each under 2048 values, too small to tell) the upstream one is read. Sets each tensor's nbytes and block."""
    q2 = [i for i, t in enumerate(tensors) if t.type_id == 42]
    if not q2:
        return
    fits = {64: True, 128: True}
    for i in q2:
        t = tensors[i]
        n = t.nbytes // LOWBIT_LAYOUTS["Q2_0"].nbytes * 64  # elements (the scan sized it as upstream's)
        for lay in (LOWBIT_LAYOUTS["Q2_0"], Q2_0_PRISM):
            nbytes = n // lay.block * lay.nbytes if n % lay.block == 0 else -1
            padded = -(-nbytes // alignment) * alignment
            if i + 1 < len(tensors):
                ok = nbytes >= 0 and tensors[i + 1].offset - t.offset == padded
            else:
                rest = size - data_offset - t.offset
                ok = nbytes >= 0 and nbytes <= rest < nbytes + alignment
            fits[lay.block] = fits[lay.block] and ok
    block = 64 if fits[64] else 128 if fits[128] else 0
    if not block:
        t = tensors[q2[0]]
        raise w.fail(f"Q2_0 tensor data fits neither 64-value blocks of 18 bytes (llama.cpp) nor 128-value blocks "
                     f"of 34 bytes (PrismML) for every Q2_0 tensor (dims {list(t.dims)})", tensor=t.name)
    lay = LOWBIT_LAYOUTS["Q2_0"] if block == 64 else Q2_0_PRISM
    for i in q2:
        t = tensors[i]
        t.nbytes = t.nbytes // LOWBIT_LAYOUTS["Q2_0"].nbytes * 64 // lay.block * lay.nbytes
        t.block = block


def scan_header(path: Path) -> GgufHeader:
    """Walk a GGUF file's header with every count bounded by the bytes that remain, and check the
    tensor data layout as llama.cpp does; BadInput naming the key, tensor or byte offset otherwise.
    Reads only the header (the file is memory-mapped), so it stays fast on files of any size."""
    path = Path(path)
    if not path.is_file():
        raise BadInput("file not found", path=path)
    size = path.stat().st_size
    if size < 24:
        raise BadInput(f"not a GGUF file ({size} bytes, shorter than a GGUF header)", path=path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _scan(path, mm, size)


def _scan(path: Path, mm, size: int) -> GgufHeader:
    if mm[:4] != b"GGUF":
        raise BadInput("not a GGUF file (no GGUF magic)", path=path)
    (version,) = struct.unpack_from("<I", mm, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf-py and llama.cpp read it)
        order, (version,) = ">", struct.unpack_from(">I", mm, 4)
    if version not in (2, 3):
        raise BadInput(f"GGUF version {version} is not supported (versions 2 and 3 are)", path=path)
    w = _Walk(path, mm, size, order)
    w.pos = 8
    n_tensors, n_kv = w.unpack("QQ", "the tensor and key counts")
    if n_kv * _MIN_KV_BYTES > size - w.pos:
        raise w.fail(f"header says {n_kv} metadata keys, more than the {size} byte file can hold")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > size - w.pos:
        raise w.fail(f"header says {n_tensors} tensors, more than the {size} byte file can hold")
    kv_types: dict[str, tuple[int, int | None]] = {}
    scalars: dict[str, object] = {}
    for i in range(n_kv):
        at = w.pos
        key = w.string(f"metadata key {i} of {n_kv}")
        if key in kv_types:
            raise w.fail(f"metadata key {key} appears twice (again at byte {at})")
        vtype = w.unpack("I", f"the type of metadata {key}")
        if vtype == _ARRAY:
            etype, count = w.unpack("IQ", f"the element type and count of metadata {key}")
            if etype == _ARRAY:
                raise w.fail(f"metadata {key} at byte {at} is an array of arrays, which GGUF readers do not accept")
            if etype != _STRING and etype not in _SCALAR_SIZES:
                raise w.fail(f"metadata {key} at byte {at} is an array of unknown type id {etype}")
            if count > _MAX_ARRAY:
                raise w.fail(f"metadata {key} at byte {at} declares {count} elements (more than {_MAX_ARRAY} "
                             "is not a model's metadata)")
            esize = 8 if etype == _STRING else _SCALAR_SIZES[etype]
            if count * esize > size - w.pos:
                raise w.fail(f"metadata {key} at byte {at} declares {count} {_TYPE_NAMES[etype]} elements "
                             f"({count * esize} bytes at least) but only {size - w.pos} bytes remain")
            if etype == _STRING:
                w.skip_strings(count, f"metadata {key}")
            else:
                w.pos += count * esize
            kv_types[key] = (vtype, etype)
        elif vtype == _STRING:
            scalars[key] = w.string(f"the value of metadata {key}")
            kv_types[key] = (vtype, None)
        elif vtype in _SCALAR_SIZES:
            scalars[key] = w.unpack(_SCALAR_FORMATS[vtype], f"the value of metadata {key}")
            kv_types[key] = (vtype, None)
        else:
            raise w.fail(f"metadata {key} at byte {at} has unknown value type id {vtype}")

    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in kv_types:
        if kv_types["general.alignment"] != (4, None):
            raise w.fail("metadata general.alignment is not a UINT32")
        alignment = int(scalars["general.alignment"])
        if alignment == 0 or alignment & (alignment - 1):
            raise w.fail(f"metadata general.alignment is {alignment}, not a power of two")

    tensors: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        at = w.pos
        name = w.string(f"the name of tensor {i} of {n_tensors}", limit=_MAX_NAME)
        if name in seen:
            raise w.fail("tensor appears twice in the tensor infos", tensor=name)
        seen.add(name)
        n_dims = w.unpack("I", f"the dimension count of tensor {name}")
        if n_dims > _MAX_DIMS:
            raise w.fail(f"tensor info at byte {at} says {n_dims} dimensions (at most {_MAX_DIMS})", tensor=name)
        dims = w.unpack("Q" * n_dims, f"the dimensions of tensor {name}") if n_dims else ()
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        type_id, offset = w.unpack("IQ", f"the type and offset of tensor {name}")
        facts = _ggml_type_facts(type_id)
        if facts is None:
            raise w.fail(f"unknown ggml type id {type_id}", tensor=name)
        qname, block, type_size = facts
        n_elems = 1
        for d in dims:
            n_elems *= d
        if n_elems >= 1 << 63:
            raise w.fail(f"dimensions {list(dims)} hold {n_elems} elements, more than a GGUF can", tensor=name)
        if dims and dims[0] % block:
            raise w.fail(f"rows of {dims[0]} elements are not whole {qname} blocks of {block}", tensor=name)
        tensors.append(_TensorInfo(name, dims, type_id, offset, n_elems // block * type_size, at))

    data_offset = -(-w.pos // alignment) * alignment
    _resolve_q2_0(w, tensors, data_offset, size, alignment)
    expected = 0
    for i, t in enumerate(tensors):
        if t.offset != expected:
            prev = tensors[i - 1] if i else None
            if prev is None:
                raise w.fail(f"tensor data starts at offset {t.offset} of the data section, not at 0 "
                             "(the tensor infos or the key/tensor counts were altered)", tensor=t.name)
            raise w.fail(f"tensor data starts at offset {t.offset} of the data section, but {prev.name} "
                         f"(dims {list(prev.dims)}, {_type_label(prev.type_id)}) ends at {expected}: the "
                         "tensor infos contradict each other", tensor=t.name)
        end = data_offset + t.offset + t.nbytes
        if end > size:
            raise w.fail(f"truncated: tensor data ends at byte {end} but the file has {size}", tensor=t.name)
        expected = t.offset + -(-t.nbytes // alignment) * alignment
    if tensors:
        last = tensors[-1]
        end = data_offset + last.offset + last.nbytes
        if size - end >= alignment:
            raise w.fail(f"{size - end} bytes follow the last tensor's data (dims {list(last.dims)}): the file holds "
                         "more than its tensor infos describe (was the tensor count altered?)", tensor=last.name)
    return GgufHeader(path, size, version, kv_types, scalars, tensors, alignment, data_offset)


def _type_label(type_id: int) -> str:
    facts = _ggml_type_facts(type_id)
    return facts[0] if facts else f"type {type_id}"


@contextlib.contextmanager
def quiet_libraries():
    """gguf-py, numpy and torch may warn (or log) while a file is mapped; nothing of theirs may reach
    stderr before our own error line, whatever the caller set up."""
    loggers = [logging.getLogger(n) for n in ("gguf", "gguf.gguf_reader", "numpy")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR + 1)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


class _Reader(gguf.GGUFReader):
    """gguf-py's reader, told the tensors of the types gguf 0.19 does not know (Q2_0) by our header walk: those
    become ReaderTensors of uint8 block bytes [rows, row_bytes] whose tensor_type is the plain type id (42), and
    the others are gguf-py's own, in file order."""

    def __init__(self, path: Path, header: GgufHeader):
        self._header_infos = {t.name: t for t in header.tensors}
        super().__init__(str(path), "r")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        known = [f for f in fields if int(f.parts[4][0]) not in GGUF_PY_UNKNOWN]
        super()._build_tensors(start_offs, known)
        if len(known) == len(fields):
            return
        theirs = iter(self.tensors)
        tensors = []
        for field in fields:
            if int(field.parts[4][0]) not in GGUF_PY_UNKNOWN:
                tensors.append(next(theirs))
                continue
            name = str(bytes(field.parts[1]), encoding="utf-8")
            info = self._header_infos[name]
            dims = field.parts[3]
            n_elems = int(np.prod(dims))
            data_offs = int(start_offs + field.parts[5][0])
            byte_shape = (*reversed([int(d) for d in dims[1:]]), info.nbytes // max(1, n_elems // int(dims[0])))
            tensors.append(gguf.gguf_reader.ReaderTensor(
                name=name, tensor_type=int(field.parts[4][0]), shape=dims, n_elements=n_elems, n_bytes=info.nbytes,
                data_offset=data_offs, data=self._get(data_offs, np.uint8, info.nbytes).reshape(byte_shape),
                field=field))
        self.tensors = tensors


def _open(path: Path) -> tuple[gguf.GGUFReader, GgufHeader]:
    """The header walked and checked first (scan_header), then gguf-py's reader over the same bytes."""
    header = scan_header(path)
    try:
        with quiet_libraries():
            reader = _Reader(path, header)
    except Exception:  # noqa: BLE001 - the walk accepted the header; gguf-py disagreeing is still bad input
        raise BadInput("GGUF header that gguf-py cannot parse although its layout is consistent", path=path) from None
    if len(reader.tensors) != len(header.tensors) or any(
            t.name != h.name or int(t.data_offset) != header.data_offset + h.offset
            for t, h in zip(reader.tensors, header.tensors)):
        raise BadInput("gguf-py reads a different tensor layout than the header describes", path=path)
    return reader, header


def _gguf_py_decodes(qtype) -> bool:
    """True when gguf-py has a dequantizer for this ggml type (it registers one class per type)."""
    return int(qtype) in {int(k) for k in getattr(gguf.quants, "_type_traits", {})}


def _block_bytes(t, lay, path: Path, inv, expert=None) -> torch.Tensor:
    """A block-quantized tensor's bytes as uint8 [rows, row_bytes] in HF row order (`inv`: llama's q/k rows put
    back; rows are whole blocks, so permuting byte rows is exact), one expert's rows of a stack (`expert`:
    (index, count), experts outermost), rows that are not whole blocks refused. A 3-D tensor read whole (an MLA
    half) has its leading dims flattened into rows, as ggml lays it out."""
    in_features = int(t.shape[0])
    out_features = int(t.shape[1]) if expert is not None else int(np.prod([int(d) for d in t.shape[1:]]))
    if in_features % lay.block:
        raise BadInput(f"rows of {in_features} are not whole {lay.name} blocks of {lay.block}", path=path,
                       tensor=t.name)
    data = np.asarray(t.data)
    if expert is not None:
        data = data.reshape(expert[1], -1)[expert[0]]
    words = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(out_features, lay.row_bytes(in_features)))
    return words[inv].contiguous() if inv is not None else words


def _codebook_float32(data: np.ndarray, type_name: str, qtype) -> np.ndarray:
    """A codebook type's blocks decoded to float32 as ggml decodes them: IQ1_S / IQ1_M by kernels/ggml/iq1.py (C,
    about 30x gguf-py's numpy decoder, the same values: the giant models' smallest GGUFs are IQ1), the others by
    gguf-py."""
    if type_name in ("IQ1_S", "IQ1_M"):
        from ...kernels.ggml import iq1

        data = np.ascontiguousarray(data, dtype=np.uint8)
        n = data.shape[-1] // iq1.IQ1_BYTES[type_name] * 256
        decode = iq1.dequantize_iq1_s if type_name == "IQ1_S" else iq1.dequantize_iq1_m
        return decode(data.reshape(-1, data.shape[-1]), n).reshape(*data.shape[:-1], n)
    return np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def _type_name(t) -> str:
    if int(t.tensor_type) in GGUF_PY_UNKNOWN:
        return GGUF_PY_UNKNOWN[int(t.tensor_type)].name
    try:
        return gguf.GGMLQuantizationType(int(t.tensor_type)).name
    except ValueError:
        return f"type {int(t.tensor_type)}"


class GgufSource(ModelSource):
    """A GGUF model (one file or every part of a split set) as a lazy stream of HF-named records. Read from a
    folder (folder.find_model), `folder` is that folder and `ignored_files` the GGUFs beside the model that
    are not part of it."""

    format_name = "gguf"

    def __init__(self, path: Path, folder: Path | None = None, ignored_files: dict[str, str] | None = None):
        self.parts = split_parts(Path(path))
        self.path = self.parts[0]
        self.folder = folder
        self._ignored_files = dict(ignored_files or {})
        opened = [_open(p) for p in self.parts]
        self.readers = [r for r, _ in opened]
        self.headers = [h for _, h in opened]
        self._check_split()
        first = self.readers[0]
        names = [t.name for r in self.readers for t in r.tensors]
        if len(set(names)) != len(names):
            seen: set[str] = set()
            dup = next(n for n in names if n in seen or seen.add(n))
            raise BadInput("tensor appears twice across the split parts", path=self.path, tensor=dup)
        with quiet_libraries():
            self.kv = field_values(first)
        self.fields = first.fields
        self.config = config_from_gguf(self.kv, names, path=self.path)
        self.arch = self.kv.get("general.architecture")
        self.n_layers = int(self.config["num_hidden_layers"])
        # the multi-token-prediction blocks after the trunk (archs/mtp.py) when the file holds them (a file that
        # declares them without their tensors is llama.cpp's "trunk only" case)
        self.mtp = arch_by_name(self.arch).mtp
        nextn = int(self.kv.get(f"{self.arch}.nextn_predict_layers") or 0) if self.mtp and self.mtp.kept else 0
        self.mtp_blocks = nextn if any(_BLOCK_INDEX.match(n) and int(_BLOCK_INDEX.match(n)[1]) >= self.n_layers
                                       for n in names) else 0
        self.norm_shift = arch_by_name(self.arch).norm_shift
        self._longrope_config(names)
        self.mla = arch_by_name(self.arch).mla
        # every tensor checked against the metadata before any is read or any loop runs per layer
        check_gguf_tensors({**self.config, "num_hidden_layers": self.n_layers + self.mtp_blocks}, self.arch, {t.name: tuple(int(d) for d in reversed(list(t.shape)))
                                                    for r in self.readers for t in r.tensors},
                           path=self.path, where={t.name: p for p, r in zip(self.parts, self.readers)
                                                  for t in r.tensors})
        self._refuse_integer_weights()
        types = {_type_name(t) for r in self.readers for t in r.tensors}
        quantized = sorted(t for t in types if t not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"))
        self.quant_config: dict = ({"quant_method": "gguf", "file_type": self.kv.get("general.file_type"),
                                    "types": quantized} if quantized else {})
        self._tokenizer_dir: Path | None = None

    def _refuse_integer_weights(self) -> None:
        """Every tensor of a llama.cpp model is a float operand (norms, embeddings, linear weights, the rope and
        scale tables beside them): no writer stores one as I8..I64, and llama.cpp does not compute with one (an
        I32 norm aborts its CPU backend: "binary_op: unsupported types"). One relabelled to an integer type
        would read as integers (a norm F32 -> I32: values near 1e9), so it is refused, naming file and tensor."""
        tables = arch_by_name(self.arch).integer_tensors  # an architecture's I32 tables (DeepSeek-V4's tid2eid)
        for path, reader in zip(self.parts, self.readers):
            for t in reader.tensors:
                if _type_name(t) == "I32" and tables is not None and tables.search(t.name):
                    continue
                if _type_name(t) in _INTEGER:
                    raise BadInput(f"ggml type {_type_name(t)} is an integer type, but every tensor of a llama.cpp "
                                   "model is a float weight (F32, F16, BF16, F64 or a quantized block type)",
                                   path=path, tensor=t.name)

    def _longrope_config(self, names: list[str]) -> None:
        """Phi-3's longrope: the factor tables are tensors in the GGUF and lists in config.json."""
        if "rope_factors_long.weight" not in names:
            return
        tables = {t.name: t for r in self.readers for t in r.tensors if t.name.startswith("rope_factors_")}
        if set(tables) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise BadInput("rope_factors_long.weight without rope_factors_short.weight (longrope needs both)",
                           path=self.path)
        factors = {}
        for key, name in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
            t = tables[name]
            if _type_name(t) != "F32" or len(t.shape) != 1:
                raise BadInput(f"{_type_name(t)} tensor of shape {list(t.shape)}: longrope factors are 1-D F32",
                               path=self.path, tensor=name)
            factors[key] = [float(x) for x in np.asarray(t.data, dtype=np.float32)]
        scaling = {"rope_type": "longrope", **factors}
        orig = self.config.get("original_max_position_embeddings")
        if orig:
            scaling["original_max_position_embeddings"] = orig
        self.config["rope_scaling"] = scaling

    def _check_split(self) -> None:
        """Each part's split.no / split.count agree with its name (llama.cpp's gguf-split writes both, and
        split.tensors.count in the first part); a file named as one part of no set must not claim one."""
        n = len(self.parts)
        for i, (p, h) in enumerate(zip(self.parts, self.headers)):
            no, count = h.scalars.get("split.no"), h.scalars.get("split.count")
            if n == 1:
                if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count > 1):
                    raise BadInput(f"metadata split.count is {count!r}: the file is one part of a split set, but its "
                                   "name has no -0000i-of-0000N.gguf suffix to find the other parts by", path=p)
                continue
            for key, value in (("split.no", no), ("split.count", count)):
                if value is None:
                    raise BadInput(f"split part without metadata {key} (every part of a split set carries "
                                   "split.no and split.count)", path=p)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise BadInput(f"metadata {key} is {value!r}: expected an integer", path=p)
            if no != i or count != n:
                raise BadInput(f"metadata says split part {no + 1} of {count}, the name says {i + 1} of {n}", path=p)
        if n > 1:
            total = self.headers[0].scalars.get("split.tensors.count")
            found = sum(len(h.tensors) for h in self.headers)
            if total is not None and total != found:
                raise BadInput(f"metadata split.tensors.count says {total!r} tensors, the {n} parts hold {found}",
                               path=self.parts[0])

    # -- one tensor ----------------------------------------------------------------------------
    def _hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor, an MTP block's put back where the architecture's checkpoints keep it."""
        name = hf_tensor_name(gguf_name, self.arch, self.n_layers + self.mtp_blocks)
        if name is not None and self.mtp_blocks:
            name = self.mtp.from_layer(name, self.n_layers)
        return name

    def _records(self, path: Path, t) -> Iterator[TensorRecord]:
        """The records of one GGUF tensor: itself, or one per expert of a stacked expert tensor
        (`blk.N.ffn_up_exps.weight` [n_expert, rows, cols] -> `...experts.<e>.up_proj.weight` each)."""
        own = is_own_name(t.name, self.arch)  # the architecture's own names (archs: tensor_names)
        if t.name in _DERIVED or (_WEIGHT_SCALE.match(t.name) and not own):
            return
        name = self._hf_name(t.name)
        if name is None:
            raise BadInput(f"GGUF tensor has no Hugging Face counterpart in arch {self.arch}", path=path, tensor=t.name)
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        if own and len(shape) == 3 and _type_name(t) not in _FLOAT and _type_name(t) != "BF16":
            # a quantized expert stack the HF class keeps fused (Gemma 4): decoded whole to float32, as the
            # grid records (2-D blocks, one expert each) cannot hold the fused tensor
            def load(t=t, shape=shape) -> Dense:
                return Dense(torch.from_numpy(self._float32(t)).reshape(shape))

            yield TensorRecord(name, shape, "float32", load, source_file=str(path), source_name=t.name)
            return
        if is_expert_stack(t.name) and not own:
            if len(shape) != 3:
                raise BadInput(f"stacked expert tensor of shape {list(shape)}: expected [experts, rows, columns]",
                               path=path, tensor=t.name)
            for e in range(shape[0]):  # bounded: check_gguf_tensors matched shape[0] with expert_count
                yield self._record(path, t, expert_member(name, e), shape[1:], (e, shape[0]))
            return
        yield self._record(path, t, name, shape, None)

    def _record(self, path: Path, t, name: str, shape: tuple[int, ...], expert: tuple[int, int] | None,
                rows_flattened: bool = False) -> TensorRecord:
        """One record: tensor `t` whole, or rows of expert `expert = (index, count)` of a stack. With
        `rows_flattened` a 3-D block tensor is read as the grid of its flattened rows under its 3-D shape (the MLA
        halves: what the GGUF writer takes back as such, _kv_b_record)."""
        type_name = _type_name(t)
        block_dims = (2, 3) if rows_flattened else (2,)
        perm = qk_row_permutation(name, self.config, self.arch)
        inv = None if perm is None else inverse_permutation(perm)
        where = str(path)
        label = t.name if expert is None else f"{t.name}[expert {expert[0]}]"
        if type_name in FP4_LAYOUTS:
            if len(shape) not in block_dims:
                raise BadInput(f"{type_name} tensor of shape {shape}: only 2-D block tensors are supported",
                               path=path, tensor=t.name)
            params = self._fp4_parts(t, type_name, path, inv, with_codes=False, expert=expert)[0]
            return TensorRecord(name, shape, "grid", lambda: self._fp4_grid(t, type_name, path, inv, expert),
                                params=params, source_file=where, native_type=type_name, source_name=label)
        if type_name in LOWBIT_LAYOUTS:
            if len(shape) not in block_dims:
                raise BadInput(f"{type_name} tensor of shape {shape}: only 2-D block tensors are supported",
                               path=path, tensor=t.name)
            lay = self._lowbit_layout(t)
            params = self._lowbit_parts(t, lay, path, inv, with_codes=False, expert=expert)[0]
            prism = lay is Q2_0_PRISM  # PrismML's 128-blocks: not upstream Q2_0's blocks, never copied as them
            return TensorRecord(name, shape, "grid", lambda: self._lowbit_grid(t, lay, path, inv, expert),
                                params=params, source_file=where, native_type=None if prism else type_name,
                                source_name=label)
        if type_name in GRID_TYPES:
            if len(shape) not in block_dims:
                raise BadInput(f"{type_name} tensor of shape {shape}: only 2-D block tensors are supported",
                               path=path, tensor=t.name)
            params = self._grid_parts(t, type_name, path, inv, with_codes=False, expert=expert)[0]
            return TensorRecord(name, shape, "grid", lambda: self._grid(t, type_name, path, inv, expert), params=params,
                                source_file=where, native_type=type_name, source_name=label)
        if type_name == "I32":  # an integer table the architecture declares (_refuse_integer_weights let it pass)
            return TensorRecord(name, shape, "int32",
                                lambda: Dense(torch.from_numpy(np.array(t.data, dtype=np.int32)).reshape(shape)),
                                source_file=where, source_name=label)
        if type_name in _FLOAT or type_name == "BF16":
            dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}[type_name]
        elif _gguf_py_decodes(t.tensor_type):
            dtype = "float32"
        else:
            raise BadInput(f"ggml type {type_name} cannot be decoded (gguf-py has no dequantizer for it)",
                           path=path, tensor=t.name)
        shift = self.norm_shift if arch_by_name(self.arch).shifts_norm(t.name) else 0.0
        if shift and dtype != "float32":
            dtype = "float32"  # w = stored - 1 is computed in float32
        return TensorRecord(name, shape, dtype, lambda: self._dense(t, type_name, shape, inv, expert, shift),
                            source_file=where, native_type=None if shift else type_name, source_name=label)

    def _dense(self, t, type_name: str, shape: tuple[int, ...], inv, expert=None, shift: float = 0.0) -> Dense:
        data = np.asarray(t.data)
        if expert is not None:  # experts are outermost: expert e is the e-th of n equal slices
            data = data.reshape(expert[1], -1)[expert[0]]
        if type_name in _FLOAT:
            x = torch.from_numpy(np.array(data, dtype=_FLOAT[type_name][0]))
        elif type_name == "BF16":
            x = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        else:  # IQ*, TQ*, MXFP4, NVFP4...: codebooks, not grids -> their float32 decoding
            x = torch.from_numpy(_codebook_float32(data, type_name, t.tensor_type))
        x = x.reshape(shape)
        if inv is not None:
            x = x[inv].contiguous()
        if shift:  # Gemma: the file holds 1 + w (llama.cpp multiplies by it), transformers keeps w
            x = x.to(torch.float32) - shift
        elif type_name in CODEBOOK_LAYOUTS:  # IQ4_NL / IQ4_XS: the block bytes too, for a writer of the same type
            row_bytes = CODEBOOK_LAYOUTS[type_name].row_bytes(shape[-1])
            words = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, row_bytes))
            if inv is not None:  # rows are whole blocks: permuting byte rows is exact
                words = words[inv].contiguous()
            return CodebookDense(x, PackedCodes(words, 4, f"ggml:{type_name}"))
        return Dense(x)

    def _tensor_named(self, name: str):
        """(path, tensor) of a tensor of any part by its GGUF name, or None."""
        if getattr(self, "_by_name", None) is None:
            self._by_name = {t.name: (p, t) for p, r in zip(self.parts, self.readers) for t in r.tensors}
        return self._by_name.get(name)

    def _post_scale(self, t, path: Path, expert) -> torch.Tensor | None:
        """The float32 `.scale` llama.cpp multiplies an NVFP4 weight's matmul by ([1], or [experts] for a stack)."""
        found = self._tensor_named(t.name.removesuffix(".weight") + ".scale")
        if found is None:
            return None
        spath, s = found
        want = expert[1] if expert is not None else 1
        values = np.asarray(s.data)
        if _type_name(s) != "F32" or values.size != want:
            raise BadInput(f"{s.name} is {_type_name(s)} with {values.size} values: expected F32 with {want} "
                           f"(the per-tensor scale of {t.name})", path=spath, tensor=s.name)
        return torch.tensor(float(values.reshape(-1)[expert[0] if expert is not None else 0]), dtype=torch.float32)

    def _fp4_grid(self, t, type_name: str, path: Path, inv, expert=None) -> Grid:
        params, codes, words = self._fp4_parts(t, type_name, path, inv, with_codes=True, expert=expert)
        return Grid(params, codes, PackedCodes(words, 4, f"ggml:{type_name}"))

    def _fp4_parts(self, t, type_name: str, path: Path, inv, with_codes: bool, expert=None):
        """MXFP4 / NVFP4 blocks as a float grid: E2M1 codes, E8M0 (MXFP4) or E4M3 (NVFP4: UE4M3, whose bytes 0
        and 0x7F both decode to 0 in ggml) scales, NVFP4's `.scale` as a "post" global scale."""
        in_features = int(t.shape[0])
        words = _block_bytes(t, FP4_LAYOUTS[type_name], path, inv, expert)
        unpack = floatq.unpack_ggml_mxfp4 if type_name == "MXFP4" else floatq.unpack_ggml_nvfp4
        codes, scale_bytes = unpack(words.numpy(), in_features)
        scale_bytes = torch.from_numpy(scale_bytes)
        if type_name == "MXFP4":
            scales, group, post = scale_bytes.view(torch.float8_e8m0fnu), 32, None
        else:
            scales = torch.where(scale_bytes == 0x7F, 0, scale_bytes & 0x7F).to(torch.uint8).view(torch.float8_e4m3fn)
            group, post = 16, self._post_scale(t, path, expert)
        params = GridParams(bits=4, group_size=group, scales=scales, zeros=unused_zeros(scales.shape),
                            codebook=floatq.element_table("e2m1", negative_zero=False),  # ggml's kvalues: code 8 is 0
                            global_scale=post, global_scale_op="post")
        return params, (torch.from_numpy(codes) if with_codes else None), words

    def _lowbit_layout(self, t):
        """The layout of a 1-2-bit tensor: Q2_0's from its byte extent (the header walk's `block`), else the table's."""
        if _type_name(t) != "Q2_0":
            return LOWBIT_LAYOUTS[_type_name(t)]
        info = next(h for h in self._header_of(t).tensors if h.name == t.name)
        return Q2_0_PRISM if info.block == 128 else LOWBIT_LAYOUTS["Q2_0"]

    def _header_of(self, t) -> GgufHeader:
        for reader, header in zip(self.readers, self.headers):
            if any(x is t for x in reader.tensors):
                return header
        raise KeyError(t.name)

    def _lowbit_grid(self, t, lay, path: Path, inv, expert=None) -> Grid:
        params, codes, words = self._lowbit_parts(t, lay, path, inv, with_codes=True, expert=expert)
        # PrismML's blocks under a tag of their own: a Q2_0 writer copies only blocks tagged ggml:Q2_0
        tag = f"ggml:{lay.name}" if lay is not Q2_0_PRISM else "ggml:Q2_0-prismml128"
        return Grid(params, codes, PackedCodes(words, 2, tag))

    def _lowbit_parts(self, t, lay, path: Path, inv, with_codes: bool, expert=None):
        """Q1_0 / Q2_0 / TQ1_0 / TQ2_0 blocks as a 2-bit grid (kernels/ggml/lowbit.py): fp16 `d` per block, zero
        point 2 (Q1_0's signs as codes 1 / 3) or 1."""
        words = _block_bytes(t, lay, path, inv, expert)
        codes, scales = unpack_lowbit(lay, words.numpy())
        scales = torch.from_numpy(scales)
        zeros = torch.full_like(scales, ZERO_POINT[lay.name], dtype=torch.int16)
        params = GridParams(bits=2, group_size=lay.block, scales=scales, zeros=zeros)
        return params, (torch.from_numpy(codes) if with_codes else None), words

    def _grid(self, t, type_name: str, path: Path, inv, expert=None) -> Grid:
        params, codes, words = self._grid_parts(t, type_name, path, inv, with_codes=True, expert=expert)
        return Grid(params, codes, PackedCodes(words, params.bits, f"ggml:{type_name}"))

    def _grid_parts(self, t, type_name: str, path: Path, inv, with_codes: bool, expert=None):
        """(GridParams, codes [out, in] uint8 or None, block bytes [out, row_bytes]) in HF row order;
        without codes for planning, which reads only the parameters. `expert`: (index, count) of a
        stacked tensor, whose rows are expert by expert."""
        lay = LAYOUTS[type_name]
        words = _block_bytes(t, lay, path, inv, expert)
        out_features = int(words.shape[0])
        if lay.kind == "k":
            codes, scales, mins = unpack_k_blocks(type_name, words.numpy(), with_codes)
            codes, scales = (None if codes is None else torch.from_numpy(codes)), torch.from_numpy(scales)
            if mins is None:
                zeros = torch.full_like(scales, K_ZERO_POINT[type_name], dtype=torch.int16)
            else:
                mins = torch.from_numpy(mins)
                zeros = torch.zeros_like(scales)
            group = lay.sub_block
        else:
            blocks = words.view(out_features, -1, lay.nbytes)
            # every legacy block starts with fp16 d (then fp16 m for the types with a min)
            scales = blocks[..., 0:2].contiguous().view(torch.float16).view(out_features, -1)
            mins = blocks[..., 2:4].contiguous().view(torch.float16).view(out_features, -1).to(torch.float32) \
                if lay.has_min else None
            # Q8_0's int8 -128..127 become unsigned codes with zero point 128; Q4_0/Q5_0 keep 8/16
            zero = 128 if lay.name == "Q8_0" else lay.offset
            zeros = torch.zeros_like(mins) if lay.has_min else torch.full_like(scales, zero, dtype=torch.int16)
            codes = None
            if with_codes:
                q, _, _ = unpack_blocks(lay, words)
                codes = (q + 128 if lay.name == "Q8_0" else q).to(torch.uint8)
            group = lay.block
        params = GridParams(bits=lay.bits, group_size=group, scales=scales, zeros=zeros, mins=mins)
        return params, codes, words

    # -- the ModelSource interface --------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        halves: dict[str, dict[str, tuple[Path, object]]] = {}  # DeepSeek's attn_k_b / attn_v_b waiting for the other
        gate_up: dict[tuple[str, str], dict[str, tuple[Path, object]]] = {}  # gpt-oss's gate / up stacks, by layer
        in_out = arch_by_name(self.arch).experts_in_out  # Llama 4 fuses them as gpt-oss, without interleaving
        restore = arch_by_name(self.arch).from_gguf_record  # the architecture's transforms undone (archs/)
        held: dict = {}  # records such a transform keeps until their partner arrives
        for path, reader in zip(self.parts, self.readers):
            for t in reader.tensors:
                g = _GPT_OSS_STACK.match(t.name) if self.arch == "gpt-oss" or in_out else None
                if g is not None:
                    pair = gate_up.setdefault((g["block"], g["kind"]), {}) if g["role"] != "down" else {}
                    pair[g["role"]] = (path, t)
                    if len(pair) == 2 or "down" in pair:
                        gate_up.pop((g["block"], g["kind"]), None)
                        yield self._gpt_oss_record(pair, g["kind"] == "bias")
                    continue
                m = _KV_B_HALF.match(t.name) if self.mla else None
                if m is None:
                    for rec in self._records(path, t):
                        yield from ([rec] if restore is None else restore(rec, self.config, path, held))
                    continue
                pair = halves.setdefault(m["block"], {})
                pair[m["half"]] = (path, t)
                if len(pair) == 2:
                    del halves[m["block"]]
                    yield self._kv_b_record(pair)
        for pair in held.values():  # a transform's record whose partner never came
            rec = next(iter(pair.values()))
            raise BadInput("tensor without the partner its architecture merges it with", path=self.path,
                           tensor=rec.source_name or rec.name)
        for block, pair in halves.items():
            path, t = next(iter(pair.values()))
            other = "attn_v_b" if "k" in pair else "attn_k_b"
            raise BadInput(f"{t.name} without blk.{block}.{other}.weight (the two halves of kv_b_proj)", path=path,
                           tensor=t.name)
        for (block, kind), pair in gate_up.items():
            path, t = next(iter(pair.values()))
            other = "up" if "gate" in pair else "gate"
            raise BadInput(f"{t.name} without blk.{block}.ffn_{other}_exps.{kind} ({self.arch} fuses the two into "
                           f"gate_up_proj)", path=path, tensor=t.name)

    def _gpt_oss_record(self, parts: dict, bias: bool) -> TensorRecord:
        """One of gpt-oss's fused expert tensors from llama.cpp's stacks (archs.merge_gpt_oss_experts): gate and
        up [E, ffn, hidden] -> gate_up_proj [E, hidden, 2 * ffn] interleaved, down [E, hidden, ffn] ->
        down_proj [E, ffn, hidden], the biases alike (gate_up_proj_bias, down_proj_bias); decoded to float32
        by gguf-py (check_gguf_tensors has matched every shape with the metadata)."""
        items = [parts[r] for r in ("gate", "up", "down") if r in parts]
        shapes = [tuple(int(d) for d in reversed(list(t.shape))) for _, t in items]
        if len(set(shapes)) != 1 or len(shapes[0]) != (2 if bias else 3):
            raise BadInput(f"gpt-oss expert stacks of shapes {[list(s) for s in shapes]}: expected "
                           f"{'[experts, rows]' if bias else '[experts, rows, columns]'}, gate and up alike",
                           path=items[-1][0], tensor=items[-1][1].name)
        stack = self._hf_name(items[0][1].name)  # ...mlp.experts.gate_proj.weight
        head = stack[: stack.index(".experts.") + len(".experts.")]
        name = head + ("down_proj" if "down" in parts else "gate_up_proj") + ("_bias" if bias else "")
        s = shapes[0]
        if bias:
            shape = s if "down" in parts else (s[0], 2 * s[1])
        else:
            shape = (s[0], s[2], s[1]) if "down" in parts else (s[0], s[2], 2 * s[1])

        def load() -> Dense:
            halves = [torch.from_numpy(self._float32(t)).reshape(sh) for (_, t), sh in zip(items, shapes)]
            merge = merge_llama4_experts if arch_by_name(self.arch).experts_in_out else merge_gpt_oss_experts
            return Dense(merge(*halves, bias=bias))

        return TensorRecord(name, shape, "float32", load, source_file=str(items[0][0]),
                            source_name=" + ".join(t.name for _, t in items))

    def _float32(self, t) -> np.ndarray:
        """A whole tensor decoded to float32: the 1-2-bit types by kernels/ggml/lowbit.py, others by gguf-py."""
        if _type_name(t) in LOWBIT_LAYOUTS:
            lay = self._lowbit_layout(t)
            data = np.asarray(t.data, dtype=np.uint8)
            n = int(t.shape[0])
            return dequantize_lowbit(lay, data.reshape(-1, lay.row_bytes(n)))
        return _codebook_float32(np.asarray(t.data), _type_name(t), t.tensor_type)

    def _kv_b_record(self, pair: dict) -> TensorRecord:
        """kv_b_proj from llama.cpp's two MLA halves (archs.merge_kv_b): k_b [heads, kv_lora, nope] and
        v_b [heads, v, kv_lora], each decoded to float32 by gguf-py. The halves themselves travel beside it
        (NativeForm archs.KV_B_HALVES): a GGUF writer writes them as stored (types and bytes) instead of splitting
        the float32 merge again."""
        (k_path, k), (v_path, v) = pair["k"], pair["v"]
        k_shape = tuple(int(d) for d in reversed(list(k.shape)))
        v_shape = tuple(int(d) for d in reversed(list(v.shape)))
        if len(k_shape) != 3 or len(v_shape) != 3 or k_shape[0] != v_shape[0] or k_shape[1] != v_shape[2]:
            raise BadInput(f"MLA halves of shapes {list(k_shape)} and {list(v_shape)} do not make one kv_b_proj "
                           "([heads, kv_lora, nope] and [heads, v, kv_lora])", path=v_path, tensor=v.name)
        name = self._hf_name(k.name).replace(".k_b_proj.", ".kv_b_proj.")
        shape = (k_shape[0] * (k_shape[2] + v_shape[1]), k_shape[1])

        def load() -> Dense:
            halves = [torch.from_numpy(self._float32(t)).reshape(s) for t, s in ((k, k_shape), (v, v_shape))]
            return Dense(merge_kv_b(*halves))

        def stored_halves() -> tuple[TensorRecord, TensorRecord]:
            # each half read as any other tensor of the file (a block type as its grid with its block bytes, F16 as
            # float16...), made when a GGUF writer asks: a grid's scales are read then, not for every target
            return (self._record(k_path, k, self._hf_name(k.name), k_shape, None, rows_flattened=True),
                    self._record(v_path, v, self._hf_name(v.name), v_shape, None, rows_flattened=True))

        halves = NativeForm(KV_B_HALVES, stored_halves, {"types": (_type_name(k), _type_name(v))})
        return TensorRecord(name, shape, "float32", load, source_file=str(k_path),
                            source_name=f"{k.name} + {v.name}", native_forms=(halves,))

    def side_files(self) -> dict[str, Path]:
        if self._tokenizer_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="qconvert-gguf-tokenizer-"))
            weakref.finalize(self, shutil.rmtree, tmp, True)
            tokenizer_files_from_gguf(self.kv, tmp, path=self.path)
            self._tokenizer_dir = tmp
        return {p.name: p for p in sorted(self._tokenizer_dir.iterdir())}

    def write_gguf_tokenizer(self, writer: gguf.GGUFWriter) -> bool:
        """Copy the `tokenizer.*` keys verbatim (types included) into a GGUF being written: a GGUF
        target keeps the source's tokenizer exactly, pre-tokenizer name and chat template included."""
        for key, f in self.fields.items():
            if not key.startswith("tokenizer."):
                continue
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            value = f.contents()
            if vtype == gguf.GGUFValueType.ARRAY and not len(value):  # GGUF writers refuse empty arrays
                raise BadInput(f"metadata {key} is an empty array", path=self.path)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        return True

    @property
    def ignored_files(self) -> dict[str, str]:
        return self._ignored_files

    def describe(self) -> dict:
        counts: dict[str, int] = {}
        for r in self.readers:
            for t in r.tensors:
                counts[_type_name(t)] = counts.get(_type_name(t), 0) + 1
        info = {"format": "gguf", "architecture": self.arch, "parts": [p.name for p in self.parts],
                "file_type": self.kv.get("general.file_type"), "ggml_types": counts,
                "tensors": sum(counts.values()),
                "reading": "F32/F16/BF16 as dense; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K..Q6_K as grids equal to "
                           "gguf-py's dequantization, with their block bytes kept for same-type copies; Q1_0/Q2_0/"
                           "TQ1_0/TQ2_0 as 2-bit grids equal to ggml's dequantize_row_* (Q2_0's 64- or PrismML's "
                           "128-value blocks told by byte size); other types (IQ*, MXFP4, NVFP4) as float32 via "
                           "gguf.quants.dequantize"}
        if self.folder is not None:  # a file's description stays as it was
            info |= {"folder": str(self.folder), "ignored_files": self.ignored_files}
        return info
