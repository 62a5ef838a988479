"""The online Hadamard transform of rotated GPTQ checkpoints, as a fold into a weight matrix.

gptqmodel's `rotation: "hadamard" | "random"` folds an exact Hadamard H over the intermediate dimension
into every `mlp.down_proj` weight and re-applies it to the activation at run time: y = W_q (x M) with
M = H_n / sqrt(n) for power-of-two n (the symmetric Sylvester matrix, which the fast Walsh-Hadamard
butterfly computes). A plain checkpoint that computes the same function has W_plain = W_q M^T.

gptqmodel re-creates the transform from the size alone (`get_hadK`): n = K * 2^m with a tabulated
K x K Hadamard matrix for K in {172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12}, or K = 1 when n is a
power of two. Power-of-two sizes are folded here with the Sylvester butterfly alone. The K tables are
specific matrices from N. J. A. Sloane's library (particular sign and row orders) that this module does
not carry: for those sizes (llama-2's 11008 = 172 * 64, llama-3's 14336 = 28 * 512) the transform is
taken, at run time, from an installed gptqmodel (the runtime that applies it: the `gptq` extra), by
applying gptqmodel's own online transform to the identity; without gptqmodel they are refused with
`UnsupportedHadamard` (a ValueError) naming the size and the install that would fold it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["UnsupportedHadamard", "hadamard_factor", "require_foldable", "walsh_hadamard_rows", "fold_online_hadamard",
           "sylvester_matrix", "runtime_transform_matrix"]

# the non-power-of-two factors gptqmodel knows, in the order it tries them
GPTQMODEL_K_FACTORS = (172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12)


class UnsupportedHadamard(ValueError):
    pass


def hadamard_factor(n: int) -> int:
    """K of gptqmodel's decomposition n = K * 2^m (1 for a power of two); raises for sizes it cannot do."""
    for k in GPTQMODEL_K_FACTORS:  # the first factor that divides n decides, as in gptqmodel
        if n % k == 0:
            if not _is_pow2(n // k):
                break
            return k
    if _is_pow2(n):
        return 1
    raise UnsupportedHadamard(f"size {n} is neither a power of two nor K*2^m for K in {GPTQMODEL_K_FACTORS}; "
                              "gptqmodel itself cannot build its Hadamard transform")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def walsh_hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform (Sylvester order) of every row: x @ H_n, H_n symmetric."""
    n = x.shape[-1]
    if not _is_pow2(n):
        raise UnsupportedHadamard(f"Walsh-Hadamard transform needs a power-of-two width, got {n}")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(y.shape[0], n // (2 * h), 2, h)
        y = torch.cat((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=-1).reshape(-1, n)
        h *= 2
    return y.reshape(shape)


def sylvester_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """H_n (entries +-1), Sylvester construction: H_2n = [[H, H], [H, -H]]."""
    return walsh_hadamard_rows(torch.eye(n, dtype=dtype))


def _gptqmodel_transform():
    try:
        from gptqmodel.quantization.rotation.hadamard_utils import apply_online_hadamard, get_hadK
    except Exception:
        return None
    return apply_online_hadamard, get_hadK


def require_foldable(n: int) -> None:
    """Raise `UnsupportedHadamard` unless the transform of size n can be folded here: powers of two
    always, K * 2^m when gptqmodel (which holds the K tables) is installed."""
    k = hadamard_factor(n)
    if k != 1 and _gptqmodel_transform() is None:
        raise UnsupportedHadamard(f"size {n} = {k} * {n // k} needs gptqmodel's tabulated {k}x{k} Hadamard "
                                  "matrix, which qconvert does not carry: install gptqmodel (pip install "
                                  "'qconvert[gptq]') to fold it; without it only power-of-two sizes are supported")


def runtime_transform_matrix(n: int) -> torch.Tensor:
    """M (float64, [n, n]) with online(x) = x @ M for gptqmodel's transform of size n = K * 2^m, K > 1:
    gptqmodel's own online transform applied to the rows of the identity."""
    require_foldable(n)
    apply_online_hadamard, get_hadK = _gptqmodel_transform()
    had_k, k = get_hadK(n)
    eye = torch.eye(n, dtype=torch.float64)
    return apply_online_hadamard(eye, True, False, had_k.to(torch.float64), k)


def fold_online_hadamard(weight: torch.Tensor) -> torch.Tensor:
    """W_plain = W_q M^T for a down_proj weight `[out, in]` whose input gets the online transform M.

    Computed in float64 and rounded once to float32, so the result does not depend on the order of
    the butterfly's additions in lower precision.
    """
    n = weight.shape[-1]
    require_foldable(n)
    if hadamard_factor(n) != 1:
        return (weight.to(torch.float64) @ runtime_transform_matrix(n).T).to(torch.float32)
    # M = H_n / sqrt(n) is symmetric, so W M^T = W H_n / sqrt(n): the row-wise transform
    folded = walsh_hadamard_rows(weight.to(torch.float64)) / math.sqrt(n)
    return folded.to(torch.float32)
