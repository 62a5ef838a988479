"""compressed-tensors: checkpoints made by llm-compressor 0.14 (tests/producer_fixtures/compressed_tensors, remade
by scripts/producers/compressed_tensors.py) read bit for bit as compressed-tensors 0.19 dequantizes them, converted
to GGUF (llama.cpp runs it) and GPTQ (gptqmodel loads it); GPTQ checkpoints written as pack-quantized load in
transformers with compressed-tensors with the GPTQ weights; bad input refused in one line.

compressed-tensors dequantizes in the scale's dtype (fp16 here): (q - z) * s rounded once, so its weights are
our float32 grid values rounded to fp16 (the float32 product is exact) -- asserted both ways below.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ct_runtime import _as_runtime, _ct_model
from helpers import edit_safetensors, expect_user_error, gguf_dequant, gguf_tensors, llama_logits, run_cli

from qconvert.formats.compressed_tensors.reader import CtSource
from qconvert.formats.compressed_tensors.schemes import pack_dense, unpack_dense
from qconvert.formats.gguf.names import gguf_arch, gguf_tensor_name, qk_row_permutation

ROOT = Path(__file__).parents[2] / "producer_fixtures" / "compressed_tensors"
CASES = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
INT_CASES = [c for c in CASES if not c.startswith(("fp8", "nvfp4"))]
LOGIT_TOLERANCE = 0.05  # of the reference's logit range (llama.cpp quantizes activations to int8 on CPU)

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the consumer (scripts/test_env.d/40-...)")


def _sha(w: torch.Tensor) -> str:
    w = w.contiguous()
    raw = w.view(torch.uint8) if w.element_size() > 1 else w
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# -- the reader against the producer ---------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_dequantization_equals_the_producers_stored_oracle(case):
    oracle = json.loads((ROOT / case / "oracle.json").read_text())["weights"]
    src = CtSource(ROOT / case)
    seen = 0
    for rec in src.records():
        if rec.name in oracle:
            want = oracle[rec.name]
            ours = _as_runtime(rec, getattr(torch, want["dtype"]))
            assert str(ours.dtype)[6:] == want["dtype"] and list(ours.shape) == want["shape"], rec.name
            assert _sha(ours) == want["sha256"], rec.name
            seen += 1
    assert seen == len(oracle) == 7


def _ct_decompressed(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors 0.19's own decompression of every quantized module: its apply_quantization_config
    matches the config groups to the modules of the (meta) model, its compressors decompress each module's
    tensors. (transformers 5.24's dequantizing loader decodes every dense module with the first config
    group's scheme, which misreads a file with several schemes such as mixed_groups.)"""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    apply_quantization_config(model, qc)
    stored = load_file(str(path / "model.safetensors"))
    found = {}
    for name, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None:
            local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".")}
            compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
            found[f"{name}.weight"] = compressor.decompress(local, scheme)["weight"]
    return found


@pytest.mark.parametrize("case", CASES)
def test_dequantization_equals_compressed_tensors_live(case):
    theirs = _ct_decompressed(ROOT / case)
    src = CtSource(ROOT / case)
    checked = 0
    for rec in src.records():
        if rec.name in theirs:
            t = theirs[rec.name]
            assert torch.equal(_as_runtime(rec, t.dtype), t), rec.name
            checked += 1
    assert checked == len(theirs) == 7


@pytest.mark.parametrize("case", [c for c in CASES if c != "mixed_groups"])
def test_transformers_loads_the_producers_file_with_our_weights(case):
    """The runtime users load with: transformers 5.24 + compressed-tensors 0.19, dequantizing."""
    modules = dict(_ct_model(ROOT / case, dtype=None).named_modules())
    checked = 0
    for rec in CtSource(ROOT / case).records():
        if rec.name.endswith("_proj.weight"):
            w = modules[rec.name[: -len(".weight")]].weight.detach()
            assert torch.equal(_as_runtime(rec, w.dtype), w), rec.name
            checked += 1
    assert checked == 7


