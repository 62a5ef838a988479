"""What ggml's lattice-codebook quantizers (IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS) share: the grid tables, the
search for the grid point a group of values takes, and the per-block steps around it.

A group (4 values for the IQ3 types, 8 for IQ2) is rounded coordinate by coordinate to codes l (0 .. 2**bits - 1,
the lattice value 2*l + 1), packed as u = sum(l_i << bits*i). When u is a grid point, kmap[u] is its index; when
it is not, the quantizers pick, among u's precomputed neighbours, the grid point of least weighted error
sum(w_i * (scale*q_i - x_i)**2) (ggml-quants.c iq3_find_best_neighbour / iq2_find_best_neighbour).

`lattice(type)` builds the tables as iq3xs_init_impl / iq2xs_init_impl do, from the packed grid points of
kernels/ggml/iq_grids.py: the grid's values; the map (grid index, or -1 off the grid) over kmap_size codes (4096 for
3 bits x 4; the C source's 43692 for 2 bits x 8, which covers every code of 0..2 the IQ2 quantizers produce);
and for every code off the grid its neighbour list: the grid points at the `nwant` smallest distinct squared
distances, ordered by (distance, index) as C's qsort with iq3_compare_func / iq2_compare_func leaves them
(nwant: IQ3_S, IQ1_S, IQ1_M 3, IQ3_XXS / IQ2_XXS / IQ2_XS 2, IQ2_S 1). Built once per type on first use, in numpy
(milliseconds for the 3-bit grids, 0.1-0.2 s for the 2-bit ones; C's init takes seconds for IQ2_S's).

`grid_indices` is the search for many groups at once, exact in float32: the weighted error of every candidate
is evaluated in C's order (d2 = 0; d2 += (w*diff)*diff, diff = scale*q - x) and the first strict minimum
below FLT_MAX wins, as C's `d2 < best_d2` scan from best_d2 = FLT_MAX does. A group with no such candidate
(every error inf or NaN, as overflowing inputs give) is where C's GGML_ASSERT(grid_index >= 0) aborts the
process; here it raises ValueError. The candidates of all off-grid groups are evaluated together, in tiers of
list length padded by repeating a list's last entry (a repeat never wins: argmin keeps the first minimum).

Around it, the block steps the five quantize_row_*_impl share, each vectorized over all blocks of a band:
`lattice_weights` (C's weight[] with or without an imatrix), `signs_and_values` / `even_signs` (the signs taken
off; the even-parity flip of the types storing 7 sign bits per 8), `search_blocks` (the trial scales and the
refinement), `positive_scales` (C's sign check and assert) and `super_scales` (the fp16 d and 4-bit block scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import iq_grids
from .iq4_nl import seq_sum
from .iq4_xs import nearest_int

__all__ = ["Lattice", "lattice", "grid_indices", "codes_of", "lattice_weights", "groups_of", "search_blocks",
           "positive_scales", "super_scales", "signs_and_values", "even_signs", "sign_bytes", "parity_sign_values",
           "decode_values", "F32_MAX"]

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)  # C's FLT_MAX

# type -> (packed grid points, bits per coordinate, coordinates, kmap_size, nwant): iq3xs_init_impl(grid_size)
# and iq2xs_init_impl(type)
_SPECS = {
    "IQ3_S": (iq_grids.KGRID_3BIT_512, 3, 4, 4096, 3),
    "IQ3_XXS": (iq_grids.KGRID_3BIT_256, 3, 4, 4096, 2),
    "IQ2_XXS": (iq_grids.KGRID_2BIT_256, 2, 8, 43692, 2),
    "IQ2_XS": (iq_grids.KGRID_2BIT_512, 2, 8, 43692, 2),
    "IQ2_S": (iq_grids.KGRID_2BIT_1024, 2, 8, 43692, 1),
    # IQ1_S and IQ1_M share one grid and one init (iq2_data_index maps both to slot 2): the same tables
    "IQ1_S": (iq_grids.KGRID_1BIT_2048, 2, 8, 43692, 3),
    "IQ1_M": (iq_grids.KGRID_1BIT_2048, 2, 8, 43692, 3),
}


@dataclass(frozen=True)
class Lattice:
    bits: int  # bits per coordinate code
    dim: int  # coordinates per group
    values: np.ndarray  # float32 [grid, dim]: the odd lattice values 2*l + 1 of every grid point
    values_t: np.ndarray  # the same [dim, grid], contiguous per coordinate
    kmap: np.ndarray  # int32 [kmap_size]: grid index of code u, -1 when u is off the grid
    nb_start: np.ndarray  # int64 [kmap_size]: where u's neighbour list starts in nb_flat (off-grid u only)
    nb_count: np.ndarray  # int64 [kmap_size]: its length (0 for grid points)
    nb_flat: np.ndarray  # int32: every neighbour list, one after another


def codes_of(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Packed codes [m] -> their coordinates' codes l [m, dim] (coordinate i in bits bits*i ..)."""
    shifts = bits * np.arange(dim)
    return (np.asarray(packed, np.int64)[:, None] >> shifts) & ((1 << bits) - 1)


