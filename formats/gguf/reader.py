"""GGUF reader: a llama.cpp model file (or a split set `name-0000i-of-0000N.gguf`) as tensor records.

A GGUF holds the whole model: metadata (`{arch}.*` hyper-parameters, `tokenizer.ggml.*`) and tensors in
ggml order under llama.cpp names, each in one ggml type. Reading turns it back into the intermediate:

- names back to Hugging Face names (`blk.0.attn_q.weight` -> `model.layers.0.self_attn.q_proj.weight`),
  llama's Q/K row permutation undone, so every record is in HF layout `[out, in]`;
- config.json from the metadata, tokenizer.json / tokenizer_config.json written from the token tables;
- F32/F16/BF16 tensors as `Dense`; the block types whose structure is a grid (legacy Q4_0..Q8_0 and the
  K types Q2_K..Q6_K) as `Grid`s whose float32 dequantization equals gguf-py's bit for bit, carrying
  the original block bytes as `PackedCodes(layout="ggml:<TYPE>")` so a writer of the same type copies
  blocks instead of re-encoding them; every other type gguf-py can decode (IQ*, TQ*, MXFP4, NVFP4)
  as `Dense` float32 from `gguf.quants.dequantize` (their codebooks are not grids).

Files are memory-mapped and tensors are read one at a time.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import torch

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, GridParams, PackedCodes, TensorRecord
from ...kernels.ggml_kblocks import K_ZERO_POINT, unpack_k_blocks
from ...kernels.ggml_layouts import LAYOUTS
from ...kernels.ggml_legacy import unpack_blocks
from .metadata import config_from_gguf, field_values
from .names import hf_tensor_name, inverse_permutation, qk_row_permutation
from .tokenizer import tokenizer_files_from_gguf

__all__ = ["GgufSource", "open_gguf", "split_parts", "GRID_TYPES"]

_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_FLOAT = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "F64": (np.float64, torch.float64)}
_INTEGER = {"I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
# ggml types read as grids: the layout table's block types. Others gguf-py decodes become float32.
GRID_TYPES = tuple(name for name, lay in LAYOUTS.items() if lay.kind != "float")
# tensors llama.cpp derives from the config (the writer recomputes them): skipped, not refused
_DERIVED = {"rope_freqs.weight"}


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF given any of them (`x-00002-of-00003.gguf` -> parts 1..3); [path] for
    a single file. A missing part raises BadInput naming it."""
    path = Path(path)
    m = _SPLIT_RE.match(path.name)
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