def test_reader_sees_every_config_group():
    src = CtSource(ROOT / "mixed_groups")
    by_name = {r.name: r for r in src.records()}
    down = by_name["model.layers.0.mlp.down_proj.weight"].params
    q = by_name["model.layers.0.self_attn.q_proj.weight"].params
    assert (down.bits, down.n_groups, down.symmetric) == (8, 1, True)  # the re: target wins over "Linear"
    assert (q.bits, q.group_size, q.symmetric) == (4, 64, False)
    assert not torch.equal(q.zeros, torch.full_like(q.zeros, 8))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_dense_packing_matches_compressed_tensors(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (6, 70), generator=g, dtype=torch.int64)
    signed = (codes - (1 << (bits - 1))).to(torch.int8)
    theirs = pack_to_int32(signed, bits)
    assert torch.equal(pack_dense(codes, bits), theirs)
    assert torch.equal(unpack_dense(theirs, bits, 70).to(torch.int64), codes)
    assert torch.equal(unpack_from_int32(theirs, bits, torch.Size((6, 70))), signed)
    zp = pack_to_int32(signed.T.contiguous(), bits, packed_dim=0)  # zero points: [out, G] packed along out
    assert torch.equal(pack_dense(codes, bits), zp.T)


# -- compressed-tensors -> GGUF ---------------------------------------------------------------------------
def _gguf_decoded(src: CtSource, out: Path):
    arch, n_layers = gguf_arch(src.config), src.config["num_hidden_layers"]
    tensors = gguf_tensors(out)
    for rec in src.records():
        decoded = torch.from_numpy(gguf_dequant(tensors[gguf_tensor_name(rec.name, arch, n_layers)])
                                   .reshape(rec.shape).copy())
        perm = qk_row_permutation(rec.name, src.config, arch)
        if perm is not None:
            decoded = decoded[torch.argsort(perm)]
        yield rec, decoded


