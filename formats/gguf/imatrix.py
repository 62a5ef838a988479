"""llama.cpp importance matrices (`llama-imatrix` output), read for `--imatrix FILE`.

An importance matrix holds, per weight tensor (by its GGUF name, e.g. `blk.0.attn_q.weight`), the mean
squared activation of each input column: one float per column of a row (times the number of experts
for MoE tensors). llama-quantize passes that vector to the K quantizers, which then weigh each
column's error by it. Two file layouts exist (tools/imatrix/imatrix.cpp, common/imatrix-loader.cpp):

- legacy `.dat` (little-endian): int32 n_entries; per entry: int32 name length, the name bytes,
  int32 ncall, int32 nval, float32[nval] values (already divided by their count and multiplied by
  ncall); then optionally int32 chunk count, int32 length + dataset file name. llama-quantize uses
  value / ncall.
- GGUF (`general.type` = "imatrix"): per entry two F32 tensors `<name>.in_sum2` (sums, ne0 columns x
  experts) and `<name>.counts` (one count per expert); llama-quantize uses in_sum2 / count, or 1 for
  an expert that was never counted.

Both give float32 vectors computed exactly as llama-quantize computes them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ...converters.errors import BadInput

__all__ = ["read_imatrix"]


def read_imatrix(path) -> dict[str, np.ndarray]:
    """{gguf tensor name: float32 importance per input column} from either file layout."""
    path = Path(path)
    if not path.is_file():
        raise BadInput("imatrix file not found", path=path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path)


def _read_legacy(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise BadInput(f"truncated imatrix file (wanted {n} bytes at offset {pos})", path=path)
        chunk = data[pos:pos + n]
        pos += n
        return chunk

    (n_entries,) = struct.unpack("<i", take(4))
    if n_entries < 1:
        raise BadInput(f"not an imatrix file ({n_entries} entries)", path=path)
    out = {}
    for _ in range(n_entries):
        (length,) = struct.unpack("<i", take(4))
        if not 0 < length < 4096:
            raise BadInput(f"not an imatrix file (name length {length})", path=path)
        name = take(length).decode("utf-8", "replace")
        ncall, nval = struct.unpack("<ii", take(8))
        if nval < 1:
            raise BadInput(f"imatrix entry {name!r} has {nval} values", path=path)
        values = np.frombuffer(take(4 * nval), dtype="<f4").astype(np.float32)
        # llama-quantize: sums / ncall in float32 (the file stores mean * ncall)
        out[name] = values / np.float32(ncall) if ncall > 0 else values.copy()
    return out


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    import gguf

    from .reader import quiet_libraries, scan_header

    header = scan_header(path)  # every count and extent bounded by the file before gguf-py walks it
    try:
        with quiet_libraries():
            reader = gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - the walk accepted the header; gguf-py disagreeing is still bad input
        raise BadInput("GGUF imatrix header that gguf-py cannot parse", path=path) from None
    if len(reader.tensors) != len(header.tensors):
        raise BadInput("gguf-py reads a different tensor layout than the header describes", path=path)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts_t = tensors.get(base + ".counts")
        if counts_t is None:
            raise BadInput(f"imatrix entry {base!r} has sums but no counts", path=path)
        for tt in (t, counts_t):
            if _type_name(tt) != "F32":
                raise BadInput(f"imatrix tensor is {_type_name(tt)}, expected F32", path=path, tensor=tt.name)
        sums = np.array(t.data, dtype=np.float32).reshape(-1)
        # llama.cpp rounds the stored float counts to integers (lround), then divides in float32
        raw = np.array(counts_t.data, dtype=np.float64).reshape(-1)
        if raw.size == 0 or sums.size % raw.size:
            raise BadInput(f"imatrix entry {base!r} has {sums.size} sums for {raw.size} counts (one count per "
                           "expert, the same number of sums per count)", path=path, tensor=name)
        counts = (np.sign(raw) * np.floor(np.abs(raw) + 0.5)).astype(np.float32)
        per = sums.reshape(counts.size, -1)
        values = np.where(counts[:, None] > 0, per / np.where(counts > 0, counts, 1)[:, None], np.float32(1))
        out[base] = values.astype(np.float32).reshape(-1)
    if not out:
        raise BadInput("GGUF file holds no imatrix entries (<name>.in_sum2 / <name>.counts)", path=path)
    return out


def _type_name(t) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(t.tensor_type)).name
    except ValueError:
        return f"type {int(t.tensor_type)}"
