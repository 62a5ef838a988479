"""torchao safetensors checkpoints (quant_method "torchao"), made by torchao 0.18 through transformers 5.24 on the CPU
(tests/producer_fixtures/torchao, scripts/producers/torchao.py): read equal to torchao's own dequantization bit for
bit, moved exactly where the target's grid holds them (Q4_0 / Q8_0 / GPTQ / compressed-tensors), and refused in
one line where the input is bad or a tensor type is one qconvert does not read.

Oracles: oracle.json (torchao's dequantize() in the model dtype and dequantize_affine / _dequantize_affine_float8
in float32, computed by the producer script from the checkpoint transformers loads back), gguf-py's dequantization and
llama.cpp running the GGUF, compressed-tensors 0.19 through transformers loading the float-quantized output."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fixtures
from helpers import expect_user_error, gguf_tensors, llama_logits, run_cli, transformers_logits

from qconvert.converters.checker import EXACT, NEAR_EXACT, REQUANTIZE, check
from qconvert.converters.errors import BadInput
from qconvert.formats.gguf.schemes import GGUF_SCHEMES
from qconvert.formats.gptq.schemes import GPTQ_SCHEMES
from qconvert.formats.torchao.reader import TorchAoSource

gguf = pytest.importorskip("gguf")

TESTS = Path(__file__).resolve().parents[2]
AO = TESTS / "producer_fixtures" / "torchao"
CASES = ("intx4_g32_sym", "intx4_g32_asym", "int8_weight_only", "float8_weight_only")
PROMPT = fixtures.prompt_ids()


def _sha(w: torch.Tensor) -> str:
    w = w.contiguous()
    raw = w.view(torch.uint8) if w.element_size() > 1 else w
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _grids(src) -> dict:
    return {r.name: r for r in src.records() if r.is_grid}


@pytest.mark.parametrize("case", CASES)
def test_reads_equal_torchaos_own_dequantization(case):
    oracle = json.loads((AO / case / "oracle.json").read_text())
    grids = _grids(TorchAoSource(AO / case))
    assert sorted(grids) == sorted(oracle["weights"]) and len(grids) == 7
    for name, rec in grids.items():
        w = rec.load().dequantize(torch.float32)
        assert _sha(w) == oracle["weights_float32"][name]["sha256"], name  # dequantize_affine, float32
        assert _sha(w.to(torch.bfloat16)) == oracle["weights"][name]["sha256"], name  # dequantize(), bf16


def _decoded_gguf(out: Path) -> dict:
    """gguf-py's dequantization of every quantized tensor the GGUF holds, by GGUF name."""
    from gguf.quants import dequantize

    return {n: dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist() if hasattr(t.shape, "tolist")
                                                         else list(t.shape)[::-1])
            for n, t in gguf_tensors(out).items() if t.tensor_type in (gguf.GGMLQuantizationType.Q4_0,
                                                                       gguf.GGMLQuantizationType.Q8_0)}


@pytest.mark.parametrize("case, gtype", [("intx4_g32_sym", "Q4_0"), ("int8_weight_only", "Q8_0")])
def test_symmetric_grids_move_into_ggml_blocks_exactly_and_llama_cpp_runs_them(case, gtype, tmp_path):
    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    run_cli("torchao->gguf", AO / case, out, "--type", gtype.lower(), "--report", report)
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["target"] == gtype]
    assert len(rows) == 7 and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in rows), rows
    oracle = json.loads((AO / case / "oracle.json").read_text())["weights_float32"]
    decoded = _decoded_gguf(out)
    unpermuted = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
                  "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
                  "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
                  "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
                  "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight"}
    for gname, hname in unpermuted.items():  # llama.cpp's decoding of our blocks is torchao's float32, bit for bit
        assert _sha(torch.from_numpy(np.ascontiguousarray(decoded[gname], dtype=np.float32))) == \
            oracle[hname]["sha256"], gname
    ours = llama_logits(out, PROMPT)
    dense = tmp_path / "dense"
    run_cli("torchao->hf", AO / case, dense, "--type", "f32")
    ref = transformers_logits(dense, PROMPT)
    assert np.isfinite(ours).all() and float(np.abs(ours - ref).max()) < 0.05 * float(ref.max() - ref.min())


