"""Float-quantized checkpoints (FP8, MXFP4, NVFP4): read as float grids equal to their producers' own
dequantization, moved byte for byte where the target's blocks match (GGUF MXFP4 / NVFP4, UQFF MXFP4 / FP8),
requantized with the target's quantizer otherwise, and judged by the runtimes that own the outputs.

Producers and oracles (all offline on CPU):
- llm-compressor 0.14 (tests/producer_fixtures/compressed_tensors: fp8_block, mxfp4a16, nvfp4a16, fp8_dynamic;
  their oracles are compressed-tensors' decompression, checked in test_compressed_tensors.py for every case);
- NVIDIA ModelOpt 0.47 (tests/producer_fixtures/modelopt: fp8, nvfp4, mxfp4, made by scripts/producers/modelopt.py;
  oracle.json is ModelOpt's own qtensor dequantization), and gptqmodel 7.6's dequantize_model, live;
- transformers 5.24's FineGrainedFP8 quantizer (Fp8Quantize) for HF "fp8" checkpoints, its Fp8Dequantize as the
  oracle; DeepSeek-V3's partial 128x128 edge blocks (tests/support/fixtures_float.py), gptqmodel's dequantize_model;
- ggml's reference quantizers (ggml_quantize_chunk from llama-cpp-python) for our MXFP4 / NVFP4 kernels;
- llama.cpp's own converter (convert_hf_to_gguf.py) for the NVFP4 files, llama.cpp and mistral.rs running ours.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
from helpers import edit_safetensors, expect_user_error, gguf_tensors, llama_logits, run_cli

from qconvert.converters.checker import EXACT, NEAR_EXACT, REQUANTIZE, check
from qconvert.converters.records import GridParams
from qconvert.formats.compressed_tensors.reader import CtSource
from qconvert.formats.fp8.reader import Fp8Source
from qconvert.formats.gguf.reader import GgufSource
from qconvert.formats.gguf.schemes import GGUF_SCHEMES
from qconvert.formats.modelopt.reader import ModelOptSource
from qconvert.formats.uqff.schemes import UQFF_SCHEMES
from qconvert.kernels import floatq

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from qconvert.kernels.ggml.libggml import ggml_quantize  # noqa: E402  (needs llama-cpp-python's C library)

TESTS = Path(__file__).resolve().parents[2]
CT = TESTS / "producer_fixtures" / "compressed_tensors"
MO = TESTS / "producer_fixtures" / "modelopt"
CACHE = TESTS / "_fixtures" / "float"
PROMPT = fixtures.prompt_ids()
LOGIT_TOLERANCE = 0.05  # of the reference's logit range: llama.cpp quantizes activations for its FP4 matmuls


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TESTS / "support" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FF = _load("fixtures_float")


def _sha(w: torch.Tensor) -> str:
    w = w.contiguous()
    raw = w.view(torch.uint8) if w.element_size() > 1 else w
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _grids(src) -> dict:
    return {r.name: r for r in src.records() if r.is_grid}


# -- the kernels, byte for byte with ggml ----------------------------------------------------------------
def _data(kind: str, rng: np.random.Generator, cols: int) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal((48, cols)).astype(np.float32)
    if kind == "weights":
        return (rng.standard_normal((64, cols)) * 0.02).astype(np.float32)
    if kind == "zeros":
        return np.zeros((4, cols), np.float32)
    if kind == "tiny":
        return (rng.standard_normal((8, cols)) * 1e-15).astype(np.float32)
    if kind == "subnormal":
        return (rng.standard_normal((8, cols)) * 1e-40).astype(np.float32)
    if kind == "huge":
        return (rng.standard_normal((8, cols)) * 1e37).astype(np.float32)
    if kind == "ties":  # quarters: many x/d land exactly between two table entries
        return (rng.integers(-12, 13, (32, cols)) / 4).astype(np.float32)
    if kind == "powers":  # amax a power of two, and just below one: where floor(log2f) decides the exponent
        return np.ldexp(np.float32(1) - rng.integers(0, 2, (32, cols)).astype(np.float32) * np.float32(2 ** -24),
                        rng.integers(-120, 120, (32, cols))).astype(np.float32)
    raise KeyError(kind)


KINDS = ("normal", "weights", "zeros", "tiny", "subnormal", "huge", "ties", "powers")


@pytest.mark.parametrize("type_name", ["MXFP4", "NVFP4"])
def test_fp4_quantizers_are_ggmls_byte_for_byte(type_name):
    rng = np.random.default_rng(7)
    quantize = floatq.quantize_ggml_mxfp4 if type_name == "MXFP4" else floatq.quantize_ggml_nvfp4
    decode = floatq.decode_ggml_mxfp4 if type_name == "MXFP4" else floatq.decode_ggml_nvfp4
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = 0
    for kind in KINDS:
        x = _data(kind, rng, 256)
        ours, ref = quantize(x), ggml_quantize(x, type_name)
        assert np.array_equal(ours, ref), (type_name, kind)
        blocks += ref.size // nbytes
        theirs = gguf.quants.dequantize(ref, gguf.GGMLQuantizationType[type_name]).reshape(x.shape)
        assert np.array_equal(decode(ref, x.shape[1]), theirs, equal_nan=True), kind
    assert blocks == sum(_data(k, np.random.default_rng(0), 256).size for k in KINDS) // block


def test_fp4_block_packing_round_trips():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (6, 128)).astype(np.uint8)
    e = rng.integers(0, 255, (6, 4)).astype(np.uint8)
    assert all(np.array_equal(a, b) for a, b in zip(floatq.unpack_ggml_mxfp4(floatq.pack_ggml_mxfp4(codes, e), 128),
                                                     (codes, e)))
    d = rng.integers(0, 127, (6, 8)).astype(np.uint8)
    assert all(np.array_equal(a, b) for a, b in zip(floatq.unpack_ggml_nvfp4(floatq.pack_ggml_nvfp4(codes, d), 128),
                                                     (codes, d)))
    packed = floatq.pack_fp4(torch.from_numpy(codes))
    assert torch.equal(floatq.unpack_fp4(packed), torch.from_numpy(codes))
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4  # the even element in the low nibble


# -- the checker ------------------------------------------------------------------------------------------
def _float_params(scales: torch.Tensor, group: int, **kw) -> GridParams:
    from qconvert.formats.common.float_grids import float_grid

    return float_grid("e2m1", scales, group, **kw)


def test_checker_keeps_float_codes_where_the_scales_fit():
    pow2 = torch.full((4, 4), 0.25)  # 4 x 128 columns, groups of 32: powers of two
    assert check(_float_params(pow2, 32), (4, 128), GGUF_SCHEMES["MXFP4"]).verdict == EXACT
    assert check(_float_params(pow2, 32), (4, 128), UQFF_SCHEMES["mxfp4"]).verdict == EXACT
    # an NVFP4 grid (groups of 16, e4m3 scales) fits MXFP4 only where each 32-block shares one power of two
    nv = torch.full((4, 8), 0.25).to(torch.float8_e4m3fn)
    assert check(_float_params(nv, 16), (4, 128), GGUF_SCHEMES["MXFP4"]).verdict == REQUANTIZE
    assert check(_float_params(nv, 16), (4, 128), GGUF_SCHEMES["NVFP4"]).verdict == EXACT
    odd = torch.full((4, 4), 0.3)
    d = check(_float_params(odd, 32), (4, 128), GGUF_SCHEMES["MXFP4"])
    assert d.verdict == REQUANTIZE and "powers of two" in d.reason
    g = torch.tensor(3.0)
    d = check(_float_params(nv, 16, global_scale=g, global_scale_op="div"), (4, 128), GGUF_SCHEMES["NVFP4"])
    assert d.verdict == NEAR_EXACT and "reciprocal" in d.reason
    d = check(_float_params(nv, 16, global_scale=g, global_scale_op="post"), (4, 128), GGUF_SCHEMES["NVFP4"])
    assert d.verdict == EXACT
    # FP8 into GGUF: no ggml type holds e4m3 codes
    from qconvert.formats.common.float_grids import float_grid

    fp8 = float_grid("e4m3", torch.ones(4, 1), 128)
    d = check(fp8, (4, 128), GGUF_SCHEMES["Q8_0"])
    assert d.verdict == REQUANTIZE and "e4m3 float codes are not a uniform grid" in d.reason
    assert check(fp8, (4, 128), UQFF_SCHEMES["fp8"]).verdict == EXACT
    per_row = float_grid("e4m3", torch.arange(1, 5, dtype=torch.float32)[:, None], 128)
    assert check(per_row, (4, 128), UQFF_SCHEMES["fp8"]).verdict == REQUANTIZE
    assert check(per_row, (4, 48), GGUF_SCHEMES["MXFP4"]).verdict == "refused"


# -- readers against their producers ----------------------------------------------------------------------
@pytest.mark.parametrize("case", ["fp8", "nvfp4", "mxfp4"])
def test_modelopt_reads_equal_modelopts_own_dequantization(case):
    oracle = json.loads((MO / case / "oracle.json").read_text())["weights"]
    grids = _grids(ModelOptSource(MO / case))
    assert sorted(grids) == sorted(oracle) and len(oracle) == 7
    for name, rec in grids.items():
        assert _sha(rec.load().dequantize(torch.float32)) == oracle[name]["sha256"], name


def _gptqmodel_dequantized(src: Path, tmp: Path) -> dict:
    """gptqmodel 7.6's offline dequantize_model (float32), in a child process (its import patches transformers)."""
    out = tmp / "gptqmodel_dequant"
    code = ("import sys, torch; from gptqmodel.utils.model_dequant import dequantize_model; "
            "dequantize_model(sys.argv[1], sys.argv[2], target_dtype=torch.float32)")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update(load_file(str(f)))
    return found