@pytest.mark.parametrize("case, gguf_type", [("w4a16_g32_sym", "Q4_0"), ("w8a16_channel", "Q8_0")])
def test_ct_to_gguf_is_exact_and_runs_in_llama_cpp(case, gguf_type, prompt, tmp_path):
    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    run_cli("compressed-tensors->gguf", ROOT / case, out, "--type", gguf_type, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    quantized = [t for t in tensors if t["source"].endswith("sym")]
    assert len(quantized) == 7 and all(t["target"] == gguf_type and t["verdict"] == "exact" for t in quantized)
    assert all(t["max_abs_err"] == 0.0 for t in tensors)
    src = CtSource(ROOT / case)
    runtime = _ct_decompressed(ROOT / case)
    checked = 0
    for rec, decoded in _gguf_decoded(src, out):
        assert torch.equal(decoded, rec.load().dequantize(torch.float32)), rec.name
        if rec.is_grid:  # and compressed-tensors' own fp16 weights are gguf's values rounded once
            theirs = runtime[rec.name]
            assert torch.equal(decoded.to(theirs.dtype), theirs), rec.name
        checked += 1
    assert checked == 11
    ref = _logits(_ct_model(ROOT / case), prompt)
    got = llama_logits(out, prompt)
    spread = float(ref.max() - ref.min())
    assert np.abs(got - ref).max() <= LOGIT_TOLERANCE * spread, (np.abs(got - ref).max(), spread)


@pytest.mark.parametrize("case", ["fp8_dynamic", "fp8_block"])
def test_fp8_weights_are_float_grids_kept_exactly_in_f32_and_requantized_on_request(case, tmp_path):
    """fp8 weights are float grids (e4m3 codes times their scales): GGUF has no FP8 type, so the default Q8_0 is
    refused naming the aligned choice, F32 holds the grid's values exactly, and --allow-requant quantizes them."""
    err = expect_user_error("ct->gguf", ROOT / case, tmp_path, "refused", "e4m3", "--type f32")
    assert "Q8_0" in err
    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    run_cli("ct->gguf", ROOT / case, out, "--type", "f32", "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in tensors)
    src = CtSource(ROOT / case)
    for rec, decoded in _gguf_decoded(src, out):
        assert torch.equal(decoded, rec.load().dequantize(torch.float32)), rec.name
    run_cli("ct->gguf", ROOT / case, out, "--type", "q8_0", "--allow-requant", "--report", report, "--force")
    fp8 = [t for t in json.loads(report.read_text())["tensors"] if t["source"].startswith("fp8")]
    assert len(fp8) == 7 and all(t["verdict"] == "requantize" and 0 < t["max_abs_err"] < 0.01 for t in fp8)


NAIVE_FP8 = ("fp8_block_64x32_naive", "fp8_channel_naive", "fp8_tensor_naive")


def test_naive_quantized_fp8_is_read_as_fp8_never_as_int8_codes():
    """llm-compressor 0.14 labels weight-only fp8 `naive-quantized` (compressed-tensors' infer_module_format:
    float-quantized needs input activations); the tensors are F8_E4M3 codes, read as float grids for every
    strategy (the bit-for-bit match with compressed-tensors' decompression is the parametrized tests above)."""
    for case in NAIVE_FP8:
        qc = json.loads((ROOT / case / "config.json").read_text())["quantization_config"]
        assert qc["format"] == "naive-quantized" and qc["config_groups"]["group_0"]["weights"]["type"] == "float"
        src = CtSource(ROOT / case)
        grids = [r for r in src.records() if r.is_grid]
        assert len(grids) == 7 and all(r.params.element == "e4m3" for r in grids), case
        assert any(k.startswith("naive-quantized float8") for k in src.describe()["schemes"]), case
    block = {r.name: r.params for r in CtSource(ROOT / "fp8_block_64x32_naive").records() if r.is_grid}
    assert block[f"{Q}.weight"].group_size == 32 and block[f"{Q}.weight"].block_rows == 64


def test_naive_fp8_blocks_convert_and_load_in_transformers_and_llama_cpp(prompt, tmp_path):
    """The 64x32-block file into compressed-tensors (our float-quantized, which transformers 5.24 +
    compressed-tensors 0.19 load with compressed-tensors' own weights) and into an F32 GGUF llama.cpp runs."""
    case = ROOT / "fp8_block_64x32_naive"
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli("ct->compressed-tensors", case, out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in tensors), tensors
    theirs = _ct_decompressed(case)
    loaded = dict(_ct_model(out, dtype=None).named_modules())
    for name, w in theirs.items():
        assert torch.equal(loaded[name[: -len(".weight")]].weight.detach(), w), name
    gguf_out = tmp_path / "m.gguf"
    run_cli("ct->gguf", case, gguf_out, "--type", "f32")
    ref = _logits(_ct_model(case), prompt)
    got = llama_logits(gguf_out, prompt)
    assert np.abs(got - ref).max() <= 0.01 * float(ref.max() - ref.min()), np.abs(got - ref).max()


# -- compressed-tensors -> GPTQ ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["w4a16_g128_asym_gptq", "mixed_groups", "w8a8_int"])
def test_ct_to_gptq_v2_is_exact_and_gptqmodel_loads_it(case, prompt, tmp_path):
    import fixtures

    out, report = tmp_path / "gptq", tmp_path / "r.json"
    run_cli("ct->gptq-v2", ROOT / case, out, "--report", report)
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in json.loads(report.read_text())["tensors"])
    ref = fixtures.gptq_reference(out, tmp_path / "ref.safetensors", prompt)
    weights, _ = fixtures.load_reference(ref)
    src = CtSource(ROOT / case)
    checked = 0
    for rec in src.records():
        if rec.is_grid:
            ours = rec.load().dequantize(torch.float32).to(torch.float16).numpy()
            assert np.array_equal(weights[rec.name[: -len(".weight")]], ours), rec.name
            checked += 1
    assert checked == 7


# -- GPTQ / GGUF -> compressed-tensors ----------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["v2_b4_g32_sym", "v1_b4_g32_asym_zp0", "v1_b8_g128_sym", "v2_b2_g32_asym",
                                     "v1_b4_g128_sym", "v1_b4_gm1_sym"])