@lru_cache(maxsize=None)
def lattice(type_name: str) -> Lattice:
    """The tables of one type, derived as its init function derives them (see the module doc)."""
    kgrid, bits, dim, kmap_size, nwant = _SPECS[type_name]
    grid_codes = codes_of(np.array(kgrid), bits, dim)  # [G, dim]
    values = (2 * grid_codes + 1).astype(F32)
    kmap = np.full(kmap_size, -1, np.int32)
    kmap[np.array(kgrid)] = np.arange(len(kgrid), dtype=np.int32)
    off = np.flatnonzero(kmap < 0)
    # squared distances between lattice values, coordinate by coordinate: (2a+1 - (2b+1))**2 = 4*(a-b)**2
    levels = np.arange(1 << bits)
    sq = (4 * (levels[:, None] - levels[None, :]) ** 2).astype(np.int16)  # [code, code]
    to_grid = [np.ascontiguousarray(sq[:, grid_codes[:, i]]) for i in range(dim)]  # [code, G] per coordinate
    starts = np.zeros(kmap_size, np.int64)
    counts = np.zeros(kmap_size, np.int64)
    lists = []
    total = 0
    for lo in range(0, off.size, 4096):  # in chunks: [chunk, G] distances
        us = off[lo:lo + 4096]
        ucodes = codes_of(us, bits, dim)
        d2 = np.zeros((us.size, len(kgrid)), np.int16)
        for i in range(dim):
            d2 += to_grid[i][ucodes[:, i]]
        # the nwant smallest distinct distances: the last of them bounds the list
        thr = d2.min(axis=1)
        for _ in range(nwant - 1):
            bigger = np.where(d2 > thr[:, None], d2, np.int16(np.iinfo(np.int16).max))
            thr = np.minimum(bigger.min(axis=1), np.int16(np.iinfo(np.int16).max))
        row, j = np.nonzero(d2 <= thr[:, None])
        order = np.lexsort((j, d2[row, j], row))  # by code, then distance, then grid index: C's qsort order
        lists.append(j[order].astype(np.int32))
        n = np.bincount(row, minlength=us.size)
        counts[us] = n
        starts[us] = total + np.concatenate([[0], np.cumsum(n)[:-1]])
        total += int(n.sum())
    nb_flat = np.concatenate(lists) if lists else np.zeros(0, np.int32)
    values_t = np.ascontiguousarray(values.T)
    for a in (values, values_t, kmap, starts, counts, nb_flat):
        a.setflags(write=False)
    return Lattice(bits, dim, values, values_t, kmap, starts, counts, nb_flat)


