"""ggml K-quant super-blocks (Q2_K..Q6_K) opened into a grid: codes, per-sub-block scales and mins.

A K super-block holds 256 elements of one row: fp16 `d` (and `dmin`), 6- or 8-bit sub-block scales and
the codes. ggml dequantizes in float32 as

    Q2_K, Q4_K, Q5_K:  x = (d * sc) * q - (dmin * m)     sub-blocks of 16 (Q2_K) or 32
    Q3_K:              x = (d * (sc - 32)) * (q - 4)      sub-blocks of 16, q = 3-bit code 0..7
    Q6_K:              x = (d * sc) * (q - 32)            sub-blocks of 16, sc int8, q = 6-bit code

so a grid with per-sub-block `scales = d * sc` (float32, one rounding, as ggml computes it) and
`mins = -(dmin * m)` (min form) or an integer zero point (4 / 32) reproduces ggml's values bit for
bit. Byte positions follow ggml's block_q2_K .. block_q6_K structs in ggml-common.h. Pure numpy, no model
code.
"""

from __future__ import annotations

import numpy as np

from .layouts import LAYOUTS

__all__ = ["unpack_k_blocks", "K_ZERO_POINT"]

QK_K = 256
# integer zero point of the symmetric K types (code - zero = ggml's signed value); None = min form
K_ZERO_POINT = {"Q2_K": None, "Q3_K": 4, "Q4_K": None, "Q5_K": None, "Q6_K": 32}


def _f16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] bytes -> [nb, 1] float32 (little-endian fp16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _crumbs(b: np.ndarray, group: int) -> np.ndarray:
    """2-bit fields: byte runs of `group` bytes hold elements j, j+group, j+2*group, j+3*group in bits
    0-1, 2-3, 4-5, 6-7. [nb, n_runs*group] -> [nb, n_runs*4*group]."""
    nb = b.shape[0]
    runs = b.reshape(nb, -1, 1, group) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (runs & 3).reshape(nb, -1)


def _nibbles(b: np.ndarray, group: int) -> np.ndarray:
    """4-bit fields: runs of `group` bytes hold elements j (low nibble) and j+group (high nibble)."""
    nb = b.shape[0]
    runs = b.reshape(nb, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(nb, -1)


def _bit_planes(b: np.ndarray) -> np.ndarray:
    """32 bytes, bit k of byte j = element 32*k + j -> [nb, 256] of 0/1."""
    nb = b.shape[0]
    planes = b.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (planes & 1).reshape(nb, QK_K)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 scale bytes -> (sc [nb, 8], m [nb, 8]), 6 bits each: sub-blocks 0-3 in the low 6 bits
    of bytes 0-3 / 4-7; sub-blocks 4-7 take their low 4 bits from bytes 8-11 and the top 2 bits from the
    top of bytes 0-3 / 4-7."""
    lo_sc, lo_m, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (mixed & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=1)
    m = np.concatenate([lo_m & 63, (mixed >> 4) | ((lo_m >> 2) & 0x30)], axis=1)
    return sc, m


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K 12 scale bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0-7 (low nibbles first, then
    high nibbles), top 2 bits from bytes 8-11 in 2-bit fields; stored with a +32 bias."""
    low = _nibbles(s[:, 0:8], 8)
    high = _crumbs(s[:, 8:12], 4)
    return (low | (high << 4)).astype(np.int16) - 32


def unpack_k_blocks(type_name: str, data: np.ndarray, with_codes: bool = True
                    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """uint8 [rows, row_bytes] of one K type -> (codes uint8 [rows, n] (None unless `with_codes`),
    scales float32 [rows, n/sub], mins float32 [rows, n/sub] or None). Mins None: the type has the
    integer zero point K_ZERO_POINT[type]."""
    lay = LAYOUTS[type_name]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.shape[0]
    nb = data.shape[1] // lay.nbytes
    b = data.reshape(rows * nb, lay.nbytes)
    mins = None
    if type_name == "Q2_K":
        sc_m, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
        codes = _crumbs(qs, 32) if with_codes else None
        scales = d * (sc_m & 0x0F).astype(np.float32)
        mins = -(dmin * (sc_m >> 4).astype(np.float32))
    elif type_name == "Q3_K":
        hmask, qs, sc, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        # a set high bit means "no -4": code = q + 4
        codes = _crumbs(qs, 32) | (_bit_planes(hmask) << 2) if with_codes else None
        scales = d * _q3_scales(sc).astype(np.float32)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _k4_scales(b[:, 4:16])
        if not with_codes:
            codes = None
        elif type_name == "Q4_K":
            codes = _nibbles(b[:, 16:144], 32)
        else:
            codes = _nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << 4)
        scales = d * sc.astype(np.float32)
        mins = -(dmin * m.astype(np.float32))
    elif type_name == "Q6_K":
        ql, qh, sc, d = b[:, 0:128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        codes = _nibbles(ql, 64) | (_crumbs(qh, 32) << 4) if with_codes else None
        scales = d * sc.view(np.int8).astype(np.float32)
    else:
        raise ValueError(f"{type_name} is not a K-quant type")
    n_sub = QK_K // lay.sub_block
    if codes is not None:
        codes = codes.astype(np.uint8).reshape(rows, nb * QK_K)
    scales = scales.astype(np.float32).reshape(rows, nb * n_sub)
    if mins is not None:
        mins = mins.astype(np.float32).reshape(rows, nb * n_sub)
    return codes, scales, mins