class _CheckedReader(gguf.GGUFReader):
    """gguf-py's reader, with each tensor's type and extent checked before gguf-py maps its data, so a
    truncated file or an unknown type is reported with the tensor's name (gguf-py would fail with a
    reshape error). Hooks `_build_tensors`, which gguf 0.19 calls once with the tensor-info fields."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _TensorProblem(name, f"unknown ggml type id {int(raw_dtype[0])}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims.astype(np.int64)))
            end = int(start_offs + offset[0]) + n_elems * type_size // block
            if n_elems % block:
                raise _TensorProblem(name, f"{n_elems} elements are not whole {qtype.name} blocks of {block}")
            if end > size:
                raise _TensorProblem(name, f"truncated: tensor data ends at byte {end} but the file has {size}")
        super()._build_tensors(start_offs, fields)


class _TensorProblem(Exception):
    def __init__(self, tensor: str, message: str):
        super().__init__(message)
        self.tensor, self.message = tensor, message


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise BadInput("file not found", path=path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise BadInput("not a GGUF file (no GGUF magic)", path=path)
    try:
        reader = _CheckedReader(str(path), "r")
    except _TensorProblem as e:
        raise BadInput(e.message, path=path, tensor=e.tensor) from None
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on truncated headers
        raise BadInput(f"unreadable GGUF ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'corrupt'})",
                       path=path) from None
    return reader


def _gguf_py_decodes(qtype) -> bool:
    """True when gguf-py has a dequantizer for this ggml type (it registers one class per type)."""
    return int(qtype) in {int(k) for k in getattr(gguf.quants, "_type_traits", {})}


def _type_name(t) -> str:
    try:
        return gguf.GGMLQuantizationType(int(t.tensor_type)).name
    except ValueError:
        return f"type {int(t.tensor_type)}"


class GgufSource:
    """A GGUF model (one file or every part of a split set) as a lazy stream of HF-named records."""

    format_name = "gguf"

    def __init__(self, path: Path):
        self.parts = split_parts(Path(path))
        self.path = self.parts[0]
        self.readers = [_open(p) for p in self.parts]
        self._check_split()
        first = self.readers[0]
        self.kv = field_values(first)
        self.fields = first.fields
        names = [t.name for r in self.readers for t in r.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise BadInput("tensor appears twice across the split parts", path=self.path, tensor=dup)
        self.config = config_from_gguf(first.fields, names)
        self.arch = self.kv.get("general.architecture")
        self.n_layers = int(self.config["num_hidden_layers"])
        types = {_type_name(t) for r in self.readers for t in r.tensors}
        quantized = sorted(t for t in types if t not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"))
        self.quant_config: dict = ({"quant_method": "gguf", "file_type": self.kv.get("general.file_type"),
                                    "types": quantized} if quantized else {})
        self._tokenizer_dir: Path | None = None

    def _check_split(self) -> None:
        if len(self.parts) == 1:
            return
        for i, (p, r) in enumerate(zip(self.parts, self.readers)):
            kv = field_values({k: f for k, f in r.fields.items() if k.startswith("split.")})
            no, count = kv.get("split.no"), kv.get("split.count")
            if no is not None and (int(no) != i or int(count) != len(self.parts)):
                raise BadInput(f"metadata says split part {int(no) + 1} of {int(count)}, the name says "
                               f"{i + 1} of {len(self.parts)}", path=p)

    # -- one tensor ----------------------------------------------------------------------------
    def _record(self, path: Path, t) -> TensorRecord | None:
        if t.name in _DERIVED:
            return None
        name = hf_tensor_name(t.name, self.arch, self.n_layers)
        if name is None:
            raise BadInput(f"GGUF tensor has no Hugging Face counterpart in arch {self.arch}", path=path, tensor=t.name)
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        type_name = _type_name(t)
        perm = qk_row_permutation(name, self.config, self.arch)
        inv = None if perm is None else inverse_permutation(perm)
        where = str(path)
        if type_name in GRID_TYPES:
            if len(shape) != 2:
                raise BadInput(f"{type_name} tensor of shape {shape}: only 2-D block tensors are supported",
                               path=path, tensor=t.name)
            params = self._grid_parts(t, type_name, path, inv, with_codes=False)[0]
            return TensorRecord(name, shape, "grid", lambda: self._grid(t, type_name, path, inv), params=params,
                                source_file=where, notes={"ggml_type": type_name, "gguf_name": t.name})
        if type_name in _FLOAT or type_name == "BF16":
            dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}[type_name]
        elif type_name in _INTEGER:
            dtype = str(_INTEGER[type_name])[6:]
        elif _gguf_py_decodes(t.tensor_type):
            dtype = "float32"
        else:
            raise BadInput(f"ggml type {type_name} cannot be decoded (gguf-py has no dequantizer for it)",
                           path=path, tensor=t.name)
        return TensorRecord(name, shape, dtype, lambda: self._dense(t, type_name, shape, inv), source_file=where,
                            notes={"ggml_type": type_name, "gguf_name": t.name})

    def _dense(self, t, type_name: str, shape: tuple[int, ...], inv) -> Dense:
        data = np.asarray(t.data)
        if type_name in _FLOAT:
            x = torch.from_numpy(np.array(data, dtype=_FLOAT[type_name][0]))
        elif type_name == "BF16":
            x = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        elif type_name in _INTEGER:
            x = torch.from_numpy(np.array(data))
        else:  # IQ*, TQ*, MXFP4, NVFP4...: codebooks, not grids -> gguf-py's float32 decoding
            x = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32))
        x = x.reshape(shape)
        if inv is not None:
            x = x[inv].contiguous()
        return Dense(x)

    def _grid(self, t, type_name: str, path: Path, inv) -> Grid:
        params, codes, words = self._grid_parts(t, type_name, path, inv, with_codes=True)
        return Grid(params, codes, PackedCodes(words, params.bits, f"ggml:{type_name}"))

    def _grid_parts(self, t, type_name: str, path: Path, inv, with_codes: bool):
        """(GridParams, codes [out, in] uint8 or None, block bytes [out, row_bytes]) in HF row order;
        without codes for planning, which reads only the parameters."""
        lay = LAYOUTS[type_name]
        out_features, in_features = int(t.shape[1]), int(t.shape[0])
        if in_features % lay.block:
            raise BadInput(f"rows of {in_features} are not whole {type_name} blocks of {lay.block}", path=path,
                           tensor=t.name)
        data = np.asarray(t.data).reshape(out_features, lay.row_bytes(in_features))
        words = torch.from_numpy(np.array(data, dtype=np.uint8))
        if inv is not None:  # rows are whole blocks: permuting byte rows is exact
            words = words[inv].contiguous()
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
        for path, reader in zip(self.parts, self.readers):
            for t in reader.tensors:
                rec = self._record(path, t)
                if rec is not None:
                    yield rec

    def side_files(self) -> dict[str, Path]:
        if self._tokenizer_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="qconvert-gguf-tokenizer-"))
            weakref.finalize(self, shutil.rmtree, tmp, True)
            tokenizer_files_from_gguf(self.fields, tmp)
            self._tokenizer_dir = tmp
        return {p.name: p for p in sorted(self._tokenizer_dir.iterdir())}

    def write_gguf_tokenizer(self, writer: gguf.GGUFWriter) -> None:
        """Copy the `tokenizer.*` keys verbatim (types included) into a GGUF being written: a GGUF
        target keeps the source's tokenizer exactly, pre-tokenizer name and chat template included."""
        for key, f in self.fields.items():
            if not key.startswith("tokenizer."):
                continue
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            writer.add_key_value(key, f.contents(), vtype, sub_type=sub)

    def describe(self) -> dict:
        counts: dict[str, int] = {}
        for r in self.readers:
            for t in r.tensors:
                counts[_type_name(t)] = counts.get(_type_name(t), 0) + 1
        return {"format": "gguf", "architecture": self.arch, "parts": [p.name for p in self.parts],
                "file_type": self.kv.get("general.file_type"), "ggml_types": counts,
                "tensors": sum(counts.values()),
                "reading": "F32/F16/BF16 as dense; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K..Q6_K as grids equal to "
                           "gguf-py's dequantization, with their block bytes kept for same-type copies; other "
                           "types (IQ*, TQ*, MXFP4, NVFP4) as float32 via gguf.quants.dequantize"}


def open_gguf(path: Path, **_: object) -> GgufSource:
    return GgufSource(path)