def grid_indices(lat: Lattice, u: np.ndarray, xval: np.ndarray, waux: np.ndarray, scale: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Groups' packed codes u [m] -> (grid index [m] int32, on the grid [m] bool). A code on the grid keeps its
    point; one off it takes the neighbour of least sum(waux * (scale*q - xval)**2), float32 in C's order
    (iq*_find_best_neighbour). xval, waux: [dim, m] the groups' values and weights, coordinate-major; scale: [m]."""
    gi = lat.kmap[u]
    on = gi >= 0
    miss = np.flatnonzero(~on)
    if miss.size:
        gi[miss] = _best_neighbours(lat, u[miss], xval[:, miss], waux[:, miss], scale[miss])
    return gi, on


def lattice_weights(x: np.ndarray, qw: np.ndarray | None, block: int, *, sigma2_factor: int = 2,
                    plain: str = "x2") -> tuple[np.ndarray, np.ndarray]:
    """A band of whole rows [rows, n] -> (X, W) [block, blocks] element-major (block b: row-major block b of the
    band): the values and C's weight[] for them. With an imatrix qw * sqrtf(sigma2 + x*x), sigma2 =
    sigma2_factor*sumx2/256 (sumx2 over the 256-element super-block in element order; IQ3_S, IQ2_S: 2, IQ2_XS /
    IQ2_XXS / IQ3_XXS: 1), block i of a row taking qw[block*i:]; without one x*x (plain "x2": IQ3_S) or
    0.25f*sigma2 + x*x (plain "sigma2": IQ2_S)."""
    rows, n = x.shape
    X = np.ascontiguousarray(x.reshape(-1, block).T)
    X2 = X * X
    if qw is None and plain == "x2":
        return X, X2
    per = 256 // block  # QK_K
    S2 = np.ascontiguousarray(X2.reshape(block, -1, per).transpose(2, 0, 1)).reshape(256, -1)
    sumx2 = seq_sum(S2)
    sigma2 = np.repeat((F32(sigma2_factor) * sumx2 if sigma2_factor != 1 else sumx2) / F32(256), per)
    if qw is None:
        return X, F32(0.25) * sigma2 + X2
    QW = np.tile(qw.reshape(-1, block), (rows, 1)).T
    return X, QW * np.sqrt(sigma2 + X2)


def groups_of(a: np.ndarray, dim: int) -> np.ndarray:
    """[block, m] element-major -> [dim, groups * m] coordinate-major: coordinate i of group k of block b at
    [i, k*m + b]."""
    return np.ascontiguousarray(a.reshape(a.shape[0] // dim, dim, -1).transpose(1, 0, 2)).reshape(dim, -1)


def _codes_to_grid(lat: Lattice, id_: np.ndarray, scale: np.ndarray, xg: np.ndarray, wg: np.ndarray, kmaxq: int):
    """One pass over groups (columns of xg / wg, [dim, g]; id_, scale [g]): codes l = clamp(nearest_int(0.5*
    (id*x - 1)), 0, kmaxq - 1), packed to u, then grid_indices at `scale` -> (grid index [g], on the grid [g])."""
    lv = np.clip(nearest_int(F32(0.5) * (id_ * xg - F32(1))), 0, kmaxq - 1)
    u = lv[0].copy()
    for i in range(1, lat.dim):
        u |= lv[i] << (lat.bits * i)
    return grid_indices(lat, u, xg, wg, scale)


def _values_of(lat: Lattice, gi: np.ndarray, m: int) -> np.ndarray:
    """Grid indices [groups * m] (group-major) -> the lattice values q = 2*l + 1 as [block, m] element-major."""
    return lat.values_t[:, gi].reshape(lat.dim, -1, m).transpose(1, 0, 2).reshape(-1, m)


def search_blocks(lat: Lattice, xv: np.ndarray, w: np.ndarray, mx: np.ndarray, *, kmaxq: int, step: float,
                  refine: str, trials: int = 9, start_scale: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The scale search the IQ3_S / IQ3_XXS / IQ2_S / IQ2_XS / IQ2_XXS quantize_row_*_impl share, for live blocks.

    xv: [block, m] |x| element-major; w: C's weight[] alike; mx: [m] the range the trials divide: each block's
    largest |x| (above the type's dead threshold), IQ2_XXS's eff_max. Trial scales id = (2*kmaxq - 1 +
    is*step)/mx, is = -trials..trials (IQ3_XXS 15, IQ2_XXS 6, the others 9), each coding the groups (off the
    grid: best neighbour at 1/id) and kept when sumqx^2 > best*sumq2, scale = sumqx/sumq2 (from best 0, codes 0
    = grid point 0, scale start_scale or mx/(2*kmaxq - 1)). Then the codes once more from id = 1/scale, the
    neighbours searched at that scale, and scale = sumqx/sumq2 refitted (when sumq2 > 0), per `refine`:
    "all" (IQ3_S: where the kept codes had a group off the grid, groups starting off it, every group of the
    block), "off" (IQ3_XXS, IQ2_S, IQ2_XS: the same test, groups starting on the grid, only the off-grid
    groups), "always" (IQ2_XXS: every group) -- and only where the scale is positive.
    -> (scale [m] float32, as C leaves it before its sign check; grid index [groups, m] int32)."""
    m = mx.size
    groups = xv.shape[0] // lat.dim
    if m == 0:
        return np.zeros(0, F32), np.zeros((groups, 0), np.int32)
    xg, wg = groups_of(xv, lat.dim), groups_of(np.sqrt(w), lat.dim)  # waux = sqrtf(weight)
    wx = w * xv  # w*xval: sumqx's first product
    top = F32(2 * kmaxq - 1)
    scale = mx / top if start_scale is None else start_scale
    best = np.zeros(m, F32)
    GI = np.zeros((groups, m), np.int32)  # L = 0: grid point 0 (u = 0 is on every grid)
    on_grid = np.full((groups, m), refine != "all")
    for is_ in range(-trials, trials + 1):
        id_ = (top + F32(is_) * F32(step)) / mx
        gi, on = _codes_to_grid(lat, np.tile(id_, groups), np.tile(F32(1) / id_, groups), xg, wg, kmaxq)
        q = _values_of(lat, gi, m)
        sumqx, sumq2 = seq_sum(wx * q), seq_sum(w * q * q)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(better, sumqx / np.where(better, sumq2, F32(1)), scale)
        best = np.where(better, scale * sumqx, best)
        GI = np.where(better, gi.reshape(groups, m), GI)
        on_grid = np.where(better, on.reshape(groups, m), on_grid)
    redo_block = (scale > 0) if refine == "always" else (~on_grid).any(axis=0) & (scale > 0)
    if redo_block.any():
        pick = ~on_grid & redo_block if refine == "off" else np.broadcast_to(redo_block, on_grid.shape)
        redo = np.flatnonzero(pick.reshape(-1))  # group k of block b at k*m + b
        s = np.tile(scale, groups)[redo]
        gi, _ = _codes_to_grid(lat, F32(1) / s, s, xg[:, redo], wg[:, redo], kmaxq)
        GI.reshape(-1)[redo] = gi
        blocks = np.flatnonzero(redo_block)
        q = _values_of(lat, GI[:, blocks].reshape(-1), blocks.size)
        sumqx, sumq2 = seq_sum(wx[:, blocks] * q), seq_sum(w[:, blocks] * q * q)
        scale[blocks] = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), scale[blocks])
    return scale, GI


def signs_and_values(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[block, nb] values -> (sign mask: C's failed `x >= 0`, xval = |x| as C forms it, each block's largest)."""
    neg = ~(X >= 0)
    XV = np.where(neg, -X, X)
    return neg, XV, XV.max(axis=0)


def even_signs(X: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The IQ2_XS / IQ2_XXS / IQ3_XXS signs: each group of 8 values stores 7 sign bits, the 8th implied by even
    parity. A group with an odd number of negatives flips the sign of its value of least weight*x*x (the first
    such: C's strict `<`), whose |x| then enters the search negated. [block, nb] element-major -> (sign mask
    with that flip, xval, each block's largest xval)."""
    neg, XV, _ = signs_and_values(X)
    rows, nb = X.shape
    groups = rows // 8
    odd = (neg.reshape(groups, 8, nb).sum(axis=1) % 2) == 1  # [groups, nb]
    imin = np.argmin((W * X * X).reshape(groups, 8, nb), axis=1)  # `weight*x*x`, the first minimum
    g, b = np.nonzero(odd)
    e = 8 * g + imin[g, b]
    XV[e, b] = -XV[e, b]
    neg[e, b] = ~neg[e, b]
    return neg, XV, XV.max(axis=0)


def sign_bytes(neg: np.ndarray) -> np.ndarray:
    """Sign mask [block, nb] element-major -> [nb, block / 8] bytes, bit i of byte k the sign of value 8*k + i."""
    bits = neg.T.reshape(neg.shape[1], -1, 8).astype(np.uint8)
    return (bits << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)


def parity_sign_values(s7: np.ndarray) -> np.ndarray:
    """7 stored sign bits -> [..., 8] of +-1.0: bit 7 set when the 7 have odd parity (ggml's ksigns_iq2xs)."""
    bits = (s7[..., None] >> np.arange(7)) & 1
    bits = np.concatenate([bits, bits.sum(axis=-1, keepdims=True) & 1], axis=-1)
    return np.where(bits == 1, F32(-1), F32(1))


# the decoders' value of each coordinate code (ggml-common.h's grids, gguf-py's grid_map): IQ3_S the lattice's own
# 2*l + 1, IQ3_XXS 4*(2*l + 1) but 62 for code 7, the IQ2 types 0x08, 0x19, 0x2b
_DECODE_LEVELS = {"IQ3_S": (1, 3, 5, 7, 9, 11, 13, 15), "IQ3_XXS": (4, 12, 20, 28, 36, 44, 52, 62),
                  "IQ2_XXS": (8, 25, 43), "IQ2_XS": (8, 25, 43), "IQ2_S": (8, 25, 43)}


@lru_cache(maxsize=None)
def decode_values(type_name: str) -> np.ndarray:
    """The decoders' grid [points, dim] float32: the lattice's codes mapped to the type's coordinate values."""
    codes = ((lattice(type_name).values - 1) // 2).astype(np.int64)
    out = np.array(_DECODE_LEVELS[type_name], F32)[codes]
    out.setflags(write=False)
    return out


def positive_scales(scale: np.ndarray, quantizer: str) -> tuple[np.ndarray, np.ndarray]:
    """C's end of a block: a negative scale ("should never happen": only negative weights make one) is negated
    and the block's signs flipped (-> flip mask); GGML_ASSERT(scale >= 0) aborts on a NaN one, raised here."""
    if np.isnan(scale).any():
        raise ValueError(f"a block scale is NaN: ggml's {quantizer} aborts on this input (GGML_ASSERT(scale >= "
                         f"0)); the values or their weights overflow float32")
    flip = scale < 0
    return np.where(flip, -scale, scale), flip


def super_scales(scales: np.ndarray, mult: float) -> tuple[np.ndarray, np.ndarray]:
    """Block scales [super-blocks, blocks] (0 for dead blocks) -> (fp16 d [super-blocks], 4-bit scales l): with
    max_scale their largest, d = max_scale/31 stored as fp16(d*mult) (IQ3_S 1.033f, IQ2_S 0.9875f, IQ2_XS 1)
    and l = nearest_int(0.5f*(id*scale - 1)) clamped to 0..15, id = 1/d; a super-block whose max_scale is 0
    keeps d = 0 and l = 0 (C `continue`s before writing them)."""
    max_scale = scales.max(axis=1)
    live = max_scale != 0
    d = max_scale / F32(31)
    inv = F32(1) / np.where(live, d, F32(1))
    ls = np.clip(nearest_int(F32(0.5) * (inv[:, None] * scales - F32(1))), 0, 15)
    ls = np.where(live[:, None], ls, 0)
    return np.where(live, d * F32(mult), F32(0)).astype(np.float16), ls


def _best_neighbours(lat: Lattice, u, xval, waux, scale) -> np.ndarray:
    counts = lat.nb_count[u]
    starts = lat.nb_start[u]
    out = np.empty(u.size, np.int32)
    # groups in tiers of list length, each tier padded to its width by repeating the list's last entry (a
    # repeated candidate has the same error as its first occurrence, which argmin prefers): dense arrays
    # [width, groups] per coordinate, no per-candidate gathers of the groups' values
    tier = np.searchsorted(_WIDTHS, counts)
    for k in np.unique(tier):
        g = np.flatnonzero(tier == k)
        c = counts[g]
        width = int(_WIDTHS[k]) if k < len(_WIDTHS) else int(c.max())
        cand = lat.nb_flat[starts[g] + np.minimum(np.arange(width)[:, None], c - 1)]  # [width, n]
        s = scale[g]
        d2 = None
        for i in range(lat.dim):  # d2 = 0; d2 += weight[i]*diff*diff, coordinate after coordinate
            diff = s * lat.values_t[i][cand] - xval[i, g]
            t = waux[i, g] * diff * diff
            d2 = t if d2 is None else d2 + t
        d2 = np.where(d2 < F32_MAX, d2, F32(np.inf))  # only d2 < FLT_MAX can win (NaN never does)
        j = np.argmin(d2, axis=0)  # the first minimum: C replaces its best only when strictly smaller
        cols = np.arange(j.size)
        if (d2[j, cols] == np.inf).any():
            raise ValueError("no neighbour of finite weighted error: ggml's quantizer aborts on this input "
                             "(GGML_ASSERT(grid_index >= 0) in its find_best_neighbour); the values or their "
                             "weights overflow float32")
        out[g] = cand[j, cols]
    return out


# tier widths, finer where the 3-bit lists mostly fall; longer lists (IQ2's) take their own maximum
_WIDTHS = np.array([3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128, 192, 256, 320, 416])
