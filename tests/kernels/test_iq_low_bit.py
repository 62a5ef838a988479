"""The low-bit IQ types llama-quantize wants an importance matrix for, as GGUF targets, what is theirs: IQ2_S, IQ2_XS
and IQ2_XXS (kernels/ggml/iq2.py) and IQ3_XXS (kernels/ggml/iq3_s.py), on kernels/ggml/iq_lattice.py. The lattices
against gguf-py's grids, the zero, tiny and overflowing blocks and the missing imatrix as ggml shows them,
llama-quantize's imatrix rule and 256 -> IQ4_NL fallback, and a conversion per type, with an imatrix, judged by
llama-quantize and llama.cpp. The kernels' bytes against ggml's own quantizers and the decoders against gguf-py's,
with every other IQ type: tests/kernels/test_iq_vs_ggml.py.

Oracles, all run here (none stored): ggml_quantize_chunk from llama-cpp-python's libggml-base.so
(kernels/ggml/libggml.py), with and without an importance matrix (IQ2_XS, IQ2_XXS: without one ggml aborts, shown
in a child process); llama-quantize (llama_cpp.llama_model_quantize with the file type whose default tensor type
each is: LLAMA_FTYPE_MOSTLY_IQ2_M = 29 for IQ2_S, _IQ2_XS = 20, _IQ2_XXS = 19, _IQ3_XXS = 23) of our F32 GGUF,
with an imatrix and without (refused); gguf-py's decoders and grids; llama.cpp running the files; transformers for
the dense model.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli, transformers_logits, write_legacy_imatrix
from iq_cases import _hf_to_gguf_name, _report, _uniform_grid
from qconvert.converters.checker import REFUSED, REQUANTIZE, check, decide
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, imatrix_refusal, k_fallback
from qconvert.kernels.ggml import iq2, iq3_s
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq_lattice import codes_of, decode_values, lattice

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_quantize import llama_quantize  # noqa: E402  (needs llama_cpp)

TYPES = ("IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_XXS")
# llama.cpp's file types whose default tensor type these are: LLAMA_FTYPE_MOSTLY_IQ2_M (29) for IQ2_S (ftype 28,
# "IQ2_S", makes IQ2_XS tensors), LLAMA_FTYPE_MOSTLY_IQ2_XS (20), _IQ2_XXS (19), _IQ3_XXS (23)
FTYPE = {"IQ2_S": 29, "IQ2_XS": 20, "IQ2_XXS": 19, "IQ3_XXS": 23}
# iq2xs_init_impl / iq3xs_init_impl: neighbours at the nwant smallest distances
NWANT = {"IQ2_S": 1, "IQ2_XS": 2, "IQ2_XXS": 2, "IQ3_XXS": 2}
NEEDS_WEIGHTS = ("IQ2_XS", "IQ2_XXS")  # ggml's quantizer asserts an importance matrix
BYTES = {**iq2.IQ2_BYTES, "IQ3_XXS": iq3_s.IQ3_XXS_BYTES}
PROMPT = fixtures.prompt_ids()


def _fns(t: str):
    module = iq3_s if t.startswith("IQ3") else iq2
    return getattr(module, f"quantize_{t.lower()}"), getattr(module, f"dequantize_{t.lower()}"), BYTES[t]


# ---------------------------------------------------------------------------------------------------------
# the kernels' lattices and the cases ggml shows (their bytes against ggml's: tests/kernels/test_iq_vs_ggml.py)


@pytest.mark.parametrize("t", TYPES)
def test_lattice_is_gguf_py_grid_and_neighbours_are_the_nearest_points(t):
    """The transcribed grid is the decoders' (gguf-py's, point for point: the IQ2 coordinates 8, 25, 43 are the
    codes 0, 1, 2 of the 1, 3, 5 lattice the quantizer searches, IQ3_XXS's 4, 12, .., 52, 62 the codes 0..7),
    and a sample of the codes off the grid list the points at their nwant smallest distinct distances by
    (distance, index), as iq2xs_init_impl's / iq3xs_init_impl's qsort."""
    lat = lattice(t)
    cls = getattr(gguf.quants, t)
    cls.init_grid()
    assert np.array_equal(decode_values(t), cls.grid.reshape(lat.values.shape))
    grid = lat.values.astype(np.int64)
    off = np.flatnonzero(lat.kmap < 0)
    for u in np.random.default_rng(3).choice(off, 400, replace=False):
        pos = 2 * codes_of(np.array([u]), lat.bits, lat.dim)[0] + 1
        d2 = ((grid - pos) ** 2).sum(axis=1)
        order = np.lexsort((np.arange(d2.size), d2))
        keep = np.isin(d2[order], np.unique(d2)[:NWANT[t]])
        got = lat.nb_flat[lat.nb_start[u]:lat.nb_start[u] + lat.nb_count[u]]
        assert got.tolist() == order[keep].tolist(), u


def test_iq2_s_zero_and_tiny_blocks_and_overflow():
    """From ggml's bytes: an all-zero super-block is all zero bytes (IQ2_S, IQ3_XXS); IQ2_S blocks below
    GROUP_MAX_EPS_IQ2_S (1e-8) write nothing while their neighbours do; input whose squares overflow makes ggml
    abort (here: ValueError)."""
    zeros = np.zeros((1, 256), np.float32)
    for t in ("IQ2_S", "IQ3_XXS"):
        quantize, _, sb = _fns(t)
        assert ggml_quantize(zeros, t).tobytes() == quantize(zeros).tobytes() == bytes(sb)
    quantize, _, sb = _fns("IQ2_S")
    x = np.random.default_rng(8).standard_normal((1, 256)).astype(np.float32)
    x[0, :16] *= 1e-9  # 16-block 0 dead: its two groups' qs and signs bytes stay 0
    data = ggml_quantize(x, "IQ2_S")
    assert data.tobytes() == quantize(x).tobytes()
    assert (data[0, 2:4] == 0).all() and (data[0, 34:36] == 0).all() and (data[0, 4:34] != 0).any()
    with pytest.raises(ValueError, match="aborts on this input"):
        quantize((np.random.default_rng(1).standard_normal((1, 256)) * 1e37).astype(np.float32))


_NO_WEIGHTS_CHILD = """
import numpy as np
from qconvert.kernels.ggml.libggml import _lib
x, out = np.ones(256, np.float32), np.zeros(74, np.uint8)
_lib().ggml_quantize_chunk(17, x.ctypes.data, out.ctypes.data, 0, 1, 256, None)  # GGML_TYPE_IQ2_XS, no imatrix
print("returned")
"""


def test_iq2_xs_without_weights_aborts_ggml_and_raises_here():
    """IQ2_XS without an importance matrix: ggml_quantize_chunk's GGML_ASSERT(imatrix != NULL) (for the types of
    ggml_quantize_requires_imatrix) aborts the process (a child here);
    the kernel raises ValueError, and the imatrix rule refuses even the embeddings and the output for it."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    child = subprocess.run([sys.executable, "-c", _NO_WEIGHTS_CHILD], capture_output=True, text=True, env=env,
                           timeout=120)
    assert child.returncode == -6 and "GGML_ASSERT(imatrix != NULL)" in child.stderr, (child.returncode,
                                                                                      child.stderr[-300:])
    with pytest.raises(ValueError, match="IQ2_XS needs an importance matrix"):
        iq2.quantize_iq2_xs(np.ones((1, 256), np.float32))
    assert "asserts one" in imatrix_refusal("IQ2_XS", "token_embd.weight", False)