def test_gptq_to_ct_loads_in_transformers_with_the_gptq_weights(fx, prompt, variant, tmp_path):
    import fixtures

    v = fx["variants"][variant]
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli("gptq->compressed-tensors", v["ckpt"], out, "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in tensors)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors" and "lm_head" in qc["ignore"]
    # one config group: every module has the same bits and group size (a row of 128 is one group of 128)
    assert len(qc["config_groups"]) == 1, qc["config_groups"]
    weights, src_logits = fixtures.load_reference(v["reference"])
    model = _ct_model(out)
    modules = dict(model.named_modules())
    for name, w in weights.items():  # gptqmodel's fp16 dequantization, bit for bit
        assert np.array_equal(modules[name].weight.detach().to(torch.float16).numpy(), w), name
    assert len(weights) == 14
    got = _logits(model, prompt)
    ref = src_logits[0]
    spread = float(ref.max() - ref.min())
    assert np.abs(got - ref).max() <= LOGIT_TOLERANCE * spread, (np.abs(got - ref).max(), spread)


def test_act_order_gptq_is_refused_then_requantized(fx, prompt, tmp_path):
    """compressed-tensors 0.19 removed actorder 'group' (no weight_g_idx): a scattered g_idx has no exact form."""
    src = fx["variants"]["v1_b4_g128_sym_act"]["ckpt"]
    err = expect_user_error("gptq->ct", src, tmp_path, "refused", "actorder", "--allow-requant")
    assert "down_proj" in err
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli("gptq->ct", src, out, "--allow-requant", "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    requant = [t for t in tensors if t["verdict"] == "requantize"]
    assert requant and all("down_proj" in t["name"] and t["max_abs_err"] > 0 for t in requant)
    assert np.isfinite(_logits(_ct_model(out), prompt)).all()


@pytest.mark.parametrize("case, gguf_type", [("w4a16_g32_sym", "Q4_0"), ("w8a16_channel", "Q8_0")])
def test_gguf_round_trip_keeps_every_code_and_loads_in_transformers(case, gguf_type, tmp_path):
    gguf = tmp_path / "m.gguf"
    run_cli("ct->gguf", ROOT / case, gguf, "--type", gguf_type)
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli("gguf->ct", gguf, out, "--report", report)
    assert all(t["verdict"] == "exact" for t in json.loads(report.read_text())["tensors"])
    a = {r.name: r for r in CtSource(ROOT / case).records()}
    modules = dict(_ct_model(out, dtype=None).named_modules())
    checked = 0
    for rec in CtSource(out).records():
        if rec.is_grid:
            src = a[rec.name].load()
            assert torch.equal(_signed_codes(rec.load()), _signed_codes(src)), rec.name  # the codes, kept
            assert torch.equal(rec.load().dequantize(torch.float32), src.dequantize(torch.float32)), rec.name
            w = modules[rec.name[: -len(".weight")]].weight.detach()
            assert torch.equal(src.dequantize(torch.float32).to(w.dtype), w), rec.name
            checked += 1
    assert checked == 7


def _signed_codes(grid) -> torch.Tensor:
    cols = grid.params.group_of_column(grid.shape[1])
    return grid.codes.int() - grid.params.zeros.int()[:, cols]


def test_gguf_q4_1_min_form_is_refused_then_requantized(tmp_path):
    """Q4_1's float block min is not an integer zero point: pack-quantized cannot hold it (measured: every
    asymmetric tensor of the mixed fixture refuses; with --allow-requant they requantize)."""
    gguf = tmp_path / "m.gguf"
    run_cli("ct->gguf", ROOT / "mixed_groups", gguf)  # 4-bit asym -> Q4_1 (near-exact), 8-bit channel -> Q8_0
    expect_user_error("gguf->ct", gguf, tmp_path, "refused", "integer zero point")
    out, report = tmp_path / "ct2", tmp_path / "r.json"
    run_cli("gguf->ct", gguf, out, "--allow-requant", "--report", report)
    tensors = json.loads(report.read_text())["tensors"]
    assert sum(t["verdict"] == "requantize" for t in tensors) == 6
    assert sum(t["verdict"] == "exact" and t["source"].startswith("8-bit") for t in tensors) == 1


def test_dense_requantize_uses_compressed_tensors_rule(tmp_path):
    """hf -> ct --type 4g32: compressed-tensors' min-max RTN in the model's fp16; on the producer's base model it
    reproduces the producer's (QuantizationModifier) codes and scales exactly."""
    import fixtures

    base = tmp_path / "base"
    _one_layer_base(fixtures, base)
    out = tmp_path / "ct"
    run_cli("hf->ct", base, out, "--type", "4g32", "--allow-requant")
    ours = {r.name: r.load() for r in CtSource(out).records() if r.is_grid}
    theirs = {r.name: r.load() for r in CtSource(ROOT / "w4a16_g32_sym").records() if r.is_grid}
    assert ours.keys() == theirs.keys() and len(ours) == 7
    same_codes = sum(int((ours[n].codes == theirs[n].codes).sum()) for n in ours)
    total = sum(ours[n].codes.numel() for n in ours)
    assert same_codes == total, same_codes / total
    for n in ours:
        assert torch.equal(ours[n].params.scales, theirs[n].params.scales), n


def _one_layer_base(fixtures, out: Path) -> None:
    """The producer's base (scripts/producers/compressed_tensors.py build_base), rebuilt here."""
    from safetensors.torch import load_file, save_file

    fixtures.build_tiny_llama(out, seed=1234, tie=True)
    t = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if ".layers.1." not in k}
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))


