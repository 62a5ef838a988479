"""hqq's own qmodel.pt (save_quantized; also the <=0.1.8 W_q/meta layout), read with torch.load(weights_only=True)
only after the zip and its pickle are checked: a file that needs any other object is refused, never unpickled.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, TensorRecord
from ...converters.model_shapes import ModelShapes
from ..common.safetensors_header import safetensors_tag
from .layer import HqqLayer, QMODEL, DENSE_DTYPES, LayerDecoder, check_bias, check_codes, grid_record, unpacked_grid
from .folder import check_complete, describe_checkpoint, quantization_config, folder_side_files
from ...converters.records import ModelSource
from ..common.quant_config import read_config


# --------------------------------------------------------------------------------------------------
# hqq library qmodel.pt (current and legacy)


_PICKLE = re.compile(r"^[^/]+/data\.pkl$")


def _check_torch_zip(path: Path) -> None:
    """What torch.save writes (since torch 1.6, and hqq's save_quantized through it): an uncompressed zip
    with one `<archive>/data.pkl` and the storages as `<archive>/data/<key>` records. Checked from the zip's
    own directory before torch reads anything, so that every size it will use is bounded by the file: no
    compressed member (nothing can inflate), members inside the file, and a pickle torch must read whole
    of at most the file's size. A pre-1.6 (non-zip) pickle is refused: its storages are sized by the pickle
    itself and allocated before any check."""
    try:
        size = os.path.getsize(path)
        if not zipfile.is_zipfile(path):
            raise BadInput("not a zip-format torch file (torch.save has written zip files since torch 1.6; "
                           "hqq's save_quantized writes them)", path=path)
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            directory_start = z.start_dir
    except BadInput:
        raise
    except FileNotFoundError:
        raise BadInput("file not found", path=path) from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, OverflowError) as e:
        raise BadInput(f"not a readable zip file ({_zip_problem(e)})", path=path) from None
    pickles = [m for m in members if _PICKLE.match(m.filename)]
    if len(pickles) != 1:
        raise BadInput(f"expected one <archive>/data.pkl in the torch zip, found {len(pickles)}", path=path)
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED:
            raise BadInput(f"zip member {m.filename[:80]!r} is compressed; torch.save stores members "
                           "uncompressed", path=path)
        if m.header_offset + m.file_size > size or m.file_size > size:
            raise BadInput(f"zip member {m.filename[:80]!r} claims {m.file_size} bytes past the end of the "
                           f"{size}-byte file (truncated?)", path=path)
    _check_local_headers(path, members, directory_start)
    records = {m.filename: m.file_size for m in members}
    archive = pickles[0].filename.rpartition("/")[0]
    for key, type_name, numel in _pickled_storages(path, pickles[0]):
        record = f"{archive}/data/{key}"
        width = _STORAGE_BYTES.get(type_name)
        if record not in records:
            raise BadInput(f"the pickle names storage {key[:40]!r}, which the zip does not hold", path=path)
        if width is not None and numel * width != records[record]:
            raise BadInput(f"storage {key[:40]!r} claims {numel} x {width} bytes, its record holds "
                           f"{records[record]}", path=path)


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then (past version..sizes) name length, extra length
_DESCRIPTOR = struct.Struct("<II")  # a data descriptor's CRC-32 and compressed size (its low 32 bits in zip64)
_DESCRIPTOR_FLAG = 0x08  # general purpose bit 3: CRC and sizes follow the data (torch.save sets it)


def _check_local_headers(path: Path, members: list[zipfile.ZipInfo], directory_start: int) -> None:
    """torch reads a storage where the member's local header says its data starts (header offset + 30 + the
    local name and extra lengths), while zipfile's directory gives the sizes: one flipped byte in a local
    header moves a storage by N bytes, which torch reads as other values without a word. So every member's
    local header must name the member the directory names, and its data, from where that header puts it, must
    end where the member's data descriptor (CRC and size, as the directory has them) stands, or, without one,
    where the next member (or the directory) begins. Reads 30 bytes, a name and 12 bytes per member."""
    ends = sorted(m.header_offset for m in members)[1:] + [directory_start]
    next_start = dict(zip(sorted(m.header_offset for m in members), ends))
    with open(path, "rb") as f:
        for m in members:
            local = b""
            if m.header_offset >= 0:  # a damaged directory can give a negative offset, which seek refuses
                f.seek(m.header_offset)
                local = f.read(_LOCAL_HEADER.size)
            if len(local) != _LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
                raise BadInput(f"zip member {m.filename[:80]!r}: no local file header at byte {m.header_offset}, "
                               "where the zip's directory puts it", path=path)
            _, name_len, extra_len = _LOCAL_HEADER.unpack(local)
            name = f.read(name_len)
            if name != m.orig_filename.encode("utf-8" if m.flag_bits & 0x800 else "cp437"):
                raise BadInput(f"zip member {m.filename[:80]!r}: its local header names "
                               f"{name[:80].decode('utf-8', 'replace')!r} ({name_len} bytes), not the member the zip's "
                               "directory names", path=path)
            data_end = m.header_offset + _LOCAL_HEADER.size + name_len + extra_len + m.compress_size
            if m.flag_bits & _DESCRIPTOR_FLAG:
                f.seek(data_end)
                tail = f.read(12)
                tail = tail[4:] if tail[:4] == b"PK\x07\x08" else tail[:8]  # the signature is optional
                agrees = len(tail) == 8 and _DESCRIPTOR.unpack(tail) == (m.CRC, m.compress_size & 0xFFFFFFFF)
                why = "the member's CRC and size do not follow the data where it puts it"
            else:
                agrees = data_end == next_start[m.header_offset]
                why = "the data it puts there does not end where the next member begins"
            if not agrees:
                raise BadInput(f"zip member {m.filename[:80]!r}: its local header (name {name_len}, extra {extra_len} "
                               f"bytes) does not agree with the zip's directory: {why} (torch would read the bytes "
                               "shifted)", path=path)


# torch's typed storage classes (what torch.save names in each storage's persistent id) and their widths
_STORAGE_BYTES = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
                  "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                  "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16}
_MARK = object()


def _pickled_storages(path: Path, info: zipfile.ZipInfo) -> list[tuple[str, str, int]]:
    """(key, storage class, element count) of every storage the pickle names, read by walking its opcodes
    (pickletools, nothing executed) with a stack of the few values that matter: torch writes each
    storage as the persistent id ('storage', <class>, key, location, numel). Bounded by the pickle's size."""
    import pickletools

    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise BadInput("the zip's entry for data.pkl does not point at a file header", path=path)
        f.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little"))
        data = f.read(info.file_size)
    found: list[tuple[str, str, int]] = []
    stack: list = []
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(arg))
            elif name == "GLOBAL":
                stack.append(("global", str(arg).rpartition(" ")[2]))
            elif name == "STACK_GLOBAL":  # protocol 4: module and name strings from the stack
                qualname = stack.pop()
                stack.pop()
                stack.append(("global", qualname if isinstance(qualname, str) else None))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                i = len(stack) - 1 - stack[::-1].index(_MARK)
                items, stack[i:] = tuple(stack[i + 1:]), []
                stack.append(items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n:
                    raise IndexError
                items, stack[-n:] = tuple(stack[-n:]), []
                stack.append(items)
            elif name == "BINPERSID":
                pid = stack.pop()
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                    _, cls, key, _, numel = pid
                    if not (isinstance(key, str) and isinstance(numel, int)):
                        raise BadInput("a storage's persistent id is not (storage, class, key, location, numel)",
                                       path=path)
                    found.append((key, cls[1] if isinstance(cls, tuple) else None, numel))
                stack.append(None)
            elif isinstance(arg, (str, int)) and not op.stack_before and len(op.stack_after) == 1:
                stack.append(arg)  # strings and integers (BINUNICODE, BININT, LONG1...)
            else:  # any other opcode: pop what it takes, push placeholders for what it leaves
                before = [s.name for s in op.stack_before]
                if "mark" in before:
                    i = len(stack) - 1 - stack[::-1].index(_MARK)
                    del stack[i:]
                    before = before[: before.index("mark")]
                if len(stack) < len(before):
                    raise IndexError
                del stack[len(stack) - len(before):]
                stack.extend([None] * len(op.stack_after))
    except BadInput:
        raise
    except Exception:  # a bad opcode, a pop from an empty stack, a missing mark: not a pickle torch wrote
        raise BadInput("corrupt torch file: data.pkl does not decode as a pickle", path=path) from None
    return found


def _zip_problem(e: Exception) -> str:
    """Why zipfile could not read a torch.save archive, in our words (its exception names are not for users)."""
    if isinstance(e, UnicodeDecodeError):
        return "a member name is not valid text: the directory is damaged"
    if isinstance(e, zipfile.BadZipFile):
        return "its directory is damaged or missing"
    if isinstance(e, (EOFError, OverflowError)):
        return "it ends before its directory says"
    if isinstance(e, OSError):
        return e.strerror or "an I/O error"
    return "a value in its directory is out of range"


def load_qmodel(path: Path) -> dict:
    """torch.load with weights_only=True (tensors, numbers, strings, dtypes, torch.Size only), memory-mapped
    (so no storage is read, and a storage claiming more bytes than the file holds fails in torch);
    anything else is refused, never unpickled. Every failure of torch's unpickler on a corrupt pickle
    (it raises UnpicklingError, but also KeyError, TypeError, IndexError, UnicodeDecodeError, struct.error
    ... on flipped bytes) is a BadInput, and torch's warnings about odd pickles are not printed."""
    path = Path(path)
    _check_torch_zip(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        text = " ".join(str(e).split())
        m = re.search(r"GLOBAL (\S+) was not an allowed global|whose module (\S+) is blocked", text)
        if m:  # the pickle names a callable outside torch's weights-only allowlist
            what = (m[1] or m[2] or "")[:80]
            raise BadInput(f"refused: not a weights-only torch file, its pickle asks for {what!r}, which is not "
                           "a tensor, number, string or dtype; such files are never unpickled", path=path) from None
        raise BadInput("corrupt torch file: data.pkl does not decode as a weights-only pickle", path=path) from None
    except Exception:  # whatever torch's unpickler or zip reader raises on flipped bytes or a bad storage
        raise BadInput("corrupt torch file: data.pkl or the storages it names do not decode", path=path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in data.items()):
        raise BadInput("expected a dict {module name: {key: value}} (hqq save_quantized layout)", path=path)
    # a pickle may mark a tensor requires_grad (hqq's files do not): weights are read as plain data, so that
    # reading a scalar of it does not warn about autograd
    for state in data.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                state[key] = value.detach()
    return data


class HqqPickleSource(ModelSource):
    """An hqq library `save_quantized` directory: qmodel.pt + config.json."""

    format_name = "hqq"
    container = "qmodel"

    def __init__(self, path: Path):
        path = Path(path)
        self.path = path.parent if path.is_file() else path
        self.file = path if path.is_file() else path / QMODEL
        conf = read_config(self.path)
        self.quant_config = quantization_config(conf.raw, conf.path)
        self.config = conf.model
        self.weights = load_qmodel(self.file)
        self.legacy = any("meta" in v for v in self.weights.values() if "W_q" in v)
        self._layers: dict[str, HqqLayer] = {}
        for module, state in self.weights.items():
            if "W_q" in state:
                self._layers[module] = self._decode(module, state)
                check_bias(self._layers[module], state.get("bias"), self.file, module)
            else:
                for key, value in state.items():
                    name = f"{module}.{key}"
                    if not isinstance(key, str):
                        raise BadInput(f"key {str(key)[:40]!r} is not a string", path=self.file, tensor=module)
                    if not isinstance(value, torch.Tensor):
                        raise BadInput(f"expected a tensor, found {type(value).__name__}", path=self.file,
                                       tensor=name)
                    if value.dtype not in DENSE_DTYPES or value.is_sparse or value.dim() > 8:
                        raise BadInput(f"{value.dtype} tensor of {value.dim()} dimensions is not a weight this "
                                       "reader passes through", path=self.file, tensor=name)
        if not self._layers:
            raise BadInput("no HQQ layers (no entry with W_q)", path=self.file)
        names = {f"{m}.weight" for m in self._layers}
        names |= {f"{m}.{k}" if m else str(k) for m, state in self.weights.items() if m not in self._layers for k in state}
        check_complete(self.config, names, self.file)
        self.shapes = ModelShapes(self.config, self.path / "config.json")

    def _decode(self, module: str, state: dict) -> HqqLayer:
        values = dict(state)
        if "meta" in values:  # hqq <= 0.1.8
            meta = values.pop("meta")
            if not isinstance(meta, dict):
                raise BadInput("legacy meta is not a dict", path=self.file, tensor=f"{module}.meta")
            values.update(meta)
        return LayerDecoder(values, self.file, module).decode()

    def _load_grid(self, module: str) -> Grid:
        layer = self._layers[module]
        grid = unpacked_grid(layer, self.file, module)
        check_codes(layer, grid.codes, self.file, module)
        return grid

    def records(self) -> Iterator[TensorRecord]:
        for module, state in self.weights.items():
            if module in self._layers:
                yield grid_record(module, self._layers[module], lambda m=module: self._load_grid(m), self.file.name)
                bias = state.get("bias")
                if bias is not None:
                    yield self._dense(f"{module}.bias", bias)
            else:
                for key, value in state.items():
                    yield self._dense(f"{module}.{key}" if module else key, value)

    def _dense(self, name: str, value) -> TensorRecord:
        t = value.data if isinstance(value, torch.nn.Parameter) else value
        if not isinstance(t, torch.Tensor):
            raise BadInput(f"expected a tensor, found {type(t).__name__}", path=self.file, tensor=name)
        self.shapes.check_dense(name, tuple(t.shape), self.file, safetensors_tag(t.dtype))
        return TensorRecord(name, tuple(t.shape), str(t.dtype)[6:], lambda t=t: Dense(t), source_file=self.file.name)

    def side_files(self) -> dict[str, Path]:
        return folder_side_files(self.path)

    def describe(self) -> dict:
        return describe_checkpoint("hqq", "hqq qmodel.pt (legacy meta)" if self.legacy else "hqq qmodel.pt", self._layers,
                         {"modules": len(self.weights)})
