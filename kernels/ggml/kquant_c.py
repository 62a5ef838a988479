"""The C twin of the reference K-quantizers (kernels/ggml/kquant_c.c; also the legacy Q4_0 .. Q8_0 quantizers, the 1-2-bit
Q1_0 / Q2_0 / TQ1_0 / TQ2_0 ones (kernels/ggml/lowbit.py), the GPTQ
word decode and the GPTQ -> Q4_0 repack): built once per machine with the system C compiler, cached, loaded with
ctypes, and run on a pool of Python threads (a ctypes call releases the GIL).

Why C. The numpy codecs in kernels/ggml/kquants.py make many passes over every chunk, and their compiled
searches (kernels/ggml/kquant_fused.py) cost each new process 10-15 s of torch.compile tracing before the
first tensor, and run on OpenMP threads that wait at barriers: with another process on one of two cores,
every barrier waits for the descheduled thread. Here a tile of 32 sub-blocks is searched entirely in the
L1 cache by loops the compiler vectorizes, the build is cached on disk (`cc` once per machine, 1-5 s), and the work is
split into chunks that a pool of plain threads takes one at a time: a thread that gets less of the CPU
simply takes fewer chunks, and nothing spins.

Exactness: the same float32 expressions in the same order as ggml's C and the numpy codecs (compiled
with -ffp-contract=off, no fast-math); tests/kernels/test_kquants.py checks the bytes against both.

Without a C compiler, or with QCONVERT_COMPILE=0, `available()` is False and kernels/ggml/kquants.py uses its
numpy (and torch.compile) paths; all give the same bytes. The cache folder is $QCONVERT_CACHE_DIR, else
$XDG_CACHE_HOME/qconvert, else ~/.cache/qconvert (a temporary folder when none is writable).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .layouts import LAYOUTS

__all__ = ["available", "quantize", "quantize_legacy", "quantize_lowbit", "LOWBIT_TYPE_IDS", "dequantize", "dequantize_gptq", "gptq4_to_q4_0", "gptq_to_q8_0", "error_stats", "TYPE_IDS",
           "LEGACY_TYPE_IDS", "CHUNK_BLOCKS"]

_SOURCE = Path(__file__).with_name("kquant_c.c")
_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing"]
TYPE_IDS = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
LEGACY_TYPE_IDS = {"Q4_0": 40, "Q4_1": 41, "Q5_0": 50, "Q5_1": 51, "Q8_0": 80}
# the 1- and 2-bit types: (qc_quantize_lowbit's type, elements per block, bytes per block)
LOWBIT_TYPE_IDS = {"Q1_0": (1, 128, 18), "Q2_0": (2, 64, 18), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66)}
_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# super-blocks per task handed to a thread (512K values, 2 MiB of float32): small enough that a thread
# slowed by another process leaves the rest to the others, large enough that a call costs nothing
CHUNK_BLOCKS = 2048

_state: dict = {"lib": None, "tried": False}


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("QCONVERT_CACHE_DIR"):
        dirs.append(Path(os.environ["QCONVERT_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append(Path(xdg) / "qconvert" if xdg else Path.home() / ".cache" / "qconvert")
    dirs.append(Path(tempfile.gettempdir()) / f"qconvert-cache-{os.getuid() if hasattr(os, 'getuid') else 0}")
    return dirs


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc.split()[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not _SOURCE.is_file():
        return None
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), cc.encode(), platform.machine().encode(),
                                     platform.system().encode()])).hexdigest()[:20]
    name = f"kquant_c-{key}.so"
    for folder in _cache_dirs():
        lib_path = folder / name
        if not lib_path.is_file():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".kquant_c-", suffix=".so", dir=folder)
                os.close(fd)
                proc = subprocess.run([*cc.split(), *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                                      capture_output=True, timeout=120)
                if proc.returncode != 0:
                    os.unlink(tmp)
                    return None  # the compiler refused the source: no folder would help
                os.replace(tmp, lib_path)  # atomic: concurrent builders each install a complete file
            except (OSError, subprocess.SubprocessError):
                continue  # an unwritable folder: the next one
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError:
            continue
        if lib.qc_abi_version() != 8:
            continue
        for fn in (lib.qc_quantize_k, lib.qc_dequantize_k, lib.qc_quantize_legacy, lib.qc_quantize_lowbit):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.qc_dequant_gptq.restype = ctypes.c_int
        lib.qc_dequant_gptq.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64]
        lib.qc_gptq4_to_q4_0.restype = ctypes.c_int
        lib.qc_gptq4_to_q4_0.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
        lib.qc_q4_0_check_gptq4.restype = i64
        lib.qc_q4_0_check_gptq4.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
        lib.qc_gptq_to_q8_0.restype = i64
        lib.qc_gptq_to_q8_0.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.qc_q8_0_check_gptq.restype = i64
        lib.qc_q8_0_check_gptq.argtypes = [ptr, ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, i64]
        lib.qc_error_stats.restype = ctypes.c_double
        lib.qc_error_stats.argtypes = [ptr, ptr, i64, ctypes.POINTER(ctypes.c_double)]
        return lib
    return None


def _lib():
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("QCONVERT_COMPILE", "1") != "0":
            _state["lib"] = _build()
    return _state["lib"]


def available() -> bool:
    """Whether the C quantizers can run here (built or cached, and not disabled by QCONVERT_COMPILE=0)."""
    return os.environ.get("QCONVERT_COMPILE", "1") != "0" and _lib() is not None


def quantize(xb: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """xb float32 (nb, 256) C-contiguous super-blocks -> uint8 (nb, block_bytes), as ggml's
    quantize_row_*_K_ref. Chunks of CHUNK_BLOCKS super-blocks go to `threads` threads as they free up."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C K-quantizers are not available")
    xb = np.ascontiguousarray(xb, dtype=np.float32)
    nb = xb.shape[0]
    bb = _BLOCK_BYTES[type_name]
    out = np.empty((nb, bb), np.uint8)
    tid = TYPE_IDS[type_name]
    fn = lib.qc_quantize_k
    x0, y0 = xb.ctypes.data, out.ctypes.data

    def run(s: int) -> None:
        e = min(nb, s + CHUNK_BLOCKS)
        fn(tid, x0 + s * 1024, y0 + s * bb, e - s)

    _spread(run, nb, threads)
    return out