@pytest.mark.parametrize("case", ["nvfp4", "fp8"])
def test_modelopt_reads_equal_gptqmodels_dequantization(case, tmp_path):
    theirs = _gptqmodel_dequantized(MO / case, tmp_path)
    grids = _grids(ModelOptSource(MO / case))
    for name, rec in grids.items():
        assert torch.equal(rec.load().dequantize(torch.float32) + 0.0, theirs[name] + 0.0), name  # + 0.0: -0 == 0
    assert len(grids) == 7


def _deepseek(kind: str) -> Path:
    """The tiny DeepSeek-V3 of fixtures_archs (MLA, 4 experts, a shared expert) in FP8: "transformers" made by
    transformers' own quantizer in 16x32 blocks (every weight tiles), "deepseek" in 128x128 blocks with partial
    edge blocks as DeepSeek-V3's checkpoints have them."""
    path = CACHE / f"deepseek_fp8_{kind}"
    if not (path / "config.json").exists():
        dense = _load("fixtures_archs").build_arch_model(CACHE / "deepseek_dense", "deepseek_v3")
        block, rule = ((16, 32), kind) if kind.startswith("transformers") else ((128, 128), "deepseek")
        FF.fp8_checkpoint(dense, path.with_name(path.name + ".tmp"), block=block, rule=rule)
        shutil.move(str(path.with_name(path.name + ".tmp")), str(path))
    return path