@pytest.mark.parametrize("case, scheme, verdict", [
    ("intx4_g32_sym", ("gptq", "v1"), EXACT), ("intx4_g32_sym", ("gguf", "Q8_0"), EXACT),
    ("int8_weight_only", ("gptq", "v1"), EXACT), ("intx4_g32_asym", ("gptq", "v2"), EXACT),
    ("intx4_g32_asym", ("gguf", "Q4_1"), NEAR_EXACT), ("intx4_g32_asym", ("gguf", "Q4_0"), REQUANTIZE),
])
def test_verdicts_of_the_aligned_moves(case, scheme, verdict):
    """The checker's verdicts for every quantized linear (the writers plan from these; the conversions to
    Q4_0 / Q8_0 and compressed-tensors run above and below)."""
    table = GPTQ_SCHEMES if scheme[0] == "gptq" else GGUF_SCHEMES
    grids = _grids(TorchAoSource(AO / case))
    assert len(grids) == 7
    for name, rec in grids.items():
        assert check(rec.params, rec.shape, table[scheme[1]]).verdict == verdict, name


def test_float8_moves_into_compressed_tensors_that_holds_torchaos_values(tmp_path):
    out, report = tmp_path / "m", tmp_path / "r.json"
    run_cli("torchao->compressed-tensors", AO / "float8_weight_only", out, "--report", report)
    rows = [r for r in json.loads(report.read_text())["tensors"] if r["name"].endswith("_proj.weight")]
    assert len(rows) == 7 and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in rows), rows
    from ct_runtime import _ct_model

    oracle = json.loads((AO / "float8_weight_only" / "oracle.json").read_text())["weights"]
    params = {n: t.detach() for n, t in _ct_model(out, dtype=torch.bfloat16).named_parameters()}
    for name in oracle:  # its runtime holds torchao's own dequantize() values, bit for bit
        assert _sha(params[name]) == oracle[name]["sha256"], name


# -- bad input: one line naming the file and the tensor ------------------------------------------------------
def _rewrite(src: Path, edit) -> None:
    path = src / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    edit(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def _retype(kind):
    def edit(tensors, meta):
        entry = json.loads(meta["model.layers.0.self_attn.q_proj.weight"])
        entry["_type"] = kind
        meta["model.layers.0.self_attn.q_proj.weight"] = json.dumps(entry)
    return edit


Q = "model.layers.0.self_attn.q_proj"
BAD = {
    "tile-packed-int4": (_retype("Int4TilePackedTo4dTensor"), ("Int4TilePackedTo4dTensor", f"{Q}.weight", "CUDA")),
    "entry-missing": (lambda t, m: m.pop(f"{Q}.weight"), ("metadata entry", f"{Q}.weight")),
    "scale-missing": (lambda t, m: t.pop(f"{Q}._weight_scale"), ("part 'scale' is missing", f"{Q}._weight_scale")),
    "scale-shape": (lambda t, m: t.update({f"{Q}._weight_scale": t[f"{Q}._weight_scale"][:, :2].contiguous()}),
                    ("scale shape", f"{Q}._weight_scale")),
    "code-out-of-range": (lambda t, m: t[f"{Q}._weight_qdata"].__setitem__((0, 0), 9),
                          ("outside int4's range", f"{Q}._weight_qdata")),
}


def test_bad_torchao_input_is_refused_naming_the_file_and_tensor(tmp_path):
    """Each case read by the reader (in this process: the message names the file and the tensor); the first
    through the CLI as well (one line, exit 2, nothing written)."""
    for i, case in enumerate(sorted(BAD)):
        src = tmp_path / case
        shutil.copytree(AO / "intx4_g32_sym", src)
        edit, needles = BAD[case]
        _rewrite(src, edit)
        with pytest.raises(BadInput) as err:
            for rec in TorchAoSource(src).records():
                rec.load()
        for needle in ("model.safetensors", *needles):
            assert needle in str(err.value), (case, needle, str(err.value))
        if i == 0:
            expect_user_error("torchao->gguf", src, tmp_path, "model.safetensors", *needles)
