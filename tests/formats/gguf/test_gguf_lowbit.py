"""The 1- and 2-bit GGUF types end to end: Q1_0, Q2_0, TQ1_0 and TQ2_0 read and written, IQ1_S and IQ1_M read.

- Read: every tensor of llama-quantize's files of these types (LLAMA_FTYPE_MOSTLY_Q1_0 = 40, _Q2_0 = 41, _TQ1_0 = 36,
  _TQ2_0 = 37, _IQ1_S = 24, _IQ1_M = 31, the IQ1 ones with an importance matrix as llama-quantize requires) decodes
  bit for bit as ggml's dequantize_row_* decodes it; Q2_0, which gguf 0.19 cannot open, included.
- Write: `--type q1_0 / q2_0 / tq1_0 / tq2_0` give llama-quantize's mix for the file type and every tensor's bytes;
  llama.cpp runs the file, its logits within 0.1 of transformers on the file's own weights (gguf->hf f32).
- The aligned moves, decided by the checker from the grid the reader makes (Q1_0: codes 1 / 3 around 2 under the
  block's d; Q2_0: codes 0..3 around 1): Q1_0 -> Q4_0, GPTQ 2-bit, compressed-tensors 2-bit exact, MLX 2-bit near-exact
  (MLX rounds its scale 2d and bias -d to the model dtype); Q2_0 -> GPTQ-v2 2-bit, MLX 2-bit, Q4_0 exact, GPTQ v1
  refused naming GPTQ-v2. llama.cpp runs the Q4_0 file as the Q1_0 one; compressed-tensors decompresses the
  2-bit checkpoint to the GGUF's values.
- PrismML's Q2_0 (128-value blocks under the same type id) is read by its byte size, never copied as upstream's.

Oracles, all run here: llama.cpp's libggml-base (dequantize_row_*), llama-quantize (llama_model_quantize) of our F32
GGUF, llama.cpp running the files, transformers (and compressed-tensors) on the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures
from helpers import gguf_tensors, llama_logits, run_cli, transformers_logits, write_legacy_imatrix
from qconvert.converters.checker import EXACT, NEAR_EXACT, REFUSED, check
from qconvert.formats.gguf.names import inverse_permutation, qk_row_permutation
from qconvert.formats.gguf.reader import GgufSource, _Reader, _type_name, scan_header
from qconvert.formats.gguf.schemes import GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.layouts import LOWBIT_LAYOUTS, Q2_0_PRISM
from qconvert.kernels.ggml.libggml import ggml_dequantize
from qconvert.kernels.ggml.lowbit import unpack_lowbit

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_quantize import llama_quantize  # noqa: E402  (needs llama_cpp)

FTYPE = {"Q1_0": 40, "Q2_0": 41, "TQ1_0": 36, "TQ2_0": 37, "IQ1_S": 24, "IQ1_M": 31}
WRITTEN = ("Q1_0", "Q2_0", "TQ1_0", "TQ2_0")
PROMPT = fixtures.prompt_ids()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (hidden 128, ffn 256, 2 layers), its F32 GGUF, an importance vector per decoder linear, and
    llama-quantize's file of each type, made when first asked for."""
    d = tmp_path_factory.mktemp("lowbit")
    src = fixtures.build_tiny_llama(d / "hf", seed=41)
    fixtures.build_tokenizer(src)
    f32 = d / "f32.gguf"
    run_cli("hf->gguf", src, f32, "--type", "f32", "--quiet")
    rng = np.random.default_rng(7)
    imatrix = {n: (rng.random(int(t.shape[0])) * 4).astype(np.float32) for n, t in gguf_tensors(f32).items()
               if n.startswith("blk.") and not n.endswith("norm.weight")
               # attn_v (IQ1 mixes: Q2_K, rows of 128 -> Q4_0) left out: llama-quantize weighs Q4_0 by the imatrix,
               # qconvert's legacy quantizers do not (the report says "imatrix not applied")
               and "attn_v" not in n}
    # ncall 1: the file holds the very vectors llama-quantize is given (mean * ncall / ncall may move an ulp)
    write_legacy_imatrix(d / "imatrix.dat", imatrix, ncall=1)
    made: dict[str, Path] = {}

    def llama(t: str) -> Path:
        if t not in made:
            made[t] = llama_quantize(f32, d / f"llama-{t.lower()}.gguf", FTYPE[t],
                                     imatrix=imatrix if t.startswith("IQ1") else None)
        return made[t]

    return {"src": src, "f32": f32, "dir": d, "llama": llama}


