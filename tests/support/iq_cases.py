"""The cases the IQ kernels are compared with ggml on (tests/kernels/test_iq_vs_ggml.py and the type-specific
tests/kernels/test_iq*.py): the data kinds (IQ4_NL's; IQ4_XS's, rows made whole super-blocks, and its super-block
cases; IQ3_S's, less the overflowing one, and its own), the importance vectors, a uniform 4-bit grid for the
checker, and the report and tensor-name helpers of the conversions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import fixtures
from helpers import run_cli
from qconvert.converters.records import GridParams
from qconvert.kernels.ggml.iq4_nl import KVALUES

# ---------------------------------------------------------------------------------------------------------
# the data kinds and importance vectors


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal((64, 256)).astype(np.float32)
    if kind == "weights":
        return (rng.standard_normal((96, 512)) * 0.02).astype(np.float32)
    if kind == "zeros":
        return np.zeros((4, 128), np.float32)
    if kind == "tiny":  # around ggml's GROUP_MAX_EPS (1e-15): some blocks quantize, some are zeroed
        return (rng.standard_normal((16, 128)) * 1e-15).astype(np.float32)
    if kind == "subnormal":
        return (rng.standard_normal((8, 128)) * 1e-40).astype(np.float32)
    if kind == "huge":  # x*x overflows to inf in the weights
        return (rng.standard_normal((8, 256)) * 1e37).astype(np.float32)
    if kind == "ties":  # small integers: many x/d land exactly between two table entries or on equal |max|
        return rng.integers(-4, 5, (64, 256)).astype(np.float32)
    if kind == "table":  # exact multiples of the table itself, and its midpoints
        mids = (KVALUES[1:].astype(np.float32) + KVALUES[:-1]) / 2
        vals = np.concatenate([KVALUES.astype(np.float32), mids])
        return (rng.choice(vals, (32, 256)) * np.float32(0.01)).astype(np.float32)
    if kind == "mixed":  # zero blocks, sparse blocks and magnitudes from 1e-20 to 1e5 side by side
        mag = rng.choice(np.array([1e-20, 1e-3, 1.0, 1e5]), (32, 256))
        return np.where(rng.random((32, 256)) < 0.3, 0, rng.standard_normal((32, 256)) * mag).astype(np.float32)
    raise ValueError(kind)


KINDS = ("normal", "weights", "zeros", "tiny", "subnormal", "huge", "ties", "table", "mixed")


WEIGHTINGS = ("none", "random", "ones", "sparse")  # no imatrix, and three kinds of importance vector


def _imatrix(weighting: str, rng: np.random.Generator, n: int) -> np.ndarray | None:
    """An importance vector of n columns (or None) for one of WEIGHTINGS (every IQ type's cases share it)."""
    return {"none": None, "random": rng.random(n).astype(np.float32) * 10, "ones": np.ones(n, np.float32),
            "sparse": np.where(rng.random(n) < 0.5, 0, rng.random(n)).astype(np.float32)}[weighting]


def _xs_data(kind: str, rng: np.random.Generator) -> np.ndarray:
    """IQ4_NL's data kinds with rows made whole super-blocks, and three that aim at the super-block step."""
    if kind in KINDS:
        x = _data(kind, rng)
        return x if x.shape[1] % 256 == 0 else x.reshape(-1, 256)  # zeros, tiny, subnormal: rows of 128
    if kind == "subscales":  # each 32-block its own magnitude: dead blocks, scales that round to l = 0,
        # and a fifth of the super-blocks below GROUP_MAX_EPS throughout (all scales 0: d = -0.0)
        mag = rng.choice(np.array([0, 1e-16, 1e-8, 1e-3, 1.0, 1e3, 1e6]), (24, 3, 8, 1))
        dead = rng.random((24, 3, 1, 1)) < 0.2
        mag = np.where(dead, rng.choice(np.array([0, 1e-16]), (24, 3, 8, 1)), mag)
        return (rng.standard_normal((24, 3, 8, 32)) * mag).astype(np.float32).reshape(24, 768)
    if kind == "mirror":  # 32-blocks v, -v, ...: scales of both signs near max, l = +32 clamps to 31
        v = rng.standard_normal((16, 1, 32)) * rng.uniform(0.9, 1.1, (16, 8, 1))
        return (v * np.tile([1.0, -1.0], 4).reshape(1, 8, 1)).astype(np.float32).reshape(16, 256)
    if kind == "odd":  # an odd number of rows of 5 super-blocks
        return (rng.standard_normal((7, 1280)) * 0.02).astype(np.float32)
    raise ValueError(kind)


XS_KINDS = (*KINDS, "subscales", "mirror", "odd")


def _iq3_data(kind: str, rng: np.random.Generator) -> np.ndarray:
    """IQ4_XS's data kinds (IQ4_NL's, rows made whole super-blocks, and its super-block cases) except "huge",
    where ggml's IQ3_S aborts (test_overflowing_input_aborts_ggml_and_raises_here), and three more."""
    if kind == "large":  # as large as IQ3_S's float32 sums allow: w*x*q ~ 1e33
        return (rng.standard_normal((8, 256)) * 1e11).astype(np.float32)
    if kind == "dead":  # dead 32-blocks (zeros, some -0.0) inside live super-blocks: C's qs/signs pointer quirk
        x = rng.standard_normal((16, 8, 32)).astype(np.float32)
        x[rng.random((16, 8)) < 0.3] = 0
        x[3, 2] = -0.0
        x[5, :7] = 0  # only the last block alive
        return x.reshape(16, 256)
    if kind == "lattice":  # values on the lattice itself (odd multiples, signs), some groups off it
        return (rng.choice(np.arange(1, 16, 2), (32, 256)) * rng.choice([-1, 1], (32, 256)) * 0.01).astype(np.float32)
    return _xs_data(kind, rng)


IQ3_KINDS = (*(k for k in XS_KINDS if k != "huge"), "large", "dead", "lattice")


# ---------------------------------------------------------------------------------------------------------
# reading ggml's bytes

IQ4_XS_SB = 136  # bytes per IQ4_XS 256-element super-block (gguf-py GGML_QUANT_SIZES)


def _sub_scales(data: np.ndarray) -> np.ndarray:
    """The 6-bit scales ls (0..63) of every 32-block, read from block_iq4_xs bytes: [super-blocks, 8]."""
    b = data.reshape(-1, IQ4_XS_SB)
    high = b[:, 2:4].copy().view("<u2").astype(np.int32)
    ib = np.arange(8)
    return ((b[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4)


# ---------------------------------------------------------------------------------------------------------
# the checker's grid, the conversions' report and names


def _uniform_grid(rows: int = 8, cols: int = 128, group: int = 32) -> GridParams:
    """A 4-bit symmetric grid that Q4_0 holds exactly (zero point 8, fp16 scales)."""
    gen = torch.Generator().manual_seed(3)
    scales = (torch.rand(rows, cols // group, generator=gen) * 0.01 + 1e-3).to(torch.float16).float()
    return GridParams(bits=4, group_size=group, scales=scales,
                      zeros=torch.full((rows, cols // group), 8, dtype=torch.int16))


def _report(path: Path) -> dict[str, dict]:
    return {t["name"]: t for t in json.loads(path.read_text())["tensors"]}


def _hf_to_gguf_name(name: str) -> str:
    from qconvert.formats.gguf.names import gguf_tensor_name

    return gguf_tensor_name(name, "llama", 2) or "?"


# ---------------------------------------------------------------------------------------------------------
# the tiny llama converted to IQ4_NL, IQ4_XS and IQ3_S (tests/kernels/conftest.py builds each once a session)

CONVERTED = ("IQ4_NL", "IQ4_XS", "IQ3_S")
FTYPE = {"IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26}  # llama.cpp LLAMA_FTYPE_MOSTLY_IQ4_NL, _IQ4_XS, _IQ3_S
TINY_SEED = {"IQ4_NL": 21, "IQ4_XS": 23, "IQ3_S": 29}


def build_tiny(tmp_path_factory, t: str) -> dict:
    """A tiny llama (hidden 128, ffn 256, 2 layers), its GGUF of type t and its F32 GGUF. For IQ4_XS and IQ3_S only
    ffn_down has rows of 256: the other linears and the embedding fall back to IQ4_NL, in llama-quantize as in
    ours."""
    d = tmp_path_factory.mktemp(t.lower())
    src = fixtures.build_tiny_llama(d / "hf", seed=TINY_SEED[t])
    fixtures.build_tokenizer(src)
    ours, f32, rep = d / f"{t.lower()}.gguf", d / "f32.gguf", d / "report.json"
    run_cli("hf->gguf", src, ours, "--type", t.lower(), "--allow-requant", "--report", rep, "--quiet")
    run_cli("hf->gguf", src, f32, "--type", "f32", "--quiet")
    return {"src": src, "ours": ours, "f32": f32, "report": _report(rep), "dir": d}