@pytest.mark.parametrize("kind", ["transformers", "transformers-ue8m0"])
def test_fp8_reads_equal_transformers_dequantization(kind):
    """FP8 made by transformers' own quantizer, float32 scales and (scale_fmt ue8m0, DeepSeek-V3.1) E8M0 ones."""
    path = _deepseek(kind)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))  # no GPU: transformers dequantizes to bf16
    params = dict(model.named_parameters())
    grids = _grids(Fp8Source(path))
    checked = 0
    for name, rec in grids.items():
        ours = rec.load().dequantize(torch.float32).to(torch.bfloat16)
        if name in params:
            assert torch.equal(ours, params[name].detach()), name
        else:  # transformers 5 fuses the experts: experts.gate_up_proj [E, 2I, H] (gate rows first), down_proj
            head, e, proj = name.rsplit(".experts.", 1)[0], *name.rsplit(".experts.", 1)[1].split(".")[:2]
            fused = params[f"{head}.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"].detach()[int(e)]
            rows = ours.shape[0]
            part = fused if proj == "down_proj" else fused[:rows] if proj == "gate_proj" else fused[rows:]
            assert torch.equal(ours, part), name
        checked += 1
    assert checked == len(grids) == 26


def test_fp8_with_partial_edge_blocks_equals_gptqmodels_dequantization(tmp_path):
    path = _deepseek("deepseek")
    theirs = _gptqmodel_dequantized(path, tmp_path)
    grids = _grids(Fp8Source(path))
    partial = [n for n, r in grids.items() if r.shape[0] % 128 or r.shape[1] % 128]
    assert len(partial) >= 10  # most of the tiny model's weights end in a partial block
    for name, rec in grids.items():
        assert torch.equal(rec.load().dequantize(torch.float32), theirs[name]), name
    assert len(grids) == 26


# -- byte-exact moves ---------------------------------------------------------------------------------------
def _llama_cpp_converter(src: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "llama_cpp_reference.py"), str(src),
                           str(out), "--outtype", "bf16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return gguf_tensors(out)


def _bytes(t) -> bytes:
    return np.asarray(t.data).view(np.uint8).tobytes()


