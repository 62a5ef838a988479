"""A GGUF conversion split into parts (converters/split.py: `--workers`, `--ray`).

The driver writes the header of every output file (one file, or the `--split-max-size` set) as GgufSession
writes it, into a scratch folder, and reads from gguf-py's tensor infos where each tensor's bytes go: the
header's length padded to the alignment, then every tensor's bytes padded in turn. It copies each header into
an output file made that long (a sparse file: the padding gguf-py writes as zeros reads as zeros). Each part's
session encodes its tensors exactly as GgufSession.add does and writes their bytes at their offsets (an expert
at its slot in its stack) with os.pwrite: no part waits for another, nothing is held or copied twice, and the
file is byte for byte the single-process one. The driver writes the tensors it adds itself (rope factors) last.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ...converters.plan import PartSession, SplitOutput, TensorPlan, WrittenRange
__all__ = ["GgufPlacement", "GgufSplitOutput", "GgufPart"]


@dataclass(frozen=True)
class GgufPlacement:
    """Where every GGUF tensor's bytes go: {name: (file index, offset, bytes)}; a stack of experts has
    `expert_bytes[name]` per expert, expert i at offset + i * expert_bytes."""

    files: tuple[str, ...]
    sizes: tuple[int, ...]
    tensors: dict
    expert_bytes: dict


class GgufSplitOutput(SplitOutput):
    """`session` is a GgufSession that has written every file's header into a scratch folder and nothing else."""

    def __init__(self, folder: Path, session):
        w = session.writer
        scratch = Path(w.fout[0].name).parent
        align = w.data_alignment
        files, sizes, tensors = [], [], {}
        for fid, (fout, infos) in enumerate(zip(w.fout, w.tensors)):
            fout.flush()
            offset = gguf.GGUFWriter.ggml_pad(fout.tell(), align)
            for tensor, info in infos.items():
                tensors[tensor] = (fid, offset, info.nbytes)
                offset += gguf.GGUFWriter.ggml_pad(info.nbytes, align)
            files.append(Path(fout.name).name)
            sizes.append(offset)
        w.close()
        expert_bytes = {t: tensors[t][2] // n for t, n in session.stack_size.items()}
        self.folder, self.files, self.extra = folder, files, session.extra
        self.layout = GgufPlacement(tuple(files), tuple(sizes), tensors, expert_bytes)
        for fname, size in zip(files, sizes):
            header = (scratch / fname).read_bytes()
            fd = os.open(folder / fname, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != size:  # a fresh file (a re-run of the same plan finds it this long)
                    os.ftruncate(fd, size)
                _pwrite_all(fd, memoryview(header), 0)  # the same bytes a re-run finds there
            finally:
                os.close(fd)
            (scratch / fname).unlink()

    def finish(self, records: list[dict]) -> None:
        for name, arr in self.extra:  # rope factors: written after the planned tensors, as GgufSession.close does
            fid, offset, nbytes = self.layout.tensors[name]
            data = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            if data.nbytes != nbytes:
                raise AssertionError(f"{name} holds {data.nbytes} bytes, its tensor info {nbytes}")
            fd = os.open(self.folder / self.files[fid], os.O_WRONLY)
            try:
                _pwrite_all(fd, memoryview(data), offset)
            finally:
                os.close(fd)


class GgufPart(PartSession):
    """A part's session: `session` (GgufSession.without_header) encodes each tensor as a plain conversion
    does and hands its bytes to `write`, which puts them at their place in the split's files."""

    session = None  # set by GgufWriter.open_part

    def __init__(self, folder: Path, placement: GgufPlacement):
        self.folder, self.placement = Path(folder), placement
        self.fds: dict[int, int] = {}
        self.written: list[WrittenRange] = []

    def add(self, plan, item):
        return self.session.add(plan, item)

    def take_reference(self):
        return self.session.take_reference()

    def write(self, plan: TensorPlan, data: np.ndarray) -> None:
        fid, offset, nbytes = self.placement.tensors[plan.out_name]
        if plan.action.expert is not None:
            nbytes = self.placement.expert_bytes[plan.out_name]
            offset += plan.action.expert * nbytes
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if buf.nbytes != nbytes:  # the plan fixed every tensor's type and shape
            raise AssertionError(f"{plan.name} encodes to {buf.nbytes} bytes, its place holds {nbytes}")
        if fid not in self.fds:
            self.fds[fid] = os.open(self.folder / self.placement.files[fid], os.O_WRONLY)
        _pwrite_all(self.fds[fid], memoryview(buf), offset)
        self.written.append(WrittenRange(self.placement.files[fid], offset, nbytes,
                                         hashlib.sha256(buf.data).hexdigest()))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written (a write may be short on a network filesystem)."""
    data = data.cast("B")
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
