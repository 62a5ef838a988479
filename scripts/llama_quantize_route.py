"""llama-quantize as the benchmarks run it: the step of llama.cpp's route after its converter.

`QUANTIZE_SCRIPT` is run as `python -c QUANTIZE_SCRIPT IN.gguf OUT.gguf FTYPE THREADS [IMATRIX.dat]`, a fresh
process each time (so its time and peak memory are its own): `llama_model_quantize` through llama-cpp-python, with
the importance matrix, when given, handed over as `llama_model_imatrix_data` entries (the legacy .dat layout that
formats/gguf/imatrix.py also reads; each entry's sums divided by its call count, as llama-quantize's own loader
does). `write_synthetic_imatrix` makes such a file for every weight of a GGUF, so that both sides of a benchmark
quantize with the same matrix.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

QUANTIZE_SCRIPT = r"""
import ctypes, struct, sys
import numpy as np
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = int(sys.argv[3]); p.nthread = int(sys.argv[4])
keep = []
if len(sys.argv) > 5:
    data = open(sys.argv[5], "rb").read(); pos = 4; ents = []
    for _ in range(struct.unpack_from("<i", data, 0)[0]):
        n = struct.unpack_from("<i", data, pos)[0]; name = data[pos + 4:pos + 4 + n]; pos += 4 + n
        ncall, nval = struct.unpack_from("<ii", data, pos); pos += 8
        ents.append((name, np.frombuffer(data, np.float32, nval, pos) / ncall)); pos += 4 * nval
    arr = (llama_cpp.llama_model_imatrix_data * (len(ents) + 1))()
    for i, (name, v) in enumerate(ents):
        v = np.ascontiguousarray(v, np.float32); keep.append(v)
        arr[i].name = name; arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)); arr[i].size = v.size
    arr[len(ents)].name = None
    p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def ftype(name: str) -> int:
    """llama.cpp's file type number of a llama-quantize mix name (`q4_k_m`, `IQ2_XXS`, ...)."""
    import llama_cpp

    return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}"))


def write_synthetic_imatrix(gguf_path: Path, out: Path, seed: int = 1) -> int:
    """A legacy .dat importance matrix for every `.weight` of >= 2 dims in `gguf_path`: one float per input column,
    uniform in [0.5, 1.5), call count 1; a 3-D tensor (experts, MLA heads) gets one vector per slice, as
    llama-imatrix writes it and llama-quantize requires (ne0 x ne2 values), each slice's its own. Returns the entry
    count."""
    from gguf import GGUFReader

    rng = np.random.default_rng(seed)
    entries = []
    for t in GGUFReader(str(gguf_path)).tensors:
        dims = [int(d) for d in t.shape]
        if len(dims) < 2 or not t.name.endswith(".weight"):
            continue
        slices = int(np.prod(dims[2:], dtype=np.int64)) if len(dims) > 2 else 1
        entries.append((t.name, rng.uniform(0.5, 1.5, dims[0] * slices).astype(np.float32)))
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, vals in entries:
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, vals.size))
            f.write(vals.tobytes())
    return len(entries)