# -- bad input -----------------------------------------------------------------------------------------
def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(ROOT / case, dst)
    return dst


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


Q = "model.layers.0.self_attn.q_proj"


def test_missing_weight_scale_is_refused(tmp_path):
    src = _copy("w4a16_g32_sym", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.pop(f"{Q}.weight_scale"))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_scale", "without weight_scale")


def test_missing_zero_point_is_refused(tmp_path):
    src = _copy("w4a16_g128_asym_gptq", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.pop(f"{Q}.weight_zero_point"))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_zero_point", "asymmetric")


@pytest.mark.parametrize("pair", ["ct->gguf", "ct->hf"])
def test_fp8_weight_without_weight_scale_is_refused(pair, tmp_path):
    """A float-quantized weight without its scale is bare e4m3 codes: refused, not written as weights."""
    src = _copy("fp8_dynamic", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.pop(f"{Q}.weight_scale"))
    expect_user_error(pair, src, tmp_path, "model.safetensors", f"tensor {Q}.weight",
                      "missing weight_scale for this FP8 weight")


def test_symmetric_config_with_asymmetric_zero_points_is_refused(tmp_path):
    """symmetric: true beside the zero points of an asymmetric file: compressed-tensors writes none for
    symmetric weights, so the flag contradicts the tensors (dropping them moved every weight)."""
    src = _copy("w4a16_g128_asym_gptq", tmp_path)
    _edit_config(src, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("symmetric", True))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", ".weight_zero_point",
                      "config_groups.group_0.weights.symmetric is true")


def test_nonzero_zero_points_beside_fp8_weights_are_refused(tmp_path):
    """Float grids have no zero point; compressed-tensors' dequantize would subtract these, qconvert dropped them."""
    src = _copy("fp8_dynamic", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(
        f"{Q}.weight_zero_point", torch.ones(t[f"{Q}.weight_scale"].shape, dtype=t[f"{Q}.weight_scale"].dtype)))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_zero_point",
                      "config_groups.group_0.weights.symmetric is true", "float weights with zero points")