# ---------------------------------------------------------------------------------------------------------
# the checker, the 256 fallback and llama-quantize's imatrix rule


@pytest.mark.parametrize("t", TYPES)
def test_every_source_requantizes_and_short_rows_fall_back_to_iq4_nl(t):
    s = GGUF_SCHEMES[t]
    group = 32 if t in ("IQ3_XXS", "IQ2_XXS") else 16
    assert (s.ggml_type, s.block, s.group, s.block_bytes, s.scale) == (int(gguf.GGMLQuantizationType[t]), 256, group,
                                                                       BYTES[t], "k4")
    assert check("float16", (8, 256), s).verdict == REQUANTIZE
    d = decide(_uniform_grid(cols=256), (8, 256), s, ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and not d.keeps_codes and "-point lattice of" in d.reason, d
    assert check("float16", (8, 128), s).verdict == REFUSED
    assert k_fallback(t, (8, 128), None) == ("IQ4_NL", f"{t} needs rows of 256 (these have 128), fallback IQ4_NL: ")
    assert k_fallback(t, (8, 48), None)[0] == "F16" and k_fallback(t, (8, 512), None) == (t, "")
    # llama-quant.cpp tensor_requires_imatrix: every tensor but the embeddings and the output
    assert imatrix_refusal(t, "blk.0.ffn_down.weight", False).startswith(f"{t} needs an importance matrix")
    assert imatrix_refusal(t, "blk.0.ffn_down.weight", True) is None
    if t not in NEEDS_WEIGHTS:
        assert imatrix_refusal(t, "token_embd.weight", False) is None and imatrix_refusal(t, "output.weight", False) is None
    assert imatrix_refusal("IQ3_S", "blk.0.ffn_down.weight", False) is None


# ---------------------------------------------------------------------------------------------------------
# conversions, judged by llama.cpp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (hidden 128, ffn 256, 2 layers), its F32 GGUF and an importance vector per decoder linear."""
    d = tmp_path_factory.mktemp("iq2")
    src = fixtures.build_tiny_llama(d / "hf", seed=31)
    fixtures.build_tokenizer(src)
    f32 = d / "f32.gguf"
    run_cli("hf->gguf", src, f32, "--type", "f32", "--quiet")
    rng = np.random.default_rng(7)
    values = {n: (rng.random(int(t.shape[0])) * 4).astype(np.float32) for n, t in gguf_tensors(f32).items()
              if n.startswith("blk.") and not n.endswith("norm.weight")}
    dat = d / "imatrix.dat"
    write_legacy_imatrix(dat, values)
    return {"src": src, "f32": f32, "dir": d, "imatrix": dat, "logits": transformers_logits(src, PROMPT)}


@pytest.mark.parametrize("t", TYPES)
def test_without_imatrix_is_refused_as_llama_quantize_refuses_it(t, tiny, tmp_path):
    proc = run_cli("hf->gguf", tiny["src"], tmp_path / "x.gguf", "--type", t.lower(), "--allow-requant", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and f"{t} needs an importance matrix" in err, err
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPE[t], 1
    rc = llama_cpp.llama_model_quantize(str(tiny["f32"]).encode(), str(tmp_path / "l.gguf").encode(),
                                        ctypes.byref(params))
    if t == "IQ3_XXS":  # its mix steers clear of the type without an imatrix (ffn_down Q4_K, attn_v IQ3_S)
        assert rc == 0 and t not in {x.tensor_type.name for x in gguf_tensors(tmp_path / "l.gguf").values()}
    else:
        assert rc != 0  # "this quantization requires an imatrix!"


# llama-quantize's IQ4_NL fallbacks in the tiny llama: IQ2_M's attn_v and token_embd are IQ3_S (rows of 128: IQ4_NL),
# IQ2_XS's and IQ2_XXS's are Q2_K (Q4_0), IQ3_XXS's IQ3_XXS / IQ3_S (IQ4_NL; its attn_q, attn_k IQ2_S: IQ4_NL too); ours take
# --type's IQ4_NL for every tensor of rows of 128
IQ4_NL_LAYER_TENSORS = {"IQ2_S": 12, "IQ2_XS": 10, "IQ2_XXS": 10, "IQ3_XXS": 12}
# logits against transformers, measured (max, rms, argmax agreement): the two ffn_down at 2.06-3.06 bits per weight,
# the rest IQ4_NL fallbacks, on a random model whose logits have std 1.0 (IQ3_S's: 0.733, 0.200, 0.75)
LOGITS = {"IQ2_S": (1.021, 0.250, 0.56), "IQ2_XS": (1.168, 0.264, 0.50), "IQ2_XXS": (1.239, 0.282, 0.56),
          "IQ3_XXS": (0.865, 0.217, 0.69)}


@pytest.mark.parametrize("t", TYPES)
def test_hf_to_iq2_with_imatrix_equals_llama_quantize_and_runs_in_llama_cpp(t, tiny, tmp_path):
    from qconvert.formats.gguf.imatrix import read_imatrix

    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", tiny["src"], ours, "--type", t.lower(), "--allow-requant", "--imatrix", tiny["imatrix"],
            "--report", rep, "--quiet")
    theirs = llama_quantize(tiny["f32"], tmp_path / "llama.gguf", FTYPE[t], imatrix=read_imatrix(tiny["imatrix"]))
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    names: dict[str, list[str]] = {t: [], "IQ4_NL": []}
    for name, tensor in sorted(b.items()):
        if tensor.tensor_type.name in names:
            assert a[name].tensor_type == tensor.tensor_type and bytes(a[name].data) == bytes(tensor.data), name
            names[tensor.tensor_type.name].append(name)
    assert names[t] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"], names  # ffn_down: rows of 256
    assert len([n for n in names["IQ4_NL"] if n.startswith("blk.")]) == IQ4_NL_LAYER_TENSORS[t], names
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == FTYPE[t]
    report = _report(rep)
    iq2_rows = [e for e in report.values() if e["target"] == t]
    assert len(iq2_rows) == 2 and all(e["verdict"] == REQUANTIZE and "weighted by the imatrix" in e["reason"]
                                      for e in iq2_rows), iq2_rows
    f32 = gguf_tensors(tiny["f32"])
    for e in iq2_rows:  # the report's error is gguf-py's decode against the source
        name = _hf_to_gguf_name(e["name"])
        err = float(np.abs(gguf_dequant(a[name]).reshape(-1) - np.asarray(f32[name].data).reshape(-1)).max())
        assert err == e["max_abs_err"], (name, err, e)
    got = llama_logits(ours, PROMPT)
    want = tiny["logits"]
    diff = got - want
    rms = float(np.sqrt(np.mean(diff ** 2)))
    top, typical, agree = LOGITS[t]  # a smoke bound around the measured values (the bytes are llama-quantize's)
    assert float(np.abs(diff).max()) < top + 0.25 and rms < typical + 0.05, (float(np.abs(diff).max()), rms)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= agree - 0.15
    if t != "IQ2_XS":
        return
    # llama.cpp's own quantizer behind --quantizer llama.cpp writes the same file (IQ2_XS: with the weights it asserts)
    other = tmp_path / "llama-backend.gguf"
    run_cli("hf->gguf", tiny["src"], other, "--type", t.lower(), "--allow-requant", "--imatrix", tiny["imatrix"],
            "--quantizer", "llama.cpp", "--quiet")
    assert other.read_bytes() == ours.read_bytes()