@pytest.mark.parametrize("src", [CT / "nvfp4a16", MO / "nvfp4"], ids=["compressed-tensors", "modelopt"])
def test_nvfp4_to_gguf_is_llama_cpps_converter_byte_for_byte(src, tmp_path):
    """Every NVFP4 block and every `.scale` (compressed-tensors' global scale as its reciprocal, ModelOpt's
    weight_scale_2 as it is) equals what llama.cpp's own converter writes; the codes are the producer's."""
    out, report = tmp_path / "ours.gguf", tmp_path / "r.json"
    run_cli("->".join(("ct" if "compressed" in str(src) else "modelopt", "gguf")), src, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    fp4 = [t for t in tensors if t["target"] == "NVFP4"]
    assert len(fp4) == 7 and all(t["verdict"] == NEAR_EXACT and t["max_abs_err"] < 1e-6 for t in fp4)
    not_carried = json.loads(report.read_text())["source"]["not_carried"]  # ModelOpt's activation scales
    assert sorted(not_carried) == ([] if "compressed" in str(src) else
                                   sorted(f"{n[: -len('.weight')]}.input_scale" for n in (t["name"] for t in fp4)))
    ours, ref = gguf_tensors(out), _llama_cpp_converter(src, tmp_path / "ref.gguf")
    nvfp4 = [n for n, t in ref.items() if t.tensor_type == gguf.GGMLQuantizationType.NVFP4]
    scales = [n for n in ref if n.endswith(".scale")]
    assert len(nvfp4) == len(scales) == 7
    for name in nvfp4 + scales:
        assert ours[name].tensor_type == ref[name].tensor_type and _bytes(ours[name]) == _bytes(ref[name]), name
    # the only tensors the converter adds are the activation scales (llama.cpp loads them and does not use them)
    assert all(n.endswith(".input_scale") for n in set(ref) - set(ours)) and not set(ours) - set(ref)


def _transformers_logits_of(grids_src, tmp_path: Path) -> np.ndarray:
    """transformers (float32) on the source's own dequantized weights (qconvert's `->hf --type f32`, whose
    values the tests above prove equal to the producers' dequantization)."""
    dense = tmp_path / "dense"
    run_cli(f"{grids_src[0]}->hf", grids_src[1], dense, "--type", "f32")
    from helpers import transformers_logits

    return transformers_logits(dense, PROMPT)


@pytest.mark.parametrize("fmt, src, gtype", [("ct", CT / "mxfp4a16", "MXFP4"), ("modelopt", MO / "mxfp4", "MXFP4"),
                                             ("ct", CT / "nvfp4a16", "NVFP4"), ("modelopt", MO / "nvfp4", "NVFP4")])
def test_fp4_gguf_keeps_the_codes_and_runs_in_llama_cpp(fmt, src, gtype, tmp_path):
    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    run_cli(f"{fmt}->gguf", src, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert sum(t["target"] == gtype for t in tensors) == 7
    grids = _grids(CtSource(src) if fmt == "ct" else ModelOptSource(src))
    back = _grids(GgufSource(out))
    for name, rec in grids.items():  # the file's codes and block scales are the source's own
        a, b = rec.load(), back[name].load()
        assert torch.equal(a.codes, b.codes), name
        assert torch.equal(a.params.effective_scales() if gtype == "MXFP4" else a.params.scales.to(torch.float32),
                           b.params.effective_scales()), name
    if gtype == "MXFP4":
        assert all(t["verdict"] == EXACT and t["max_abs_err"] == 0.0 for t in tensors)
    ref = _transformers_logits_of((fmt, src), tmp_path)
    got = llama_logits(out, PROMPT)
    spread = float(ref.max() - ref.min())
    assert np.abs(got - ref).max() <= LOGIT_TOLERANCE * spread, (np.abs(got - ref).max(), spread)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_gguf_fp4_blocks_copy_to_gguf_and_uqff(tmp_path):
    """A GGUF MXFP4 / NVFP4 source keeps its blocks (and `.scale`) in GGUF, and its MXFP4 blocks in UQFF."""
    for src, gtype in ((CT / "mxfp4a16", "MXFP4"), (MO / "nvfp4", "NVFP4")):
        first = tmp_path / f"{gtype}.gguf"
        run_cli(f"{'ct' if 'compressed' in str(src) else 'modelopt'}->gguf", src, first)
        again, report = tmp_path / f"{gtype}-again.gguf", tmp_path / f"{gtype}.json"
        run_cli("gguf->gguf", first, again, "--report", report)
        tensors = json.loads(report.read_text())["tensors"]
        assert all(t["verdict"] == EXACT and t["max_abs_err"] == 0.0 for t in tensors), tensors
        a, b = gguf_tensors(first), gguf_tensors(again)
        assert sorted(a) == sorted(b) and all(_bytes(a[n]) == _bytes(b[n]) for n in a if a[n].tensor_type.name == gtype
                                              or n.endswith(".scale"))
    uqff, report = tmp_path / "uqff", tmp_path / "u.json"
    run_cli("gguf->uqff", tmp_path / "MXFP4.gguf", uqff, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert sum(t["target"] == "mxfp4" and t["verdict"] == EXACT for t in tensors) == 7
    back = tmp_path / "from-uqff.gguf"  # and back: the same MXFP4 blocks as the first GGUF
    run_cli("uqff->gguf", uqff, back)
    a, b = gguf_tensors(tmp_path / "MXFP4.gguf"), gguf_tensors(back)
    mx = [n for n, t in a.items() if t.tensor_type.name == "MXFP4"]
    assert len(mx) == 7 and all(b[n].tensor_type.name == "MXFP4" and _bytes(a[n]) == _bytes(b[n]) for n in mx)


def _mistralrs_gap(uqff: Path, tmp_path: Path) -> float:
    FU = _load("fixtures_uqff")
    FU.mistralrs_ready(uqff)
    stem = sorted(p.name for p in uqff.glob("*.uqff"))[0]
    mistral = FU.mistralrs_logprobs(uqff, tmp_path / "lp.json", from_uqff=stem)
    run_cli("uqff->hf", uqff, tmp_path / "back", "--type", "f32")
    FU.mistralrs_ready(tmp_path / "back")
    return FU.teacher_forced_gap(tmp_path / "back", mistral)


@pytest.mark.parametrize("fmt, src, utype", [("modelopt", MO / "fp8", "fp8"), ("ct", CT / "mxfp4a16", "mxfp4")])
def test_uqff_keeps_fp8_and_mxfp4_codes_and_runs_in_mistralrs(fmt, src, utype, tmp_path):
    out, report = tmp_path / "uqff", tmp_path / "r.json"
    run_cli(f"{fmt}->uqff", src, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert sum(t["target"] == utype and t["verdict"] == EXACT for t in tensors) == 7
    assert all(t["max_abs_err"] == 0.0 for t in tensors)
    from qconvert.formats.uqff.reader import UqffSource

    back = _grids(UqffSource(out))
    for name, rec in _grids(CtSource(src) if fmt == "ct" else ModelOptSource(src)).items():
        assert torch.equal(rec.load().codes, back[name].load().codes), name
    assert _mistralrs_gap(out, tmp_path) < 1e-3


# -- requantizing: FP8 into GGUF ------------------------------------------------------------------------------
def test_fp8_needs_allow_requant_for_gguf_and_names_the_aligned_choice(tmp_path):
    err = expect_user_error("fp8->gguf", _deepseek("deepseek"), tmp_path, "refused", "e4m3", "--allow-requant")
    assert "--type f32" in err or "--type f16" in err


# -- bad input --------------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case, edit, needles", [
    ("missing_scale_2", lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_2"),
     ("weight_scale_2", "up_proj")),
    ("scale_shape", lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight_scale",
                                            t["model.layers.0.mlp.up_proj.weight_scale"][:, :4].contiguous()),
     ("weight_scale shape", "up_proj")),
    ("weight_dtype", lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                             t["model.layers.0.mlp.up_proj.weight"].to(torch.int16)),
     ("I16", "up_proj")),
    ("scale_without_weight", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"), ("without weight", "up_proj")),
])
def test_bad_modelopt_input_is_one_line(case, edit, needles, tmp_path):
    src = _copy(MO / "nvfp4", tmp_path / "model")
    _edit(src, edit)
    expect_user_error("modelopt->gguf", src, tmp_path, *needles)


@pytest.mark.parametrize("case, needles", [
    ("block_size", ("weight_block_size",)),
    ("scale_shape", ("scale shape", "q_a_proj")),
    ("no_weight", ("without weight", "q_a_proj")),
])
def test_bad_fp8_input_is_one_line(case, needles, tmp_path):
    src = _copy(_deepseek("deepseek"), tmp_path / "model")
    name = "model.layers.0.self_attn.q_a_proj"
    if case == "block_size":
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = [128]
        (src / "config.json").write_text(json.dumps(cfg))
    elif case == "scale_shape":
        _edit(src, lambda t: t.__setitem__(f"{name}.weight_scale_inv", torch.ones(3, 3)))
    else:
        _edit(src, lambda t: t.pop(f"{name}.weight"))
    expect_user_error("fp8->gguf", src, tmp_path, *needles)


@pytest.mark.parametrize("fmt, pair", [("fp8", "fp8->gguf"), ("fp8", "fp8->hf"), ("modelopt", "modelopt->mlx"),
                                       ("modelopt", "modelopt->hf")])
def test_fp8_weight_without_its_scale_is_refused_for_every_target(fmt, pair, tmp_path):
    """Without its scale an FP8 weight is bare e4m3 codes (|w| up to 448): refused by the reader, whatever the
    target, instead of written as weights (GGUF, MLX) or refused for its dtype naming no file (hf)."""
    src, scale = ((_copy(_deepseek("deepseek"), tmp_path / "model"), "weight_scale_inv") if fmt == "fp8" else
                  (_copy(MO / "fp8", tmp_path / "model"), "weight_scale"))
    name = "model.layers.0.mlp.down_proj"
    _edit(src, lambda t: t.pop(f"{name}.{scale}"))
    expect_user_error(pair, src, tmp_path, "model.safetensors", f"tensor {name}.weight",
                      f"missing {scale} for this FP8 weight")


# -- gpt-oss's MXFP4 checkpoints ---------------------------------------------------------------------------
def _gpt_oss_mxfp4() -> Path:
    """fixtures_archs' tiny gpt-oss (2 layers, 4 experts) in gpt-oss's MXFP4 checkpoint form (its
    gpt_oss_mxfp4_checkpoint: `*_blocks` / `*_scales` as OpenAI publishes gpt-oss)."""
    path = CACHE / "gpt_oss_mxfp4"
    if not (path / "config.json").exists():
        fa = _load("fixtures_archs")
        dense = fa.build_arch_model(CACHE / "gpt_oss_dense", "gpt_oss")
        shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
        fa.gpt_oss_mxfp4_checkpoint(dense, path.with_name(path.name + ".tmp"))
        shutil.move(str(path.with_name(path.name + ".tmp")), str(path))
    return path


def test_gpt_oss_mxfp4_reads_equal_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from qconvert.formats.mxfp4.reader import Mxfp4Source

    path = _gpt_oss_mxfp4()
    stored = load_file(str(path / "model.safetensors"))
    grids = _grids(Mxfp4Source(path))
    checked = 0
    for blocks in [k for k in stored if k.endswith("_blocks")]:
        base = blocks[: -len("_blocks")]
        head, what = base.rsplit(".", 1)
        # transformers' own dequantization: [experts, in, out], gate/up columns interleaved
        theirs = convert_moe_packed_tensors(stored[blocks], stored[base + "_scales"], dtype=torch.float32)
        for e in range(theirs.shape[0]):
            w = theirs[e].T
            parts = {"down_proj": w} if what == "down_proj" else {"gate_proj": w[0::2], "up_proj": w[1::2]}
            for proj, want in parts.items():
                ours = grids[f"{head}.{e}.{proj}.weight"].load().dequantize(torch.float32)
                assert torch.equal(ours.view(torch.int32), want.contiguous().view(torch.int32)), (blocks, e, proj)
                checked += 1
    assert checked == len(grids) == 24


def test_gpt_oss_mxfp4_to_gguf_is_llama_cpps_converter_byte_for_byte(tmp_path):
    """Every expert stack's MXFP4 blocks, every other tensor and general.file_type (MOSTLY_MXFP4_MOE) equal the
    file llama.cpp's converter writes from the same checkpoint (its MXFP4 passthrough), and llama.cpp runs it
    within its activation quantization of transformers on the checkpoint (which dequantizes MXFP4 on CPU)."""
    src = _gpt_oss_mxfp4()
    out, report = tmp_path / "ours.gguf", tmp_path / "r.json"
    run_cli("mxfp4->gguf", src, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert sum(t["target"] == "MXFP4" for t in tensors) == 24
    assert all(t["verdict"] == EXACT and t["max_abs_err"] == 0.0 for t in tensors)
    proc = subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "llama_cpp_reference.py"), str(src),
                           str(tmp_path / "ref.gguf"), "--outtype", "f32"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, ref = gguf_tensors(out), gguf_tensors(tmp_path / "ref.gguf")
    assert sorted(ours) == sorted(ref)
    assert sum(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in ref.values()) == 6
    for name in ref:
        assert ours[name].tensor_type == ref[name].tensor_type and _bytes(ours[name]) == _bytes(ref[name]), name
    file_type = [int(gguf.GGUFReader(str(p)).fields["general.file_type"].parts[-1][0]) for p in (out, tmp_path / "ref.gguf")]
    assert file_type == [38, 38]
    fa = _load("fixtures_archs")
    prompt = fa.arch_prompt()
    want = fa.transformers_logits(src, prompt)
    got = llama_logits(out, prompt)
    assert np.abs(got - want).mean() < 0.05 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_gpt_oss_mxfp4_to_hf_is_refused_naming_the_route(tmp_path):
    err = expect_user_error("mxfp4->hf", _gpt_oss_mxfp4(), tmp_path, "fused", "gguf->hf")
    assert "experts.0" in err


@pytest.mark.parametrize("case, needles", [("no_scales", ("_scales", "gate_up_proj")),
                                           ("short_scales", ("blocks", "scales", "gate_up_proj")),
                                           ("no_o_proj_bias", ("model.layers.1.self_attn.o_proj.bias", "missing")),
                                           ("int_bias", ("down_proj_bias", "I32", "integer")),
                                           ("experts_used_list", ("config.json", "num_experts_per_tok is [1, 2]")),
                                           ("experts_used_negative", ("config.json", "num_experts_per_tok is -1")),
                                           ("window_infinite", ("config.json", "sliding_window is -inf")),
                                           ("window_empty", ("config.json", "sliding_window is ''")),
                                           ("window_huge", ("config.json", "sliding_window is -1e+300"))])
def test_bad_gpt_oss_mxfp4_input_is_one_line(case, needles, tmp_path):
    src = _copy(_gpt_oss_mxfp4(), tmp_path / "model")
    # scripts/fuzz seed 2029: config values the GGUF metadata hooks cannot convert raised a TypeError (int() of a
    # list), an OverflowError (int() of inf) or a struct.error when the header was packed (a negative count)
    edits = {"experts_used_list": '"num_experts_per_tok": [1, 2]', "experts_used_negative": '"num_experts_per_tok": -1',
             "window_infinite": '"sliding_window": -1e400', "window_empty": '"sliding_window": ""',
             "window_huge": '"sliding_window": -1e300'}
    if case in edits:
        key = edits[case].split(":")[0].strip('"')
        cfg = json.loads((src / "config.json").read_text())
        text = json.dumps({**cfg, key: "@VALUE@"}).replace(f'"{key}": "@VALUE@"', edits[case])
        (src / "config.json").write_text(text)
        expect_user_error("mxfp4->gguf", src, tmp_path, *needles)
        return
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    # found by scripts/fuzz: a missing bias converted to a GGUF without it (which llama.cpp cannot load), a
    # bias retagged as integers converted its bits as integers
    if case == "no_o_proj_bias":
        name = "model.layers.1.self_attn.o_proj.bias"
    elif case == "int_bias":
        name = "model.layers.0.mlp.experts.down_proj_bias"
    _edit(src, (lambda t: t.pop(name)) if case in ("no_scales", "no_o_proj_bias") else
          (lambda t: t.__setitem__(name, t[name].view(torch.int32))) if case == "int_bias" else
          (lambda t: t.__setitem__(name, t[name][:, :, :-1].contiguous())))
    expect_user_error("mxfp4->gguf", src, tmp_path, *needles)


# -- FP8 DeepSeek-V3 to Q4_K_M: streaming, bounded memory, llama.cpp's bytes -------------------------------------
def test_fp8_deepseek_to_q4_k_m_is_llama_quantizes_q4_k_m_and_runs(tmp_path):
    """`fp8->gguf --type q4_k_m --allow-requant` of a DeepSeek-V3-shaped FP8 checkpoint (the wide tiny model of
    fixtures_archs, 128x128 blocks with partial edges) writes what llama-quantize's Q4_K_M makes of our F32 file
    of the same model, byte for byte, and llama.cpp runs it close to transformers on the FP8 weights."""
    from llama_quantize import llama_quantize

    path = CACHE / "deepseek_fp8_wide"
    if not (path / "config.json").exists():
        dense = _load("fixtures_archs").build_arch_model(CACHE / "deepseek_dense_wide", "deepseek_v3", wide=True)
        FF.fp8_checkpoint(dense, path.with_name(path.name + ".tmp"), block=(128, 128), rule="deepseek")
        shutil.move(str(path.with_name(path.name + ".tmp")), str(path))
    f32, ours, ref = tmp_path / "f32.gguf", tmp_path / "q4km.gguf", tmp_path / "ref.gguf"
    run_cli("fp8->gguf", path, f32, "--type", "f32")
    run_cli("fp8->gguf", path, ours, "--type", "q4_k_m", "--allow-requant")
    llama_quantize(f32, ref, 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    a, b = gguf_tensors(ours), gguf_tensors(ref)
    assert sorted(a) == sorted(b)
    assert {t.tensor_type.name for t in a.values()} >= {"Q4_K", "Q6_K"}
    for name in b:
        assert a[name].tensor_type == b[name].tensor_type and _bytes(a[name]) == _bytes(b[name]), name
    run_cli("fp8->hf", path, tmp_path / "dense", "--type", "f32")
    fa = _load("fixtures_archs")
    prompt = fa.arch_prompt()
    exact = llama_logits(f32, prompt)  # llama.cpp on the FP8 weights themselves
    assert np.abs(exact - fa.transformers_logits(tmp_path / "dense", prompt)).max() < 0.05
    got = llama_logits(ours, prompt)  # Q4_K_M's own loss (this tiny model's logits have std about 1)
    assert np.abs(got - exact).mean() < 0.3 and (got.argmax(-1) == exact.argmax(-1)).mean() >= 0.5


MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out, warm = map(Path, sys.argv[1:4])
    opts = Options(type="q4_k_m", allow_requant=True)
    convert("fp8", warm, "gguf", out.with_name("warmup.gguf"), opts, progress=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = convert("fp8", src, "gguf", out, opts, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "seconds": report.seconds,
                      "targets": sorted({r.plan.target for r in report.results})}))
""")


def test_fp8_deepseek_multi_shard_to_q4_k_m_stays_within_twice_the_largest_shard(tmp_path):
    """A DeepSeek-V3-shaped FP8 model (hidden 1024, 32 experts of 512, 3 layers: 119 M weights, 122 MB in 3 shards
    of at most 40 MB, written shard by shard; a layer's experts span two shards) to Q4_K_M: the converting
    process's peak RSS grows by less than twice the largest shard over a warm-up conversion of the small FP8
    model (getrusage, a fresh process). Measured: 59-62 MB over a 41.7 MB shard."""
    src = CACHE / "deepseek_fp8_big"
    if not (src / "config.json").exists():
        cfg, tensors = FF.deepseek_v3_fp8_shapes()
        tmp = src.with_name(src.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        FF.write_random_fp8_model(tmp, cfg, tensors, max_shard_bytes=40 << 20)
        fixtures.build_tokenizer(tmp)
        shutil.move(str(tmp), str(src))
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) >= 3
    with open(src / "model.safetensors.index.json") as f:
        where = json.load(f)["weight_map"]
    assert len({where[n] for n in where if n.startswith("model.layers.1.mlp.experts.")}) >= 2  # a layer spans shards
    largest = max(p.stat().st_size for p in shards)
    out = tmp_path / "out.gguf"
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(src), str(out), str(_deepseek("deepseek"))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = result["peak"] - result["base"]
    print(f"peak RSS grew {grown / 1e6:.1f} MB; largest shard {largest / 1e6:.1f} MB; {result['seconds']:.1f} s")
    assert grown < 2 * largest, (grown / 1e6, largest / 1e6)
    assert {"Q4_K", "Q6_K"} <= set(result["targets"])
    r = gguf.GGUFReader(str(out))
    assert sum(t.name.endswith("_exps.weight") for t in r.tensors) == 6


# -- float grids written as compressed-tensors ---------------------------------------------------------------
@pytest.mark.parametrize("fmt, make, want_format, verdict", [
    ("modelopt", lambda tmp: MO / "fp8", "float-quantized", EXACT),
    ("modelopt", lambda tmp: MO / "nvfp4", "nvfp4-pack-quantized", NEAR_EXACT),
    ("gguf", lambda tmp: _gguf_of("ct", CT / "mxfp4a16", tmp), "mxfp4-pack-quantized", EXACT),
    ("gguf", lambda tmp: _gguf_of("ct", CT / "nvfp4a16", tmp), "nvfp4-pack-quantized", NEAR_EXACT),
    ("fp8", lambda tmp: _deepseek("deepseek"), "float-quantized", EXACT),
], ids=["modelopt-fp8", "modelopt-nvfp4", "gguf-mxfp4", "gguf-nvfp4", "deepseek-fp8-blocks"])
def test_float_grids_become_compressed_tensors_float_formats_that_transformers_loads(fmt, make, want_format,
                                                                                       verdict, tmp_path):
    """A float grid keeps its codes in the compressed-tensors float format that holds it (FP8 with its own scale
    layout, DeepSeek's 128x128 blocks as strategy block; MXFP4; NVFP4, a multiplying global scale stored as the
    reciprocal compressed-tensors divides by: near-exact), one config group, and transformers 5.24 with
    compressed-tensors 0.19 loads it with exactly the weights compressed-tensors' own decompression gives."""
    from ct_runtime import _as_runtime, _ct_model

    src = make(tmp_path)
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli(f"{fmt}->compressed-tensors", src, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    grids = [t for t in tensors if t["target"] == want_format]
    assert grids and all(t["verdict"] == verdict for t in grids), tensors
    assert all(t["max_abs_err"] < 1e-6 for t in tensors) and (verdict == NEAR_EXACT or
                                                               all(t["max_abs_err"] == 0.0 for t in grids))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == want_format and len(qc["config_groups"]) == 1
    written = _grids(CtSource(out))
    source = _grids(GgufSource(src) if fmt == "gguf" else ModelOptSource(src) if fmt == "modelopt" else Fp8Source(src))
    for name, rec in written.items():
        assert torch.equal(rec.load().codes, source[name].load().codes), name
    params = {n: t.detach() for n, t in _ct_model(out, dtype=None).named_parameters()}
    for name, rec in written.items():
        if name in params:
            w = params[name]
        else:  # DeepSeek-V3's experts, which transformers 5 holds fused: gate_up_proj [E, 2I, H], down_proj
            head, rest = name.rsplit(".experts.", 1)
            e, proj = rest.split(".")[:2]
            fused = params[f"{head}.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
            w = fused if proj == "down_proj" else fused[: rec.shape[0]] if proj == "gate_proj" else fused[rec.shape[0]:]
        assert torch.equal(_as_runtime(rec, w.dtype), w), name
    assert len(written) == (26 if fmt == "fp8" else 7)


def _gguf_of(fmt: str, src: Path, tmp: Path) -> Path:
    out = tmp / "src.gguf"
    run_cli(f"{fmt}->gguf", src, out)
    return out


# -- a DeepSeek-V3 FP8 checkpoint with one tensor gone, renamed or reshaped (scripts/fuzz findings: these converted
# with exit 0 before run.py asked transformers' class what it loads, converters/class_tensors.py) ----------------

def _drop(name):
    return lambda t: t.pop(name)


def _rename(name):
    return lambda t: t.__setitem__(name + "x", t.pop(name))


def _reshape(name, shape):
    return lambda t: t.__setitem__(name, t[name].reshape(shape))


@pytest.mark.parametrize("edit, tensor, needle", [
    (_drop("model.layers.0.self_attn.q_a_layernorm.weight"), "model.layers.0.self_attn.q_a_layernorm.weight",
     "missing: DeepseekV3ForCausalLM has it"),
    (_drop("model.layers.1.mlp.gate.weight"), "model.layers.1.mlp.gate.weight", "missing: DeepseekV3ForCausalLM"),
    (_rename("model.layers.1.mlp.gate.e_score_correction_bias"), "model.layers.1.mlp.gate.e_score_correction_bias",
     "missing: DeepseekV3ForCausalLM"),
    (_reshape("model.layers.1.mlp.gate.e_score_correction_bias", (1, 4)),
     "model.layers.1.mlp.gate.e_score_correction_bias", "shape (1, 4) is not the (4,) DeepseekV3ForCausalLM has"),
    (_reshape("model.layers.1.mlp.gate.weight", (2, 256)), "model.layers.1.mlp.gate.weight",
     "shape (2, 256) is not the (4, 128)"),
    # an expert's tensor transposed to the same size (scripts/fuzz seed 2029): experts are outside the class check
    (lambda t: (_reshape("model.layers.1.mlp.experts.0.down_proj.weight", (64, 128))(t),  # its 16x32 blocks too
                _reshape("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", (4, 4))(t)),
     "model.layers.1.mlp.experts.0.down_proj.weight", "shape (64, 128) differs from the (128, 64) its 3 sibling"),
])
@pytest.mark.parametrize("pair", ["fp8->hf", "fp8->gguf"])
def test_fp8_deepseek_missing_or_misshapen_tensor_is_refused(edit, tensor, needle, pair, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_deepseek("transformers"), src)
    edit_safetensors(src / "model.safetensors", edit)
    expect_user_error(pair, src, tmp_path, "model.safetensors", f"tensor {tensor}", needle,
                      out_name="out.gguf" if pair.endswith("gguf") else "out")