def test_symmetric_zero_points_older_files_kept_are_read_as_before(tmp_path):
    """Older compressed-tensors saved the zero points of symmetric weights too, every one 0: they say nothing,
    and the weights read are the same as without them."""
    src = _copy("w8a8_int", tmp_path)
    before = {r.name: r.load().dequantize(torch.float32) for r in CtSource(src).records() if r.is_grid}
    edit_safetensors(src / "model.safetensors",
                     lambda t: t.update({k[:-len("weight_scale")] + "weight_zero_point":
                                         torch.zeros(v.shape, dtype=torch.int8)
                                         for k, v in list(t.items()) if k.endswith(".weight_scale")}))
    after = {r.name: r.load().dequantize(torch.float32) for r in CtSource(src).records() if r.is_grid}
    assert before.keys() == after.keys() and len(before) == 7
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_packed_shape_contradicting_weight_shape_is_refused(tmp_path):
    src = _copy("w4a16_g32_sym", tmp_path)
    edit_safetensors(src / "model.safetensors",
                     lambda t: t.__setitem__(f"{Q}.weight_shape", torch.tensor([128, 256], dtype=torch.int64)))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_packed", "weight_shape")


def test_symmetric_zero_points_in_an_unknown_layout_are_refused(tmp_path):
    """symmetric weights beside a weight_zero_point of a shape no compressed-tensors writer stores: it could mean
    anything, so it is refused naming it rather than left unread."""
    src = _copy("w8a8_int", tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(f"{Q}.weight_zero_point",
                                                                        torch.zeros((3, 5), dtype=torch.int8)))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_zero_point",
                      "I8 (3, 5) is in no layout compressed-tensors stores", "expected I8 (128, 1)")


def test_zero_point_of_wrong_shape_is_refused(tmp_path):
    src = _copy("w4a16_g128_asym_gptq", tmp_path)
    edit_safetensors(src / "model.safetensors",
                     lambda t: t.__setitem__(f"{Q}.weight_zero_point", t[f"{Q}.weight_zero_point"][:8].clone()))
    expect_user_error("ct->gguf", src, tmp_path, f"{Q}.weight_zero_point", "does not match")


@pytest.mark.parametrize("key, value, needle", [("strategy", "diagonal", "strategy"), ("strategy", "block", "strategy"),
                                                ("num_bits", 12, "num_bits"), ("num_bits", 0, "num_bits")])
def test_unknown_strategy_or_bits_is_refused(tmp_path, key, value, needle):
    src = _copy("w4a16_g32_sym", tmp_path)
    _edit_config(src, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__(key, value))
    expect_user_error("ct->gguf", src, tmp_path, "config.json", needle, str(value))


def test_g_idx_out_of_range_is_refused(tmp_path):
    src = _copy("w4a16_g32_sym", tmp_path)
    bad = torch.arange(128, dtype=torch.int32) // 32
    bad[5] = 99
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(f"{Q}.weight_g_idx", bad))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", f"{Q}.weight_g_idx", "out of range")


def test_a_scattered_g_idx_is_read_as_act_order(tmp_path):
    """Files of compressed-tensors < 0.19 with actorder 'group' carry weight_g_idx: W[n, k] uses group g_idx[k]."""
    src = _copy("w4a16_g32_sym", tmp_path)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    g_idx = (perm // 32).to(torch.int32)
    edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(f"{Q}.weight_g_idx", g_idx))
    recs = {r.name: r for r in CtSource(src).records()}
    grid = recs[f"{Q}.weight"].load()
    assert torch.equal(grid.params.g_idx, g_idx.to(torch.int64))
    s, z = grid.params.scales.float(), grid.params.zeros.float()
    want = (grid.codes.float() - z[:, g_idx.long()]) * s[:, g_idx.long()]
    assert torch.equal(grid.dequantize(torch.float32), want)
    expect_user_error("ct->gguf", src, tmp_path, "refused", "--allow-requant")


