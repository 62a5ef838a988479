"""IQ3_S as a GGUF target: the kernel (kernels/iq3_s.py, kernels/iq_lattice.py) against ggml's own
quantize_iq3_s, the checker's verdicts and llama-quantize's 256 -> IQ4_NL fallback (formats/gguf/schemes.py),
and a conversion judged by llama.cpp.

Oracles, all run here (none stored): ggml_quantize_chunk(GGML_TYPE_IQ3_S) from llama-cpp-python's
libggml-base.so (kernels/ggml_ctypes.py), with and without an importance matrix, and in a child process where
ggml aborts; llama-quantize (llama_cpp.llama_model_quantize, LLAMA_FTYPE_MOSTLY_IQ3_S = 26) of our F32 GGUF;
gguf-py's IQ3_S decoder and grid; llama.cpp running the file; transformers for the dense model. The data
generators and importance vectors are tests/kernels/test_iq4_nl.py's and tests/kernels/test_iq4_xs.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli, transformers_logits, write_legacy_imatrix
from iq_cases import IQ3_KINDS, WEIGHTINGS, _hf_to_gguf_name, _imatrix, _iq3_data, _report, _uniform_grid
from qconvert.converters.checker import EXACT, REFUSED, REQUANTIZE, check, decide
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq3_s import dequantize_iq3_s, quantize_iq3_s
from qconvert.kernels.ggml.iq_lattice import codes_of, lattice

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_quantize import llama_quantize  # noqa: E402  (needs llama_cpp)

FTYPE_IQ3_S = 26  # llama.cpp LLAMA_FTYPE_MOSTLY_IQ3_S
SB = 110  # bytes per 256-element super-block (gguf-py GGML_QUANT_SIZES)
PROMPT = fixtures.prompt_ids()


# ---------------------------------------------------------------------------------------------------------
# the kernel, byte for byte with ggml


def _differing_blocks(ours: np.ndarray, theirs: np.ndarray) -> int:
    return int((ours.reshape(-1, SB) != theirs.reshape(-1, SB)).any(axis=1).sum())


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("kind", IQ3_KINDS)
def test_kernel_bytes_equal_ggml_quantize_chunk(kind, weighting):
    rng = np.random.default_rng([300 + IQ3_KINDS.index(kind), WEIGHTINGS.index(weighting)])  # fixed per case
    x = _iq3_data(kind, rng)
    rows, n = x.shape
    imatrix = _imatrix(weighting, rng, n)
    ours = quantize_iq3_s(x, imatrix, threads=1)
    theirs = ggml_quantize(x, "IQ3_S", imatrix)
    assert ours.shape == theirs.shape == (rows, n // 256 * SB)
    differ = _differing_blocks(ours, theirs)
    assert differ == 0, f"{differ} of {ours.size // SB} super-blocks differ"
    # the decode is gguf-py's, bit for bit
    got = dequantize_iq3_s(theirs, n)
    want = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.IQ3_S)
    assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


def test_lattice_is_gguf_py_grid_and_neighbours_are_the_nearest_points():
    """The transcribed grid is the one the decoders use (gguf-py's IQ3_S grid, point for point), and each code
    off the grid lists the points at its 3 smallest distinct distances, by (distance, index): C's qsort order
    in iq3xs_init_impl, written here literally one code at a time."""
    lat = lattice("IQ3_S")
    gguf.quants.IQ3_S.init_grid()
    assert np.array_equal(lat.values, gguf.quants.IQ3_S.grid.reshape(512, 4))
    grid = lat.values.astype(np.int64)
    on = lat.kmap >= 0
    assert on.sum() == 512
    for u in np.flatnonzero(~on):
        pos = 2 * codes_of(np.array([u]), 3, 4)[0] + 1
        d2 = ((grid - pos) ** 2).sum(axis=1)
        order = sorted(range(512), key=lambda j: (d2[j], j))
        want, distinct = [], []
        for j in order:
            if d2[j] not in distinct:
                if len(distinct) == 3:
                    break
                distinct.append(d2[j])
            want.append(j)
        got = lat.nb_flat[lat.nb_start[u]:lat.nb_start[u] + lat.nb_count[u]]
        assert got.tolist() == want, u
    # and the map: every grid point's code maps to its index
    codes = (((grid - 1) // 2) << np.array([0, 3, 6, 9])).sum(axis=1)
    assert np.array_equal(lat.kmap[codes], np.arange(512))


def test_dead_block_quirk_and_scale_range_come_from_ggml():
    """ggml's own bytes show what the kernel reproduces: after a dead 32-block (all zeros) the next blocks'
    grid bytes and signs sit one slot early and the last slot stays 0 (C's `continue` skips the pointer
    increments), while qh keeps each block's place; the largest block scale is always 15; an all-zero
    super-block is 110 zero bytes."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, :32] = 0  # block 0 dead
    data = ggml_quantize(x, "IQ3_S").reshape(-1, SB)
    assert data.tobytes() == quantize_iq3_s(x).tobytes()
    qs, qh, signs = data[0, 2:66], data[0, 66:74], data[0, 74:106]
    assert (qs[56:] == 0).all() and (signs[28:] == 0).all() and qh[0] == 0
    # the shifted signs are block 1's: bit i of byte k is the sign of its value 8k + i
    want = np.packbits(x[0, 32:64] < 0, bitorder="little")
    assert np.array_equal(signs[:4], want)
    s = np.stack([data[:, 106:110] & 0xF, data[:, 106:110] >> 4], axis=2).reshape(2, 8)
    assert (s.max(axis=1) == 15).all()
    zeros = np.zeros((1, 256), np.float32)
    assert ggml_quantize(zeros, "IQ3_S").tobytes() == quantize_iq3_s(zeros).tobytes() == bytes(SB)
    with pytest.raises(ValueError, match="multiple of IQ3_S's block of 256"):
        quantize_iq3_s(np.zeros((1, 128), np.float32))


_ABORT_CHILD = """
import sys, numpy as np
from qconvert.kernels.ggml.libggml import ggml_quantize
x = (np.random.default_rng(1).standard_normal((2, 256)) * 1e37).astype(np.float32)
ggml_quantize(x, "IQ3_S")
print("returned")
"""


def test_overflowing_input_aborts_ggml_and_raises_here():
    """Values whose squares overflow float32 (x ~ 1e37) leave no neighbour of finite error: ggml's
    GGML_ASSERT(grid_index >= 0) aborts the process (run in a child), the kernel raises ValueError."""
    x = (np.random.default_rng(1).standard_normal((2, 256)) * 1e37).astype(np.float32)
    with pytest.raises(ValueError, match="aborts on this input"):
        quantize_iq3_s(x)
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    child = subprocess.run([sys.executable, "-c", _ABORT_CHILD], capture_output=True, text=True, env=env,
                           timeout=120)
    assert child.returncode == -6 and "returned" not in child.stdout, (child.returncode, child.stderr[-500:])
    assert "GGML_ASSERT(grid_index >= 0)" in child.stderr, child.stderr[-500:]


def test_kernel_bands_and_threads_do_not_change_the_bytes():
    x = (np.random.default_rng(4).standard_normal((1100, 512)) * 0.05).astype(np.float32)  # 3 bands of rows
    imatrix = np.random.default_rng(5).random(512).astype(np.float32)
    want = ggml_quantize(x, "IQ3_S", imatrix, threads=2)
    assert _differing_blocks(quantize_iq3_s(x, imatrix, threads=1), want) == 0
    assert _differing_blocks(quantize_iq3_s(x, imatrix, threads=3), want) == 0


def test_decoder_equals_gguf_py_on_arbitrary_blocks():
    """Every bit pattern decodes as gguf-py decodes it: random bytes (any d, sign, inf or NaN included; all 512
    grid indices; all 16 block scales)."""
    data = np.random.default_rng(6).integers(0, 256, (64, 16 * SB), dtype=np.uint8)
    with np.errstate(all="ignore"):
        got = dequantize_iq3_s(data, 16 * 256)
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.IQ3_S).reshape(got.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    b = data.reshape(-1, SB)
    index = b[:, 2:66].astype(np.int32) | (np.unpackbits(b[:, 66:74], axis=1, bitorder="little").astype(np.int32) << 8)
    assert np.unique(index).size == 512


# ---------------------------------------------------------------------------------------------------------
# the checker and the 256 fallback


def test_every_source_requantizes_into_iq3_s_and_short_rows_fall_back_to_iq4_nl():
    s = GGUF_SCHEMES["IQ3_S"]
    assert (s.ggml_type, s.block, s.group, s.block_bytes, s.scale) == (21, 256, 32, SB, "k4")
    dense = check("float16", (8, 256), s)
    assert dense.verdict == REQUANTIZE and "IQ3_S quantizer" in dense.reason, dense
    g = _uniform_grid(cols=256)
    d = decide(g, (8, 256), s, ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and not d.keeps_codes and "512-point lattice" in d.reason, d
    assert "IQ3_S quantizer" in d.reason and d.alternative == ("Q4_0", EXACT), d
    refused = check("float16", (8, 128), s)
    assert refused.verdict == REFUSED and "falls back to IQ4_NL" in refused.reason, refused
    # llama-quant.cpp tensor_type_fallback: IQ3_S -> IQ4_NL, and F16 where 32 does not divide the row either
    assert k_fallback("IQ3_S", (8, 128), None) == ("IQ4_NL", "IQ3_S needs rows of 256 (these have 128), "
                                                             "fallback IQ4_NL: ")
    assert k_fallback("IQ3_S", (4, 8, 128), _uniform_grid(cols=128))[0] == "IQ4_NL"
    assert k_fallback("IQ3_S", (8, 48), None)[0] == "F16"
    assert k_fallback("IQ3_S", (8, 512), None) == ("IQ3_S", "")


# ---------------------------------------------------------------------------------------------------------
# conversions, judged by llama.cpp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (hidden 128, ffn 256, 2 layers), its IQ3_S GGUF and its F32 GGUF. Only ffn_down has rows
    of 256: the other linears and the embedding fall back to IQ4_NL, in llama-quantize as in ours."""
    d = tmp_path_factory.mktemp("iq3_s")
    src = fixtures.build_tiny_llama(d / "hf", seed=29)
    fixtures.build_tokenizer(src)
    ours, f32, rep = d / "iq3_s.gguf", d / "f32.gguf", d / "report.json"
    run_cli("hf->gguf", src, ours, "--type", "iq3_s", "--allow-requant", "--report", rep, "--quiet")
    run_cli("hf->gguf", src, f32, "--type", "f32", "--quiet")
    return {"src": src, "ours": ours, "f32": f32, "report": _report(rep), "dir": d}


@pytest.fixture(scope="module")
def llama_iq3(tiny) -> Path:
    """llama-quantize's IQ3_S of our F32 GGUF."""
    return llama_quantize(tiny["f32"], tiny["dir"] / "llama-iq3_s.gguf", FTYPE_IQ3_S)


def _same_tensors(ours: Path, theirs: Path) -> dict[str, list[str]]:
    """Every tensor llama-quantize made IQ3_S or IQ4_NL has that type in ours too, with the same bytes; -> their
    names by type."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    names: dict[str, list[str]] = {"IQ3_S": [], "IQ4_NL": []}
    for name, t in sorted(b.items()):
        kind = t.tensor_type.name
        if kind in names:
            assert a[name].tensor_type.name == kind, (name, a[name].tensor_type.name, kind)
            assert bytes(a[name].data) == bytes(t.data), name
            names[kind].append(name)
    return names


def _expect_llama_quantize_types(names: dict[str, list[str]]) -> None:
    assert names["IQ3_S"] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"], names
    # the other 12 decoder linears and the embedding: rows of 128, IQ4_NL in both (llama-quantize makes
    # output.weight Q8_0: its Q6_K wants rows of 256; ours is IQ4_NL, --type's fallback)
    assert len([n for n in names["IQ4_NL"] if n.startswith("blk.")]) == 12 and "token_embd.weight" in names["IQ4_NL"]


def test_hf_to_iq3_s_equals_llama_quantize_and_runs_in_llama_cpp(tiny, llama_iq3):
    _expect_llama_quantize_types(_same_tensors(tiny["ours"], llama_iq3))
    for e in tiny["report"].values():
        if e["target"] == "IQ3_S":
            assert e["verdict"] == REQUANTIZE and e["reason"] == "dense float16 weights quantized with ggml's " \
                                                                 "IQ3_S quantizer", e
        elif e["target"] == "IQ4_NL":
            assert e["reason"].startswith("IQ3_S needs rows of 256 (these have 128), fallback IQ4_NL: "), e
    assert sum(e["target"] == "IQ3_S" for e in tiny["report"].values()) == 2
    assert gguf.GGUFReader(str(tiny["ours"])).fields["general.file_type"].contents() == FTYPE_IQ3_S
    tensors, f32 = gguf_tensors(tiny["ours"]), gguf_tensors(tiny["f32"])
    for e in tiny["report"].values():  # the report's error is gguf-py's decode against the source
        if e["target"] in ("IQ3_S", "IQ4_NL"):
            name = _hf_to_gguf_name(e["name"])
            err = float(np.abs(gguf_dequant(tensors[name]).reshape(-1) - np.asarray(f32[name].data).reshape(-1)).max())
            assert err == e["max_abs_err"], (name, err, e)
    got = llama_logits(tiny["ours"], PROMPT)
    want = transformers_logits(tiny["src"], PROMPT)
    # the two ffn_down at 3.44 bits per weight, the rest IQ4_NL fallbacks, on a random model whose logits have
    # std 1.0, range +-3.6: measured max 0.733, rms 0.200, argmax agreement 0.75
    diff = got - want
    rms = float(np.sqrt(np.mean(diff ** 2)))
    assert float(np.abs(diff).max()) < 1.0 and rms < 0.25, (float(np.abs(diff).max()), rms)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.6


def test_iq3_s_with_imatrix_equals_llama_quantize_with_it(tiny, tmp_path):
    rng = np.random.default_rng(7)
    f32 = gguf_tensors(tiny["f32"])
    values = {n: (rng.random(int(t.shape[0])) * 4).astype(np.float32) for n, t in f32.items()
              if n.startswith("blk.") and not n.endswith("norm.weight")}
    dat = tmp_path / "imatrix.dat"
    write_legacy_imatrix(dat, values)
    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", tiny["src"], ours, "--type", "iq3_s", "--allow-requant", "--imatrix", dat,
            "--report", rep, "--quiet")
    weighted = [e for e in _report(rep).values() if "weighted by the imatrix" in e["reason"]]
    assert len(weighted) == 14 and sum(e["target"] == "IQ3_S" for e in weighted) == 2, weighted
    from qconvert.formats.gguf.imatrix import read_imatrix

    theirs = llama_quantize(tiny["f32"], tmp_path / "llama.gguf", FTYPE_IQ3_S, imatrix=read_imatrix(dat))
    _expect_llama_quantize_types(_same_tensors(ours, theirs))
    plain = gguf_tensors(tiny["ours"])  # and the weights did change the bytes
    assert bytes(plain["blk.0.ffn_down.weight"].data) != bytes(gguf_tensors(ours)["blk.0.ffn_down.weight"].data)
    # llama.cpp's own quantizer behind --quantizer llama.cpp writes the same file
    other = tmp_path / "llama-backend.gguf"
    run_cli("hf->gguf", tiny["src"], other, "--type", "iq3_s", "--allow-requant", "--imatrix", dat,
            "--quantizer", "llama.cpp", "--quiet")
    assert other.read_bytes() == ours.read_bytes()


def test_gguf_to_gguf_copies_iq3_s_blocks(llama_iq3, tmp_path):
    """llama-quantize's IQ3_S file as the source: its IQ3_S tensors are read with their blocks (gguf-py's decode
    for the values) and copied byte for byte into IQ3_S, the file running as before."""
    out, rep = tmp_path / "same.gguf", tmp_path / "same.json"
    run_cli("gguf->gguf", llama_iq3, out, "--report", rep, "--quiet")
    report = _report(rep)
    copied = [e for e in report.values() if e["target"] == "IQ3_S"]
    assert len(copied) == 2 and all(e["verdict"] == EXACT and e["reason"] == "IQ3_S blocks copied byte for byte"
                                    for e in copied), copied
    a, b = gguf_tensors(llama_iq3), gguf_tensors(out)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(b[name].data), name
    assert np.array_equal(llama_logits(llama_iq3, PROMPT), llama_logits(out, PROMPT))