def _tensors(path: Path) -> dict:
    """Every tensor of a GGUF by name, Q2_0 ones too (our reader's view of gguf-py's, which lacks that type)."""
    return {t.name: t for t in _Reader(path, scan_header(path)).tensors}


def _report(path: Path) -> dict[str, dict]:
    return {t["name"]: t for t in json.loads(path.read_text())["tensors"]}


@pytest.mark.parametrize("t", list(FTYPE))
def test_llama_quantize_files_read_as_ggml_dequantizes(t, tiny):
    path = tiny["llama"](t)
    src = GgufSource(path)
    records = {r.source_name: r for r in src.records()}
    seen = 0
    for tensor in src.readers[0].tensors:
        if _type_name(tensor) != t:
            continue
        rec = records[tensor.name]
        cols = int(tensor.shape[0])
        data = np.asarray(tensor.data, dtype=np.uint8)
        want = ggml_dequantize(data.reshape(-1, data.size // int(np.prod(tensor.shape[1:]))), t, cols)
        perm = qk_row_permutation(rec.name, src.config, src.arch)  # llama's q/k rows, put back in HF order
        if perm is not None:
            want = want[inverse_permutation(perm).numpy()]
        got = rec.load().dequantize(torch.float32).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=tensor.name)
        assert rec.is_grid == (t in WRITTEN) and (rec.native_type == t if t in WRITTEN else True)
        seen += 1
    # rows of 128 fall back in llama-quantize: only the ffn_down (rows of 256) of the 256-block types stay
    assert seen == {"Q1_0": 15, "Q2_0": 14}.get(t, 2), seen
    assert t in src.describe()["ggml_types"]


# llama.cpp's logits against transformers on the file's own weights (gguf->hf f32), measured max 0.063, rms 0.014
# (its matmuls quantize the activations to 8 bits); these random 1-2-bit models' logits have std ~1
LOGITS_MAX = 0.1


@pytest.mark.parametrize("t", WRITTEN)
def test_write_equals_llama_quantize_and_runs_in_llama_cpp(t, tiny, tmp_path):
    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", tiny["src"], ours, "--type", t.lower(), "--allow-requant", "--report", rep, "--quiet")
    theirs = tiny["llama"](t)
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert int(a[name].tensor_type) == int(b[name].tensor_type), name
        np.testing.assert_array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8),
                                      err_msg=name)
    types = {_type_name(x) for x in a.values()}
    # an untied token_embd is Q4_K but for Q1_0, and its rows of 128 fall back to Q5_0; the output's to Q8_0
    assert t in types and ("Q5_0" in types) == (t != "Q1_0") and _type_name(a["output.weight"]) == "Q8_0"
    assert int(scan_header(ours).scalars["general.file_type"]) == FTYPE[t]
    # llama.cpp runs it as its weights say
    back = tmp_path / "back"
    run_cli("gguf->hf", ours, back, "--type", "f32", "--quiet")
    got, want = llama_logits(ours, PROMPT), transformers_logits(back, PROMPT)
    assert np.isfinite(got).all()
    assert float(np.abs(got - want).max()) < LOGITS_MAX
    # a file of the type written again as that type copies its blocks
    again = tmp_path / "again.gguf"
    run_cli("gguf->gguf", ours, again, "--type", t.lower(), "--report", rep, "--quiet")
    verdicts = {r["verdict"] for r in _report(rep).values() if r["target"] == t}
    assert verdicts == {EXACT}
    assert all(np.array_equal(np.asarray(x.data), np.asarray(_tensors(again)[n].data)) for n, x in a.items())


def test_lowbit_rows_and_fallbacks_as_llama_quantize():
    """Rows not whole blocks: Q2_0 / TQ1_0 / TQ2_0 fall back to Q4_0 (llama-quant.cpp:411-415); Q1_0 has no fallback
    (llama-quantize stops: "no tensor type fallback is defined"), and its plan is refused."""
    for t in ("Q2_0", "TQ1_0", "TQ2_0"):
        assert k_fallback(t, (8, 96), None)[0] == "Q4_0"
    assert k_fallback("Q1_0", (8, 96), None)[0] == "Q1_0"
    assert check("float32", (8, 96), GGUF_SCHEMES["Q1_0"]).verdict == REFUSED
    assert k_fallback("Q1_0", (8, 256), None) == ("Q1_0", "")