def test_bad_mxfp8_input_is_refused_naming_the_file_and_tensor(tmp_path):
    """mxfp8-quantized (llm-compressor's MXFP8A16): a float scale, E8M0's NaN byte and a group other than 32 are
    refused by the reader, each naming where; the first through the CLI too (one line, exit 2)."""
    from qconvert.converters.errors import BadInput

    cases = [
        ("scale-dtype", lambda src: edit_safetensors(src / "model.safetensors", lambda t: t.__setitem__(
            f"{Q}.weight_scale", t[f"{Q}.weight_scale"].to(torch.float16))),
         ("dtype F16 is not U8", f"{Q}.weight_scale")),
        ("nan-scale", lambda src: edit_safetensors(src / "model.safetensors", lambda t: t[f"{Q}.weight_scale"]
                                                   .__setitem__((0, 0), 255)), ("0xFF", f"{Q}.weight_scale")),
        ("group-64", lambda src: _edit_config(src, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__(
            "group_size", 64)), ("config.json", "mxfp8-quantized is 8-bit float weights in groups of 32")),
    ]
    for i, (case, edit, needles) in enumerate(cases):
        src = _copy("mxfp8a16", tmp_path / case)
        edit(src)
        with pytest.raises(BadInput) as err:
            [rec.params for rec in CtSource(src).records()]  # the scales are read on first use (params_loader)
        assert all(n in str(err.value) for n in needles), (case, str(err.value))
        if i == 0:
            expect_user_error("ct->mlx", src, tmp_path / case, *needles)


def test_wrong_quant_method_and_ignored_module_are_refused(tmp_path):
    src = _copy("w4a16_g32_sym", tmp_path)
    _edit_config(src, lambda qc: qc["ignore"].append(Q))
    expect_user_error("ct->gguf", src, tmp_path, "model.safetensors", Q, "ignore list")


# -- AWQ and auto-round -> compressed-tensors: other producers' grids, judged by transformers ----------------
PRODUCED = Path(__file__).parents[2] / "producer_fixtures"


def _awq_oracle(folder: Path):
    from safetensors.torch import load_file

    ref = load_file(str(folder / "reference.safetensors"))  # gptqmodel's AWQ fp16 weights and logits
    ids = json.loads((folder / "versions.json").read_text())["prompt_ids"]
    return {k: v for k, v in ref.items() if k != "__logits__"}, ref["__logits__"][0].float().numpy(), ids


def _auto_round_oracle(folder: Path):
    from safetensors.torch import load_file

    logits = load_file(str(folder / "logits.safetensors"))  # auto-round's own loader: weights, logits, ids
    return load_file(str(folder / "reference.safetensors")), logits["logits"].float().numpy(), logits["ids"].tolist()


@pytest.mark.parametrize("pair, folder, oracle", [
    ("awq->compressed-tensors", "awq/gemm_g32", _awq_oracle),
    ("awq->compressed-tensors", "awq/gemm_g128", _awq_oracle),
    ("auto-round->compressed-tensors", "auto_round/asym4_g128", _auto_round_oracle),
    ("auto-round->compressed-tensors", "auto_round/sym4_g32", _auto_round_oracle),
])
def test_awq_and_auto_round_to_ct_load_in_transformers_with_the_producers_weights(pair, folder, oracle, tmp_path):
    out, report = tmp_path / "ct", tmp_path / "r.json"
    run_cli(pair, PRODUCED / folder, out, "--report", report)
    grids = [t for t in json.loads(report.read_text())["tensors"] if t["source"].startswith("4-bit")]
    assert len(grids) == 7 and all(t["verdict"] == "exact" for t in grids), grids
    weights, ref_logits, ids = oracle(PRODUCED / folder)
    model = _ct_model(out)
    modules = dict(model.named_modules())
    for name, w in weights.items():  # the producer's fp16 weights, bit for bit
        got = modules[name[: -len(".weight")]].weight.detach().to(torch.float16)
        assert torch.equal(got, w.to(torch.float16)), name
    assert len(weights) == 7
    got = _logits(model, ids)
    spread = float(ref_logits.max() - ref_logits.min())
    assert np.abs(got - ref_logits.reshape(got.shape)).max() <= LOGIT_TOLERANCE * spread
