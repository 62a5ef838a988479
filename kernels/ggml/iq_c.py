"""The C twin of the lattice quantizers IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, and the only writer of IQ1_S and IQ1_M
(kernels/ggml/iq_c.c; kernels/ggml/iq1.py calls it): built once
per machine with the system C compiler and cached as kernels/ggml/kquant_c.py builds its file (same cache folders,
same flags), loaded with ctypes, and run on a pool of plain Python threads, each taking bands of rows one at a time
(a ctypes call releases the GIL; nothing spins).

Why C. The numpy codecs (kernels/ggml/iq3_s.py, iq2.py) make tens of array passes per trial scale; measured on
2048x2048 with an imatrix, one thread, they take 4-6x ggml's own C time. Here a block is searched in the L1 cache.

The lattice tables are the numpy path's own (iq_lattice.lattice(): grid points, code -> grid map, neighbour lists),
handed to C once per type, so both paths search the same candidates in the same order. The numpy codecs stay the
readable reference and the fallback: without a compiler, or with QCONVERT_COMPILE=0, `available()` is False.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from .kquant_c import _cache_dirs, _compiler, _spread

__all__ = ["available", "quantize", "dequantize_iq1", "quantize_k_imatrix", "K_IMATRIX_TYPES", "TYPE_IDS", "BLOCK_BYTES"]

# one library: the lattice quantizers, and the K quantizers with an importance matrix (kquant_imatrix_c.c)
_SOURCES = [Path(__file__).with_name("iq_c.c"), Path(__file__).with_name("kquant_imatrix_c.c")]
_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing"]
TYPE_IDS = {"IQ3_S": 0, "IQ3_XXS": 1, "IQ2_S": 2, "IQ2_XS": 3, "IQ2_XXS": 4, "IQ1_S": 5, "IQ1_M": 6}
BLOCK_BYTES = {"IQ3_S": 110, "IQ3_XXS": 98, "IQ2_S": 82, "IQ2_XS": 74, "IQ2_XXS": 66, "IQ1_S": 50, "IQ1_M": 56}
# the K types with an importance matrix this library quantizes (ggml's quantize_row_q*_K_impl), their ids, bytes
K_IMATRIX_TYPES = {"Q2_K": (2, 84), "Q3_K": (3, 110), "Q4_K": (4, 144), "Q5_K": (5, 176), "Q6_K": (6, 210)}
_ERRORS = {1: "no neighbour of finite weighted error: ggml's quantizer aborts on this input (GGML_ASSERT(grid_index "
              ">= 0) in its find_best_neighbour); the values or their weights overflow float32",
           2: "a block scale is NaN: ggml's quantizer aborts on this input (GGML_ASSERT(scale >= 0)); the values or "
              "their weights overflow float32",
           5: "IQ1_S needs an importance matrix: ggml asserts one (GGML_ASSERT(quant_weights))"}
# super-blocks per task handed to a thread: a few ms of work, so a thread slowed by another process leaves the
# rest to the others
_TASK_SUPER_BLOCKS = 256

_state: dict = {"lib": None, "tried": False, "tables": set()}
_lock = threading.Lock()


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not all(src.is_file() for src in _SOURCES):
        return None
    key = hashlib.sha256(b"\0".join([*(src.read_bytes() for src in _SOURCES), " ".join(_FLAGS).encode(), cc.encode(),
                                     platform.machine().encode(), platform.system().encode()])).hexdigest()[:20]
    name = f"iq_c-{key}.so"
    for folder in _cache_dirs():
        lib_path = folder / name
        if not lib_path.is_file():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".iq_c-", suffix=".so", dir=folder)
                os.close(fd)
                proc = subprocess.run([*cc.split(), *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"],
                                      capture_output=True, timeout=120)
                if proc.returncode != 0:
                    os.unlink(tmp)
                    return None
                os.replace(tmp, lib_path)  # atomic: concurrent builders each install a complete file
            except (OSError, subprocess.SubprocessError):
                continue
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError:
            continue
        if lib.qc_iq_abi_version() != 5:
            continue
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.qc_iq_quantize.restype = ctypes.c_int
        lib.qc_iq_quantize.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, i64]
        lib.qc_k_imatrix_quantize.restype = ctypes.c_int
        lib.qc_k_imatrix_quantize.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, i64]
        lib.qc_iq_portable_only.restype = None
        lib.qc_iq_portable_only.argtypes = [ctypes.c_int]
        lib.qc_iq_set_lattice.restype = None
        lib.qc_iq_set_lattice.argtypes = [ctypes.c_int] * 5 + [ptr] * 5
        lib.qc_iq1_stable_sort.restype = ctypes.c_int
        lib.qc_iq1_stable_sort.argtypes = []
        lib.qc_iq1_dequantize.restype = ctypes.c_int
        lib.qc_iq1_dequantize.argtypes = [ctypes.c_int, ptr, ptr, i64]
        return lib
    return None


def _lib():
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("QCONVERT_COMPILE", "1") != "0":
            _state["lib"] = _build()
    return _state["lib"]


def available() -> bool:
    """Whether the C lattice quantizers can run here (built or cached, and not disabled by QCONVERT_COMPILE=0)."""
    return os.environ.get("QCONVERT_COMPILE", "1") != "0" and _lib() is not None


def portable_only(on: bool) -> None:
    """Make the C searches skip their AVX2 versions and sort every tied IQ1 block with qsort (on=True), as on a CPU
    without AVX2 and a C library whose qsort is not stable, or take both shortcuts again where this machine allows
    them: for the tests, which compare both with ggml's bytes. Process-wide; call it with no quantize running."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C lattice quantizers are not available")
    lib.qc_iq_portable_only(1 if on else 0)