# (pair, --type or None, source type, expected verdict of every tensor of that type)
MOVES = [("gguf->gguf", "q4_0", "Q1_0", EXACT), ("gguf->gptq", None, "Q1_0", EXACT),
         ("gguf->compressed-tensors", None, "Q1_0", EXACT), ("gguf->mlx", None, "Q1_0", NEAR_EXACT),
         ("gguf->gguf", "q4_0", "Q2_0", EXACT), ("gguf->gptq-v2", None, "Q2_0", EXACT),
         ("gguf->mlx", None, "Q2_0", EXACT)]
# (TQ1_0 and TQ2_0 are Q2_0's grid, zero point 1, in 256-blocks: the same moves, left to the checker's own tests)


# llama.cpp's logits of the Q4_0 file against those of the source file, the same weights through other dot products
# (measured: Q1_0 0.0, Q2_0 0.032)
MOVE_LOGITS_MAX = 0.1


@pytest.mark.parametrize("pair,to,t,verdict", MOVES, ids=[f"{t}-{p.split('>')[1]}{'-' + o if o else ''}"
                                                          for p, o, t, _ in MOVES])
def test_aligned_moves_keep_the_codes(pair, to, t, verdict, tiny, tmp_path):
    out, rep = tmp_path / ("out.gguf" if pair.endswith("gguf") else "out"), tmp_path / "report.json"
    # Q4_0: the decoder layers' tensors retyped (--tensor-type), the embeddings and lm_head keep their blocks
    retype = ["--tensor-type", r"model\.layers\..*_proj=" + to] if to else []
    run_cli(pair, tiny["llama"](t), out, *retype, "--allow-requant", "--report", rep, "--quiet")
    src = GgufSource(tiny["llama"](t))
    lowbit = {r.name for r in src.records() if r.native_type == t and (not to or "_proj" in r.name)}
    report = _report(rep)
    assert lowbit and {report[n]["verdict"] for n in lowbit} == {verdict}, {report[n]["verdict"] for n in lowbit}
    if verdict == EXACT:
        assert max(report[n]["max_abs_err"] for n in lowbit) == 0.0
    else:  # MLX: the scale 2d and bias -d rounded once to the model dtype
        assert 0 < max(report[n]["max_abs_err"] for n in lowbit) < 2e-3
    if pair == "gguf->gguf":  # llama.cpp runs the Q4_0 file as it runs the source
        a, b = llama_logits(out, PROMPT), llama_logits(tiny["llama"](t), PROMPT)
        assert np.isfinite(a).all() and float(np.abs(a - b).max()) < MOVE_LOGITS_MAX
    if pair == "gguf->compressed-tensors":  # the runtime decompresses the GGUF's very values
        from ct_runtime import _ct_model

        state = _ct_model(out).state_dict()
        recs = {r.name: r for r in src.records()}
        for n in lowbit - {"model.embed_tokens.weight"}:
            np.testing.assert_array_equal(state[n].numpy(), recs[n].load().dequantize(torch.float32).numpy())


