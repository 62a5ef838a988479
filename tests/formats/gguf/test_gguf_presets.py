"""llama-quantize's mixes (--type q4_k_m ...), grid-aware Q4_K, --imatrix and --quantizer llama.cpp,
checked against llama.cpp itself:

- the tensor types per name and every tensor's bytes equal what `llama_model_quantize` (llama.cpp's
  own quantize tool, through llama-cpp-python) makes from an F32 GGUF of the same model, for each
  preset (also with an importance matrix, passed to llama.cpp the way llama-quantize passes it);
- llama.cpp loads our q4_k_m file and its logits match transformers run on the GGUF's dequantized
  weights (gguf-py) within 5 % of the logit range;
- a gptqmodel GPTQ checkpoint converted to Q4_K keeps its codes in the super-blocks whose scales
  allow it, and there the decoded values equal the GPTQ dequantization exactly (gptqmodel's own
  dequantize_weight for the fp16 check);
- the weighted K quantizers equal ggml_quantize_chunk with an imatrix, byte for byte.

The models are 256 wide (K blocks need rows of 256), built once under tests/_fixtures/gguf_presets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures
from helpers import gguf_tensors, llama_logits, run_cli, write_legacy_imatrix
from wide_models import MODELS, _cached, build_wide_model, model_dir

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from qconvert.formats.gguf.names import gguf_arch, hf_tensor_name, inverse_permutation, qk_row_permutation  # noqa: E402
from qconvert.kernels.ggml import kquants as kq  # noqa: E402
from qconvert.kernels.ggml.libggml import ggml_quantize  # noqa: E402

from llama_quantize import llama_quantize  # noqa: E402

PROMPT = [1, 17, 233, 45, 88, 301, 12, 7, 99, 150, 402, 33, 256, 5, 71, 480]
FTYPES = {"q2_k": 10, "q3_k_m": 12, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "q8_0": 7}


def f32_gguf(key: str, tmp: Path | None = None) -> Path:
    """The F32 GGUF llama-quantize starts from (cached next to the model; built by our F32 writer, whose
    tensors were found byte-identical to those llama.cpp's convert_hf_to_gguf.py writes for llama, qwen2 and
    qwen3)."""
    src = model_dir(key)
    out = src.parent / f"{key}_256-f32.gguf"
    if not out.exists():
        tmp_out = out.with_suffix(".tmp.gguf")
        run_cli("hf->gguf", src, tmp_out, "--type", "f32", "--force")
        tmp_out.rename(out)
    return out


def _file_type(path: Path) -> int:
    r = gguf.GGUFReader(str(path))
    return int(r.fields["general.file_type"].contents())


def assert_same_tensors(ours: Path, theirs: Path) -> dict[str, str]:
    """Same names, same types, same bytes, tensor by tensor. Returns {name: type}."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b)
    types = {}
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, (name, a[name].tensor_type.name, b[name].tensor_type.name)
        got, want = np.asarray(a[name].data), np.asarray(b[name].data)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name} ({a[name].tensor_type.name}) bytes differ"
        types[name] = a[name].tensor_type.name
    return types


