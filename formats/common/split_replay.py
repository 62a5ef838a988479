"""Split conversions (converters/split.py) for the writers whose output is a folder of safetensors files
written as tensors arrive (hf, gptq, uqff): where a tensor lands there depends on the bytes of every tensor
before it (a shard is cut when it is full; a safetensors header, which comes first, lists every offset), so a
part cannot write its bytes in place. Instead each part runs the writer's own session with its sinks (the
ShardWriter, UQFF's shard set and residual file) replaced by recorders: every call a sink gets (`put(name,
tensor)`, `put_layer({name: tensor})`) is kept, the tensors' bytes appended to the part's file
(`parts/NNNNN.bin`). The driver then opens the writer's session on the output and replays every part's calls
in part order onto its real sinks, tensors read back from those files (memory-mapped), then closes it: the
sinks cut the same shards and write the same headers, so the output is the single-process one byte for byte.
The expensive work (dequantizing, requantizing) runs in the parts; the driver copies the encoded bytes once.

What a session accumulates besides its sinks (GPTQ: each module's scheme, for quantize_config.json) comes back
through the writer's `state_of` / `merge_state` pair, pickled into the part's record.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...converters.plan import PartSession, SplitOutput, WrittenRange

__all__ = ["ReplaySplitOutput", "RecordingPartSession", "ReplayLayout"]


@dataclass(frozen=True)
class ReplayLayout:
    name: str  # the output folder's name inside the split's folder
    sinks: tuple[str, ...]  # the session attributes that are sinks


_DTYPES = {str(d): d for d in (getattr(torch, n, None) for n in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32",
    "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")) if d is not None}


class _Recorder:
    """Stands for one sink of a part's session: each call is kept as (sink, method, args), tensors replaced by
    {"t": offset, nbytes, dtype, shape[, stacked]} and their bytes appended to the part's file."""

    def __init__(self, sink: str, part: "RecordingPartSession"):
        self._sink, self._part = sink, part

    def __getattr__(self, method: str) -> Callable:
        def record(*args):
            self._part.calls.append([self._sink, method, [self._part.encode(a) for a in args]])
        return record


class RecordingPartSession(PartSession):
    def __init__(self, inner, folder: Path, layout: ReplayLayout, index_hint: str, state_of=None):
        self.inner, self.layout, self.state_of = inner, layout, state_of
        self.file = f"parts/{index_hint}.bin"
        self.path = Path(folder) / self.file
        self.data = open(self.path, "wb")
        self.hash = hashlib.sha256()
        self.offset = 0
        self.calls: list = []
        for sink in layout.sinks:
            setattr(inner, sink, _Recorder(sink, self))
        self.written: list[WrittenRange] = []

    def encode(self, value: Any):
        if isinstance(value, dict):
            return {"d": [[k, self.encode(v)] for k, v in value.items()]}
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu()
            return self._bytes([t], t.dtype, tuple(t.shape), False)
        if hasattr(value, "raw_parts"):  # UQFF's StackedTensor: parts written back to back
            return self._bytes(value.parts, value.dtype, value.shape, True)
        return {"v": value}

    def _bytes(self, parts, dtype, shape, stacked: bool) -> dict:
        start = self.offset
        for p in parts:
            raw = p.reshape(-1).view(torch.uint8).numpy().tobytes() if p.numel() else b""
            self.data.write(raw)
            self.hash.update(raw)
            self.offset += len(raw)
        return {"t": [start, self.offset - start, str(dtype), list(shape), stacked]}

    def add(self, plan, item):
        return self.inner.add(plan, item)

    def take_reference(self):
        return self.inner.take_reference()

    def close(self) -> None:
        self.data.close()
        self.written = [WrittenRange(self.file, 0, self.offset, self.hash.hexdigest())]

    def part_record(self) -> dict:
        state = self.state_of(self.inner) if self.state_of else None
        return {"file": self.file, "calls": self.calls,
                "state": base64.b64encode(pickle.dumps(state)).decode() if state is not None else None}


def open_recording_part(writer, folder: Path, source, plans, options, layout: ReplayLayout, state_of=None):
    """The writer's own session, opened on a scratch folder (what it creates there at open is dropped), its
    sinks replaced by recorders writing into a new part file."""
    folder = Path(folder)
    scratch = Path(folder) / "parts" / f".scratch-{os.getpid()}-{id(plans)}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        inner = writer.open(scratch, source, plans, options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    hint = f"{os.getpid()}-{len(os.listdir(folder / 'parts'))}-{os.urandom(4).hex()}"
    return RecordingPartSession(inner, folder, layout, hint, state_of)


class ReplaySplitOutput(SplitOutput):
    def __init__(self, writer, folder: Path, name: str, source, plans, options, sinks: tuple[str, ...],
                 merge_state=None, stacked_type=None):
        self.writer, self.folder, self.source, self.plans, self.options = writer, Path(folder), source, plans, options
        self.files = [name]
        self.layout = ReplayLayout(name, tuple(sinks))
        self.merge_state, self.stacked_type = merge_state, stacked_type

    def finish(self, records: list[dict]) -> None:
        out = self.folder / self.layout.name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        session = self.writer.open(out, self.source, self.plans, self.options)
        for record in records:
            data = np.memmap(self.folder / record["file"], dtype=np.uint8, mode="r") \
                if (self.folder / record["file"]).stat().st_size else np.zeros(0, np.uint8)
            for sink, method, args in record["calls"]:
                getattr(getattr(session, sink), method)(*[self._decode(a, data) for a in args])
            if record.get("state") is not None and self.merge_state is not None:
                self.merge_state(session, pickle.loads(base64.b64decode(record["state"])))
        session.close()

    def _decode(self, value, data: np.ndarray):
        if "d" in value:
            return {k: self._decode(v, data) for k, v in value["d"]}
        if "v" in value:
            return value["v"]
        start, nbytes, dtype, shape, stacked = value["t"]
        if nbytes:
            with warnings.catch_warnings():  # read-only on purpose: the sinks only read the bytes
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.asarray(data[start:start + nbytes]))
        else:
            raw = torch.zeros(0, dtype=torch.uint8)
        flat = raw.view(_DTYPES[dtype])
        if stacked:
            return self.stacked_type([flat], tuple(shape))
        return flat.reshape(shape)