def test_q2_0_to_gptq_v1_is_refused_naming_gptq_v2(tiny, tmp_path):
    proc = run_cli("gguf->gptq", tiny["llama"]("Q2_0"), tmp_path / "out", "--allow-requant", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "gptq-v2" in err and "Traceback" not in proc.stderr


def _prismml_copy(src: Path, dst: Path) -> dict[str, np.ndarray]:
    """A copy of a Q2_0 GGUF whose Q2_0 tensors hold PrismML's 128-value blocks (the first 64-block's d, then both
    blocks' codes), written with gguf-py; -> the values each such tensor must decode to."""
    reader = _Reader(src, scan_header(src))
    w = gguf.GGUFWriter(str(dst), arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    datas, want = [], {}
    up = LOWBIT_LAYOUTS["Q2_0"]
    for t in reader.tensors:
        data = np.asarray(t.data)
        if _type_name(t) == "Q2_0":
            cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
            blocks = data.reshape(rows, -1, 2, up.nbytes)
            data = np.concatenate([blocks[:, :, 0, :], blocks[:, :, 1, 2:]], axis=-1).reshape(rows, -1)
            codes, scales = unpack_lowbit(up, blocks.reshape(rows, -1))
            values = (codes.astype(np.float32) - 1).reshape(rows, -1, 128) * scales[:, ::2].astype(np.float32)[..., None]
            want[t.name] = values.reshape(rows, cols)
            w.add_tensor_info(t.name, [rows, cols], np.dtype(np.int8), data.nbytes, raw_dtype=42)
        else:
            shape = list(data.shape)
            w.add_tensor_info(t.name, shape, data.dtype, data.nbytes, raw_dtype=gguf.GGMLQuantizationType(int(t.tensor_type)))
        datas.append(np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in datas:
        w.write_tensor_data(data)
    w.close()
    return want


def test_prismml_q2_0_blocks_are_told_by_size_and_never_copied_as_upstream(tiny, tmp_path):
    prism = tmp_path / "prism.gguf"
    want = _prismml_copy(tiny["llama"]("Q2_0"), prism)
    header = scan_header(prism)
    assert {t.block for t in header.tensors if t.type_id == 42} == {128}
    src = GgufSource(prism)
    records = {r.source_name: r for r in src.records()}
    for name, values in want.items():
        rec = records[name]
        perm = qk_row_permutation(rec.name, src.config, src.arch)
        if perm is not None:
            values = values[inverse_permutation(perm).numpy()]
        item = rec.load()
        assert rec.native_type is None and item.packed.layout == "ggml:Q2_0-prismml128"
        np.testing.assert_array_equal(item.dequantize(torch.float32).numpy(), values, err_msg=name)
    assert Q2_0_PRISM.block == 128
    # upstream Q2_0 asked of it: quantized again (never the 128-blocks copied under upstream's 64-block reading)
    out, rep = tmp_path / "up.gguf", tmp_path / "report.json"
    run_cli("gguf->gguf", prism, out, "--type", "q2_0", "--allow-requant", "--report", rep, "--quiet")
    report = _report(rep)
    assert {report[records[n].name]["verdict"] for n in want} == {"requantize"}
    assert {_type_name(_tensors(out)[n]) for n in want} == {"Q2_0"}
    assert {t.block for t in scan_header(out).tensors if t.type_id == 42} == {64}


def test_q2_0_of_neither_block_size_is_one_line(tiny, tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(tiny["llama"]("Q2_0").read_bytes())
    header = scan_header(tiny["llama"]("Q2_0"))
    # the first Q2_0 tensor's info given one row more than its data holds: its extent fits neither layout
    q2 = [t for t in header.tensors if t.type_id == 42]
    for t in q2[:1]:
        at = t.info_at + 8 + len(t.name.encode()) + 4 + 8  # the second dimension (rows) of its info
        rows = int.from_bytes(data[at:at + 8], "little")
        data[at:at + 8] = (rows + 1).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    proc = run_cli("gguf->hf", bad, tmp_path / "out", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in proc.stderr, err
    assert q2[0].name in err
    assert not (tmp_path / "out").exists()


# llama.cpp's logits of our IQ1 file against those of llama-quantize's, which must be the same bytes (so the same
# logits, 0.0 measured); and against transformers on the file's own weights as for the types above
@pytest.mark.parametrize("t", ("IQ1_S", "IQ1_M"))
def test_iq1_write_equals_llama_quantize_with_imatrix_and_runs(t, tiny, tmp_path):
    """`--type iq1_s / iq1_m --imatrix`: llama-quantize's mix for the file type (output Q5_K, or Q8_0 for rows of
    128; token_embd Q2_K; attn_output IQ2_XXS; the rows of 128 falling back to IQ4_NL) and every tensor's bytes,
    kernels/ggml/iq_c.c's IQ1 writers among them; llama.cpp runs the file. Without --imatrix the plan is refused in
    one line, as llama-quantize refuses it."""
    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    imatrix = tiny["dir"] / "imatrix.dat"
    run_cli("hf->gguf", tiny["src"], ours, "--type", t.lower(), "--imatrix", imatrix, "--allow-requant", "--report",
            rep, "--quiet")
    theirs = tiny["llama"](t)
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert int(a[name].tensor_type) == int(b[name].tensor_type), name
        np.testing.assert_array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8),
                                      err_msg=name)
    assert sum(_type_name(x) == t for x in a.values()) == 2  # the ffn_down of both layers (rows of 256)
    assert int(scan_header(ours).scalars["general.file_type"]) == FTYPE[t]
    back = tmp_path / "back"
    run_cli("gguf->hf", ours, back, "--type", "f32", "--quiet")
    got, want = llama_logits(ours, PROMPT), transformers_logits(back, PROMPT)
    assert np.isfinite(got).all() and float(np.abs(got - want).max()) < LOGITS_MAX
    proc = run_cli("hf->gguf", tiny["src"], tmp_path / "no.gguf", "--type", t.lower(), "--allow-requant", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "importance matrix" in err and "Traceback" not in proc.stderr
    assert not (tmp_path / "no.gguf").exists()