def dequantized_reference_logits(hf_dir: Path, gguf_path: Path, ids: list[int]) -> np.ndarray:
    """transformers on the GGUF's weights as gguf-py dequantizes them (llama Q/K rows un-permuted)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(hf_dir))
    cfg = config.to_dict()
    arch, n_layers = gguf_arch(cfg), cfg["num_hidden_layers"]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    state = model.state_dict()
    for name, t in gguf_tensors(gguf_path).items():
        hf = hf_tensor_name(name, arch, n_layers)
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        perm = qk_row_permutation(hf, cfg, arch)
        if perm is not None:
            w = w[inverse_permutation(perm)]
        state[hf].copy_(w.reshape(state[hf].shape))
        if hf == "model.embed_tokens.weight" and config.tie_word_embeddings:
            state["lm_head.weight"].copy_(w)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# ------------------------------------------------------------------------------------------------
# presets: types and bytes equal llama-quantize's; llama.cpp runs the file


@pytest.mark.parametrize("key", list(MODELS))
def test_q4_k_m_equals_llama_quantize_and_runs(key, tmp_path):
    src = model_dir(key)
    ours = tmp_path / "ours.gguf"
    report_path = tmp_path / "r.json"
    run_cli("hf->gguf", src, ours, "--type", "q4_k_m", "--allow-requant", "--report", report_path)
    theirs = llama_quantize(f32_gguf(key, tmp_path), tmp_path / "theirs.gguf", FTYPES["q4_k_m"])
    types = assert_same_tensors(ours, theirs)
    assert _file_type(ours) == _file_type(theirs) == 15
    # the mix itself, as llama.cpp chose it
    n_layers = MODELS[key][1]
    tied = MODELS[key][2]
    assert types["output.weight" if not tied else "token_embd.weight"] == "Q6_K"
    assert {types[f"blk.{i}.attn_v.weight"] for i in range(n_layers)} >= {"Q6_K"}
    assert "Q4_K" in types.values()
    report = json.loads(report_path.read_text())
    assert all("q4_k_m" in t["reason"] for t in report["tensors"] if t["target"] in ("Q4_K", "Q6_K"))

    ids = PROMPT
    got = llama_logits(ours, ids)
    want = dequantized_reference_logits(src, ours, ids)
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() < 0.05 * span, (np.abs(got - want).max(), span)


@pytest.mark.parametrize("preset", ["q2_k", "q3_k_m", "q4_k_s", "q5_k_s", "q5_k_m", "q6_k", "q8_0"])
def test_preset_types_equal_llama_quantize(preset, tmp_path):
    """The 8-layer llama: every tensor's type per llama.cpp's rules; the bytes too (same quantizers)."""
    src = model_dir("llama")
    ours = tmp_path / "ours.gguf"
    run_cli("hf->gguf", src, ours, "--type", preset, "--allow-requant")
    theirs = llama_quantize(f32_gguf("llama", tmp_path), tmp_path / "theirs.gguf", FTYPES[preset])
    assert_same_tensors(ours, theirs)
    assert _file_type(ours) == FTYPES[preset]


def test_tensor_type_override_wins_over_preset(tmp_path):
    src = model_dir("qwen3")
    ours = tmp_path / "ours.gguf"
    run_cli("hf->gguf", src, ours, "--type", "q4_k_m", "--tensor-type", r"mlp\.up_proj=q8_0", "--allow-requant")
    types = {n: t.tensor_type.name for n, t in gguf_tensors(ours).items()}
    assert {types[f"blk.{i}.ffn_up.weight"] for i in range(3)} == {"Q8_0"}
    assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"


# ------------------------------------------------------------------------------------------------
# imatrix: the weighted quantizers, the two file layouts, end to end against llama.cpp


@pytest.mark.parametrize("t", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_weighted_quantizers_equal_ggml(t):
    rng = np.random.default_rng(11)
    n = 1024
    imat = rng.gamma(0.7, 1.0, n).astype(np.float32)
    imat[rng.random(n) < 0.05] = 0.0  # columns never activated
    for x in (rng.normal(0, 0.05, (48, n)), rng.standard_t(3, (48, n)) * 0.02, np.abs(rng.normal(0, 1, (48, n)))):
        x = x.astype(np.float32)
        want = ggml_quantize(x, t, imatrix=imat)
        np.testing.assert_array_equal(kq.quantize_k(x, t, imatrix=imat, threads=1), want)
        np.testing.assert_array_equal(kq.quantize_k(x, t, imatrix=imat, threads=2), want)
    assert not np.array_equal(kq.quantize_k(x, t), want)  # the imatrix changed the result


def _imatrix_values(hf_dir: Path, seed: int = 3) -> dict[str, np.ndarray]:
    """Made-up activation statistics for every linear of the model, keyed by GGUF name."""
    from qconvert.formats.gguf.names import gguf_tensor_name
    from safetensors import safe_open

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = gguf_arch(cfg)
    rng = np.random.default_rng(seed)
    out = {}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2 and "embed_tokens" not in name:
                out[gguf_tensor_name(name, arch, cfg["num_hidden_layers"])] = rng.gamma(1.0, 2.0, shape[1]).astype(np.float32)
    return out


def _write_gguf_imatrix(path: Path, values: dict[str, np.ndarray], count: int = 512) -> None:
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["calib.txt"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 128)
    for name, v in sorted(values.items()):
        w.add_tensor(f"{name}.in_sum2", (v * np.float32(count)).reshape(1, -1).astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array([[count]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("layout", ["dat", "gguf"])
def test_imatrix_file_end_to_end_equals_llama_quantize(layout, tmp_path):
    src = model_dir("qwen3")
    values = _imatrix_values(src)
    path = tmp_path / f"imatrix.{layout}"
    (write_legacy_imatrix if layout == "dat" else _write_gguf_imatrix)(path, values)
    from qconvert.formats.gguf.imatrix import read_imatrix

    loaded = read_imatrix(path)
    assert sorted(loaded) == sorted(values)
    ours = tmp_path / "ours.gguf"
    report_path = tmp_path / "r.json"
    run_cli("hf->gguf", src, ours, "--type", "q4_k_m", "--imatrix", path, "--allow-requant", "--report", report_path)
    # llama.cpp gets the values as llama-quantize computes them from the file
    theirs = llama_quantize(f32_gguf("qwen3", tmp_path), tmp_path / "theirs.gguf", FTYPES["q4_k_m"], loaded)
    assert_same_tensors(ours, theirs)
    plain = llama_quantize(f32_gguf("qwen3", tmp_path), tmp_path / "plain.gguf", FTYPES["q4_k_m"])
    assert not np.array_equal(np.asarray(gguf_tensors(ours)["blk.0.attn_q.weight"].data),
                              np.asarray(gguf_tensors(plain)["blk.0.attn_q.weight"].data))
    report = json.loads(report_path.read_text())
    weighted = [t for t in report["tensors"] if "weighted by the imatrix" in t["reason"]]
    assert len(weighted) == len(values)


def test_llama_cpp_quantizer_backend_gives_llama_cpp_bytes(tmp_path):
    src = model_dir("qwen2")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    run_cli("hf->gguf", src, a, "--type", "q3_k_m", "--allow-requant")
    run_cli("hf->gguf", src, b, "--type", "q3_k_m", "--allow-requant", "--quantizer", "llama.cpp")
    assert_same_tensors(a, b)
    proc = run_cli("hf->gguf", src, tmp_path / "c.gguf", "--type", "q4_k_m", "--quantizer", "nope", check_rc=2)
    assert "nope" in proc.stderr


# ------------------------------------------------------------------------------------------------
# grid-aware Q4_K from gptqmodel checkpoints


def gptq_checkpoint(group_size: int) -> tuple[Path, Path]:
    """gptqmodel 4-bit sym checkpoint of the 2-layer 256-wide llama, and gptqmodel's own dequantized
    weights (reference.safetensors)."""
    base = _cached("llama2_256", lambda d: build_wide_model(d, "llama", 2, False))

    def build(d: Path):
        fixtures.quantize_gptq(base, d / "ckpt", bits=4, group_size=group_size, sym=True)
        fixtures.gptq_reference(d / "ckpt", d / "reference.safetensors", PROMPT)

    d = _cached(f"llama_gptq_g{group_size if group_size > 0 else 'm1'}", build)
    return d / "ckpt", d / "reference.safetensors"


def _q4k_codes(data: np.ndarray) -> np.ndarray:
    """Q4_K bytes [rows, nb*144] -> codes [rows*nb, 256] (sub-block 2c in the low nibbles of chunk c)."""
    b = np.asarray(data).reshape(-1, 144)
    qs = b[:, 16:144].reshape(-1, 4, 32)
    return np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)


@pytest.mark.parametrize("group_size", [128, -1])
def test_gptq_into_q4_k_keeps_codes_where_scales_fit(group_size, tmp_path):
    from safetensors.torch import load_file

    from qconvert.converters.registry import get_format
    from qconvert.kernels.ggml.kquant_grid import plan_kept_blocks

    ckpt, ref_path = gptq_checkpoint(group_size)
    out = tmp_path / "x.gguf"
    report_path = tmp_path / "r.json"
    run_cli("gptq->gguf", ckpt, out, "--type", "q4_k", "--allow-requant", "--report", report_path)
    report = {t["name"]: t for t in json.loads(report_path.read_text())["tensors"]}
    reference = load_file(str(ref_path))
    source = get_format("gptq").open_reader(ckpt)
    cfg = source.config
    arch = gguf_arch(cfg)
    tensors = gguf_tensors(out)
    total_kept = 0
    for rec in source.records():
        if not rec.is_grid:
            continue
        t = report[rec.name]
        m = re.search(r"(\d+) of (\d+) blocks kept their codes", t["reason"])
        assert m, t
        n_kept, n_blocks = int(m[1]), int(m[2])
        assert t["verdict"] == ("exact" if n_kept == n_blocks else "requantize")
        grid = rec.load()
        perm = qk_row_permutation(rec.name, cfg, arch)
        codes = grid.codes.numpy()
        exact = grid.dequantize(torch.float32).numpy()
        gptqmodel_fp16 = reference[rec.name].numpy()
        if perm is not None:  # llama's Q/K rows are permuted in the GGUF
            codes, exact, gptqmodel_fp16 = codes[perm.numpy()], exact[perm.numpy()], gptqmodel_fp16[perm.numpy()]
        q = tensors[t["out_name"]]
        decoded = np.array(gguf.quants.dequantize(q.data, q.tensor_type), dtype=np.float32).reshape(-1, 256)
        # a block kept its codes when the Q4_K nibbles are the GPTQ codes (read from the file, not the plan)
        planned = plan_kept_blocks(grid.permute_rows(perm).params if perm is not None else grid.params,
                                   grid.shape, "Q4_K")[0]
        assert int(planned.sum()) == n_kept and planned.size == n_blocks
        kept = np.all(_q4k_codes(q.data) == codes.reshape(-1, 256), axis=1)
        assert kept[planned].all()  # the file holds the GPTQ codes in every block the report counts
        # where the codes are kept the values are the GPTQ values, exactly (float32), and in fp16 what
        # gptqmodel's own dequantization gives
        kept = planned
        np.testing.assert_array_equal(decoded[kept], exact.reshape(-1, 256)[kept])
        np.testing.assert_array_equal(decoded[kept].astype(np.float16), gptqmodel_fp16.reshape(-1, 256)[kept])
        if n_kept == n_blocks:
            assert t["max_abs_err"] == 0.0
        total_kept += n_kept
    if group_size == -1:
        # one scale per row: sc = 1, m = 1, d = s, dmin = 8*s hold every block
        assert all(t["verdict"] == "exact" for t in report.values() if t["source"].startswith("4-bit"))
    print(f"group {group_size}: {total_kept} blocks kept their codes")


def test_sub_block_scale_fit_rules():
    from qconvert.kernels.ggml.kquant_grid import fit_sub_block_scales

    s = np.float32(np.float16(0.0123))
    targets = np.array([[s, 2 * s, 3 * s, 63 * s, s, s, 0, s],  # small multiples of one fp16 value: fits
                        [s, s * np.float32(1.37), s, s, s, s, s, s],  # no common fp16 step with ints <= 63
                        [0] * 8,  # all zero
                        [s, 64 * s, s, s, s, s, s, s]], np.float32)  # 64 > 63, and d = 2s leaves s/d = 1/2
    ok, d, ints = fit_sub_block_scales(targets)
    assert ok.tolist() == [True, False, True, False]
    np.testing.assert_array_equal(d[0].astype(np.float32) * ints[0].astype(np.float32), targets[0])


def test_iq1_s_mix_with_imatrix_equals_llama_quantize(tmp_path):
    """`--type iq1_s --imatrix` on the 8-layer llama, 256 wide (no shape fallback): llama-quantize's IQ1_S mix
    (LLAMA_FTYPE_MOSTLY_IQ1_S = 24: output Q5_K, token_embd Q2_K, attn_v Q2_K with 2 query heads per KV head,
    ffn_down of the first eighth of the layers Q2_K, attn_output IQ2_XXS, the rest IQ1_S) and every tensor's bytes
    (kernels/ggml/iq_c.c's IQ1_S and IQ2_XXS, kquant_imatrix_c.c's K types)."""
    from qconvert.formats.gguf.imatrix import read_imatrix

    src = model_dir("llama")
    path = tmp_path / "imatrix.dat"
    write_legacy_imatrix(path, _imatrix_values(src), ncall=1)
    ours = tmp_path / "ours.gguf"
    run_cli("hf->gguf", src, ours, "--type", "iq1_s", "--imatrix", path, "--allow-requant")
    theirs = llama_quantize(f32_gguf("llama", tmp_path), tmp_path / "theirs.gguf", 24, read_imatrix(path))
    types = assert_same_tensors(ours, theirs)
    assert _file_type(ours) == 24
    assert (types["output.weight"], types["token_embd.weight"], types["blk.0.ffn_down.weight"],
            types["blk.1.ffn_down.weight"], types["blk.3.attn_output.weight"], types["blk.2.attn_v.weight"],
            types["blk.5.ffn_up.weight"]) == ("Q5_K", "Q2_K", "Q2_K", "IQ1_S", "IQ2_XXS", "Q2_K", "IQ1_S")