def iq1_ties_skip_qsort() -> bool:
    """Whether IQ1's block sort leaves tied values in their order without calling qsort: where this C library's
    qsort was found stable (glibc's is) by the probe of the first IQ1 quantize in the process."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C lattice quantizers are not available")
    _tables(lib, "IQ1_S")
    return bool(lib.qc_iq1_stable_sort())


def _tables(lib, type_name: str) -> None:
    """Hand iq_lattice.lattice(type_name)'s arrays to C once (they are cached read-only for the process)."""
    with _lock:
        if type_name in _state["tables"]:
            return
        from .iq_lattice import lattice

        lat = lattice("IQ1_S" if type_name == "IQ1_M" else type_name)  # one grid, one set of tables
        values = np.ascontiguousarray(lat.values, np.float32)
        kmap = np.ascontiguousarray(lat.kmap, np.int32)
        start = np.ascontiguousarray(lat.nb_start, np.int64)
        count = np.ascontiguousarray(lat.nb_count, np.int64)
        flat = np.ascontiguousarray(lat.nb_flat, np.int32)
        _state.setdefault("keep", []).append((values, kmap, start, count, flat))  # C keeps the pointers
        lib.qc_iq_set_lattice(TYPE_IDS[type_name], lat.bits, lat.dim, values.shape[0], kmap.size, values.ctypes.data,
                              kmap.ctypes.data, start.ctypes.data, count.ctypes.data, flat.ctypes.data)
        _state["tables"].add(type_name)


def quantize(x: np.ndarray, imatrix: np.ndarray | None, type_name: str, threads: int = 1) -> np.ndarray:
    """float32 [rows, n] (n % 256 == 0) -> uint8 [rows, n // 256 * block bytes], ggml_quantize_chunk's bytes.
    imatrix: [n] or None (the caller checks where ggml requires one). Bands of rows go to `threads` threads."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C lattice quantizers are not available")
    _tables(lib, type_name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    if n % 256:
        raise ValueError(f"row of {n} elements is not a multiple of {type_name}'s block of 256")
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if qw.size != n:
            raise ValueError(f"imatrix has {qw.size} values, the rows have {n} columns")
    out = np.empty((rows, n // 256 * BLOCK_BYTES[type_name]), np.uint8)
    tid = TYPE_IDS[type_name]
    band = max(1, _TASK_SUPER_BLOCKS // max(1, n // 256))
    errors = []

    def run(r0: int) -> None:
        rc = lib.qc_iq_quantize(tid, x.ctypes.data, n, None if qw is None else qw.ctypes.data, out.ctypes.data, r0,
                                min(rows, r0 + band))
        if rc:
            errors.append(rc)

    _spread(run, rows, threads, band)
    if errors:
        raise ValueError(_ERRORS.get(errors[0], f"the C lattice quantizer failed (code {errors[0]})"))
    return out


def dequantize_iq1(data: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """uint8 [rows, row bytes] of IQ1_S / IQ1_M super-blocks -> float32 [rows, row bytes / block bytes * 256]:
    ggml's dequantize_row_iq1_s / _iq1_m values, bit for bit. Bands of super-blocks go to `threads` threads."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C lattice kernels are not available")
    _tables(lib, "IQ1_S")
    bb = BLOCK_BYTES[type_name]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.shape[0] if data.ndim > 1 else 1
    if data.size % bb:
        raise ValueError(f"{data.size} bytes are not whole {type_name} blocks of {bb}")
    nb = data.size // bb
    out = np.empty((rows, nb // rows * 256), np.float32)
    tid, y0, x0 = TYPE_IDS[type_name], data.ctypes.data, out.ctypes.data
    step = 16 * _TASK_SUPER_BLOCKS

    def run(s: int) -> None:
        lib.qc_iq1_dequantize(tid, y0 + s * bb, x0 + s * 1024, min(nb, s + step) - s)

    _spread(run, nb, threads, step)
    return out


def c_twin(x: np.ndarray, imatrix: np.ndarray | None, type_name: str, threads: int | None) -> np.ndarray | None:
    """The default CPU path of kernels/ggml/iq3_s.py and iq2.py's quantize_*: this C twin's bytes (noted as kernel
    "c"), or None where it cannot run (no compiler, QCONVERT_COMPILE=0) and the numpy codec runs instead."""
    if not available():
        return None
    from ..dispatch import note_kernel, usable_cpus

    note_kernel("quantize", "c")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{type_name} quantizes rows: a 2-D array, not shape {x.shape}")
    threads = min(8, usable_cpus()) if threads is None else max(1, int(threads))
    return quantize(x, imatrix, type_name, threads)


def quantize_k_imatrix(x: np.ndarray, imatrix: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """float32 [rows, n] (n % 256 == 0) and an importance matrix [n] -> ggml_quantize_chunk's Q2_K .. Q6_K
    bytes [rows, n // 256 * block bytes] (quantize_row_q*_K_impl). Bands of rows go to `threads` threads."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C quantizers are not available")
    tid, bb = K_IMATRIX_TYPES[type_name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    qw = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
    if n % 256 or qw.size != n:
        raise ValueError(f"{type_name}: rows of {n} values (a multiple of 256 needed), imatrix of {qw.size}")
    out = np.empty((rows, n // 256 * bb), np.uint8)
    band = max(1, 4 * _TASK_SUPER_BLOCKS // max(1, n // 256))

    def run(r0: int) -> None:
        lib.qc_k_imatrix_quantize(tid, x.ctypes.data, n, qw.ctypes.data, out.ctypes.data, r0, min(rows, r0 + band))

    _spread(run, rows, threads, band)
    return out