def quantize_legacy(x: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """float32 [..., n] (n % 32 == 0) -> uint8 [..., n/32*block_bytes], as ggml's quantize_row_q4_0_ref ..
    quantize_row_q8_0_ref. Chunks of 8*CHUNK_BLOCKS blocks of 32 (the K chunk's values) go to `threads` threads."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C quantizers are not available")
    x = np.ascontiguousarray(x, dtype=np.float32)
    nb = x.size // 32
    bb = LAYOUTS[type_name].nbytes
    out = np.empty((*x.shape[:-1], x.shape[-1] // 32 * bb), np.uint8)
    tid = LEGACY_TYPE_IDS[type_name]
    fn = lib.qc_quantize_legacy
    x0, y0 = x.ctypes.data, out.ctypes.data
    step = 8 * CHUNK_BLOCKS

    def run(s: int) -> None:
        e = min(nb, s + step)
        fn(tid, x0 + s * 128, y0 + s * bb, e - s)

    _spread(run, nb, threads, step)
    return out


def quantize_lowbit(x: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """float32 [..., n] (n a whole number of blocks) -> uint8 [..., n/block*block_bytes], as ggml's
    quantize_row_q1_0_ref / _q2_0_ref / _tq1_0_ref / _tq2_0_ref (blocks never straddle rows, so quantizing the
    whole buffer as one row, as ggml_quantize_chunk does without an imatrix, gives the same bytes)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C quantizers are not available")
    tid, block, bb = LOWBIT_TYPE_IDS[type_name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"rows of {x.shape[-1]} are not whole {type_name} blocks of {block}")
    nb = x.size // block
    out = np.empty((*x.shape[:-1], x.shape[-1] // block * bb), np.uint8)
    x0, y0 = x.ctypes.data, out.ctypes.data
    step = max(1, (1 << 19) // block)  # 512K values per task, as the K chunks

    def run(s: int) -> None:
        lib.qc_quantize_lowbit(tid, x0 + s * block * 4, y0 + s * bb, min(nb, s + step) - s)

    _spread(run, nb, threads, step)
    return out


def dequantize(blocks: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """uint8 (nb, block_bytes) -> float32 (nb, 256): the values kernels/ggml/kquants.py's dequantizers give."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C K-quantizers are not available")
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    nb = blocks.shape[0]
    bb = _BLOCK_BYTES[type_name]
    out = np.empty((nb, 256), np.float32)
    tid = TYPE_IDS[type_name]
    fn = lib.qc_dequantize_k
    y0, x0 = blocks.ctypes.data, out.ctypes.data

    def run(s: int) -> None:
        e = min(nb, s + 4 * CHUNK_BLOCKS)
        fn(tid, y0 + s * bb, x0 + s * 1024, e - s)

    _spread(run, nb, threads, 4 * CHUNK_BLOCKS)
    return out


def dequantize_gptq(words: np.ndarray, bits: int, in_features: int, scales: np.ndarray, offsets: np.ndarray,
                    min_form: bool, group_of_column: np.ndarray, threads: int = 1) -> np.ndarray:
    """GPTQ words int32 [in*bits/32, out] -> float32 [out, in]: (q - z) * s, or s * q + m with
    `min_form`, scales / offsets float32 [out, n_groups], group_of_column int [in] (kernels/dequant.py's
    float32 values, bit for bit)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C kernels are not available")
    words = np.ascontiguousarray(words).view(np.uint32)
    out_f = words.shape[1]
    s = np.ascontiguousarray(scales, dtype=np.float32)
    z = np.ascontiguousarray(offsets, dtype=np.float32)
    g = np.ascontiguousarray(group_of_column, dtype=np.int32)
    if s.shape != z.shape or s.shape[0] != out_f or g.shape != (in_features,) or words.shape[0] * 32 // bits != in_features:
        raise ValueError("inconsistent GPTQ shapes")
    if g.size and (int(g.min()) < 0 or int(g.max()) >= s.shape[1]):
        raise ValueError("group index out of range")
    out = np.empty((out_f, in_features), np.float32)
    fn = lib.qc_dequant_gptq
    rows = max(16, (1 << 20) // max(1, in_features) // 16 * 16)  # ~1M values per task

    def run(n0: int) -> None:
        fn(words.ctypes.data, bits, out_f, in_features, s.ctypes.data, z.ctypes.data, int(min_form), g.ctypes.data,
           s.shape[1], out.ctypes.data, n0, min(out_f, n0 + rows))

    _spread(run, out_f, threads, rows)
    return out


def gptq4_to_q4_0(words: np.ndarray, d16: np.ndarray, threads: int = 1) -> tuple[np.ndarray, int]:
    """GPTQ 4-bit words int32 [in/8, out] and fp16 block scales [out, in/32] -> (Q4_0 bytes uint8
    [out, in/32*18], the number of source words and scales that the bytes do not give back when decoded
    the other way: 0, or a bug). kernels/ggml/gptq_q4_0.py is the torch twin."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C kernels are not available")
    words = np.ascontiguousarray(words).view(np.uint32)
    in8, out_f = words.shape
    in_f = in8 * 8
    d = np.ascontiguousarray(d16, dtype=np.float16).view(np.uint16)
    if in_f % 32 or d.shape != (out_f, in_f // 32):
        raise ValueError("inconsistent GPTQ / Q4_0 shapes")
    def band(out: np.ndarray, n0: int, n1: int) -> int:
        lib.qc_gptq4_to_q4_0(words.ctypes.data, d.ctypes.data, out.ctypes.data, out_f, in_f, n0, n1)
        return lib.qc_q4_0_check_gptq4(out.ctypes.data, words.ctypes.data, d.ctypes.data, out_f, in_f, n0, n1)

    return _repack_in_bands(band, out_f, in_f, 18, threads)


def _repack_in_bands(band, out_f: int, in_f: int, block_bytes: int, threads: int) -> tuple[np.ndarray, int]:
    """A word repack into ggml blocks of 32, row band by row band on `threads` threads: `band(out, n0, n1)` writes
    rows n0 .. n1 and returns the count its proof found wrong. -> (blocks uint8 [out, in/32 * block_bytes], that
    count summed)."""
    out = np.empty((out_f, in_f // 32 * block_bytes), np.uint8)
    rows = max(32, (1 << 21) // max(1, in_f) // 32 * 32)
    bad = []

    def run(n0: int) -> None:
        bad.append(band(out, n0, min(out_f, n0 + rows)))

    _spread(run, out_f, threads, rows)
    return out, int(sum(bad))


def gptq_to_q8_0(words: np.ndarray, bits: int, zeros: np.ndarray, d16: np.ndarray,
                 threads: int = 1) -> tuple[np.ndarray, int]:
    """GPTQ 2/4/8-bit words int32 [in * bits / 32, out], integer zero points and fp16 scales per 32-block
    [out, in/32] -> (Q8_0 bytes uint8 [out, in/32*34] holding code - zero, the number of values out of int8 range
    plus the source words and scales that the bytes do not give back when decoded the other way: 0, or a bug).
    legacy.repack_grid is the torch twin (the same bytes for an exact grid)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C kernels are not available")
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit GPTQ words do not split into 32-blocks")
    words = np.ascontiguousarray(words).view(np.uint32)
    n_words, out_f = words.shape
    in_f = n_words * 32 // bits
    z = np.ascontiguousarray(zeros, dtype=np.int32)
    d = np.ascontiguousarray(d16, dtype=np.float16).view(np.uint16)
    if in_f % 32 or d.shape != (out_f, in_f // 32) or z.shape != d.shape:
        raise ValueError("inconsistent GPTQ / Q8_0 shapes")
    def band(out: np.ndarray, n0: int, n1: int) -> int:
        out_of_range = lib.qc_gptq_to_q8_0(words.ctypes.data, bits, z.ctypes.data, d.ctypes.data, out.ctypes.data,
                                           out_f, in_f, n0, n1)
        return out_of_range + lib.qc_q8_0_check_gptq(out.ctypes.data, words.ctypes.data, bits, z.ctypes.data,
                                                     d.ctypes.data, out_f, in_f, n0, n1)

    return _repack_in_bands(band, out_f, in_f, 34, threads)


def error_stats(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |got - ref|, sum of (got - ref)^2 in double) of two float32 arrays of one size, in one pass (the report's
    measurement, converters/report.py). The max is NaN where a difference is NaN."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C kernels are not available")
    got = np.ascontiguousarray(got, dtype=np.float32)
    ref = np.ascontiguousarray(ref, dtype=np.float32)
    if got.size != ref.size:
        raise ValueError(f"error_stats: {got.size} values against {ref.size}")
    total = ctypes.c_double(0.0)
    top = lib.qc_error_stats(got.ctypes.data, ref.ctypes.data, got.size, ctypes.byref(total))
    return float(top), float(total.value)


def _spread(run, nb: int, threads: int, step: int = 0) -> None:
    """run(start) for every chunk start, on up to `threads` threads that take the chunks one at a time."""
    starts = range(0, nb, step or CHUNK_BLOCKS)
    if threads <= 1 or len(starts) < 2:
        for s in starts:
            run(s)
        return
    with ThreadPoolExecutor(min(threads, len(starts))) as pool:
        list(pool.map(run, starts))
