"""llama-quantize's preset rules (--type q4_k_m and kin) for MoE and newer architectures, checked
against llama.cpp itself: for every tensor of every model and every preset, the type
formats/gguf/presets.py (preset_type, then schemes.k_fallback) gives equals the type that
`llama_model_quantize` (llama.cpp's quantize tool, through llama-cpp-python) writes.

- Real models (tests/support/fixtures_presets_moe.py: mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3, phi3,
  deepseek_v3, falcon), converted to F32 GGUF by llama.cpp's own convert_hf_to_gguf.py
  (scripts/llama_cpp_reference.py), so the names, shapes, 3-D expert tensors and hparams are llama.cpp's.
  Our side sees only what the F32 file says: the tensor names and shapes (HF order = ggml ne reversed)
  and block_count, head counts, expert_count.
- Synthetic GGUF files of tiny tensors for the rules the small real models cannot reach: the 70B attn_v
  bump (80 layers), DeepSeek-2's older attn_kv_b (an attn_v-like tensor) with and without 8 experts,
  several attn_v-like / ffn_down tensors per layer (the running counters), and --tensor-type overrides
  (which llama-quantize leaves out of its counters).

Models and their F32 files are cached under tests/_fixtures/presets_moe (a .done marker per model).
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

import fixtures_presets_moe as fpm  # noqa: E402

from qconvert.formats.gguf.presets import (PRESETS, model_facts_from_gguf_names, preset_type,  # noqa: E402
                                           quantized_by_llama_cpp)
from qconvert.formats.gguf.schemes import k_fallback  # noqa: E402

ROOT = Path(__file__).parents[2] / "_fixtures" / "presets_moe"
FTYPES = {"q2_k": 10, "q3_k_m": 12, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "q8_0": 7}
# (the 1-2-bit presets q1_0 / q2_0 / tq1_0 / tq2_0 are compared with llama-quantize in test_gguf_lowbit.py, the
# IQ1 mixes, which need an imatrix, there and in test_gguf_presets.py)
assert set(FTYPES) == set(PRESETS) - {"q1_0", "q2_0", "tq1_0", "tq2_0", "iq1_s", "iq1_m"}
assert all(PRESETS[k].file_type == v for k, v in FTYPES.items())


# ------------------------------------------------------------------------------------------------
# llama.cpp's side: its converter and its quantizer


def _reference_converter():
    """scripts/llama_cpp_reference.py, or a skip naming what is missing (a failure under
    QCONVERT_REQUIRE_ORACLES=1, see conftest.py)."""
    try:
        import llama_cpp_reference
    except ImportError as e:
        pytest.skip(f"scripts/llama_cpp_reference.py not importable: {e}")
    try:
        llama_cpp_reference.llama_cpp_src()
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not available: {e}")
    return llama_cpp_reference


def reference_f32(kind: str) -> Path:
    """llama.cpp's F32 GGUF of the `kind` model, built (model, then convert_hf_to_gguf.py) once."""
    d = ROOT / kind
    out = ROOT / f"{kind}-f32.gguf"
    if (d / ".done").exists() and out.exists():
        return out
    converter = _reference_converter()
    shutil.rmtree(d, ignore_errors=True)
    out.unlink(missing_ok=True)
    fpm.build_preset_model(d, kind)
    tmp = out.with_suffix(".tmp.gguf")
    converter.convert_reference(d, tmp, outtype="f32", pre="qwen2")
    tmp.rename(out)
    (d / ".done").write_text("ok")
    return out


def llama_quantize_types(src: Path, dst: Path, ftype: int, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """{tensor name: ggml type} of llama_model_quantize's output; `overrides`: --tensor-type patterns
    (regex -> type name), passed as llama-quantize passes them (a NULL-terminated array)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    keep = []
    if overrides:
        entry_t = llama_cpp.llama_model_tensor_override
        arr = (entry_t * (len(overrides) + 1))()
        for i, (pattern, type_name) in enumerate(overrides.items()):
            keep.append(pattern.encode())
            arr[i].pattern = keep[-1]
            arr[i].type = int(gguf.GGMLQuantizationType[type_name])
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(entry_t))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(dst)).tensors}
    dst.unlink()
    return types


# ------------------------------------------------------------------------------------------------
# our side: the rules applied to what the F32 file says


def _hparam(reader, arch: str, key: str, default=0) -> int:
    field = reader.fields.get(f"{arch}.{key}")
    if field is None:
        return default
    value = field.contents()
    return int(value[0] if isinstance(value, list) else value)  # per-layer arrays: layer 0, as n_gqa() reads


def our_types(src: Path, preset: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """{tensor name: ggml type} that presets.py + k_fallback give for the F32 GGUF `src`; tensors
    llama-quantize copies keep their type; `overrides` as in llama_quantize_types."""
    import re

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
    source_types = {t.name: t.tensor_type.name for t in reader.tensors}
    overrides = overrides or {}
    manual = {n: next((t for p, t in overrides.items() if re.search(p, n)), None) for n in shapes}
    manual = {n: t for n, t in manual.items() if t is not None and quantized_by_llama_cpp(n, shapes[n])}
    facts = model_facts_from_gguf_names(
        shapes, arch, _hparam(reader, arch, "block_count"), _hparam(reader, arch, "attention.head_count"),
        _hparam(reader, arch, "attention.head_count_kv"), _hparam(reader, arch, "expert_count"), manual=manual)
    out = {}
    for name, shape in shapes.items():
        if not quantized_by_llama_cpp(name, shape):
            out[name] = source_types[name]
            continue
        chosen = manual.get(name) or preset_type(PRESETS[preset], name, shape, facts)[0]
        out[name] = k_fallback(chosen, shape, None)[0]
    return out


def assert_types_equal(src: Path, tmp_path: Path, overrides: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Every preset: our type of every tensor == llama.cpp's. Returns {preset: llama.cpp's types}."""
    mismatches, seen = [], {}
    for preset, ftype in FTYPES.items():
        theirs = llama_quantize_types(src, tmp_path / f"{preset}.gguf", ftype, overrides)
        ours = our_types(src, preset, overrides)
        assert sorted(ours) == sorted(theirs)
        mismatches += [f"{preset} {n}: ours {ours[n]}, llama.cpp {theirs[n]}" for n in theirs if ours[n] != theirs[n]]
        seen[preset] = theirs
    assert not mismatches, f"{len(mismatches)} tensors differ:\n" + "\n".join(mismatches[:40])
    return seen


# ------------------------------------------------------------------------------------------------
# real models through llama.cpp's converter


@pytest.mark.slow
@pytest.mark.parametrize("kind", fpm.KINDS)
def test_preset_types_equal_llama_quantize(kind, tmp_path):
    src = reference_f32(kind)
    seen = assert_types_equal(src, tmp_path)
    q4km = seen["q4_k_m"]
    # the comparison covered the tensors this family is about, and the rules really changed types
    names = set(q4km)
    dims = {t.name: len(t.shape) for t in gguf.GGUFReader(str(src)).tensors}
    assert {t for t in q4km.values()} > {"Q4_K", "F32"}, sorted(set(q4km.values()))
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        assert {"blk.0.ffn_gate_inp.weight", "blk.2.ffn_gate_inp.weight"} & names
        exps = [n for n in names if "_exps." in n]
        assert exps and all(dims[n] == 3 for n in exps)
        assert q4km[next(n for n in names if "ffn_gate_inp.weight" in n)] == "F32"
        assert {q4km[n] for n in exps if "ffn_down_exps" in n} == {"Q4_K", "Q6_K"}  # by layer position
    if kind in ("mixtral", "qwen3_moe"):  # 8 experts: attn_v / attn_k at Q8_0, attn_output at Q5_K
        assert q4km["blk.1.attn_v.weight"] == q4km["blk.1.attn_k.weight"] == "Q8_0"
        assert q4km["blk.1.attn_output.weight"] == "Q5_K"
    if kind == "qwen2_moe":
        assert "blk.0.ffn_down_shexp.weight" in names and q4km["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    if kind in ("phi3", "falcon"):
        assert {q4km[n] for n in names if n.endswith("attn_qkv.weight")} == {"Q4_K", "Q6_K"}
    if kind == "deepseek_v3":
        assert q4km["blk.0.attn_k_b.weight"] == "F16"  # rows of 48: neither 256- nor 32-blocks
        assert q4km["blk.0.attn_output.weight"] == "Q5_1"  # Q5_K (8 experts) on rows of 128
        assert q4km["blk.2.exp_probs_b.bias"] == "F32" and "blk.0.ffn_down.weight" in names
    if kind in ("gemma2", "gemma3", "falcon"):
        assert "output.weight" not in names  # tied: token_embd takes the output rule
        assert q4km["token_embd.weight"] == ("Q8_0" if kind == "falcon" else "Q6_K")


# ------------------------------------------------------------------------------------------------
# synthetic files: rules out of the small models' reach


def write_synthetic_gguf(path: Path, arch: str, n_layers: int, n_head: int, n_head_kv: int, n_expert: int,
                         tensors: dict[str, tuple[int, ...]]) -> Path:
    """An F32 GGUF holding just enough hparams for llama.cpp to load it for quantization, and the given
    tensors (HF-order shapes) of random values (llama-quantize never checks them against the arch)."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(2)
    rng = np.random.default_rng(0)
    for name, shape in tensors.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama70b() -> dict:
    t = {"token_embd.weight": (64, 48), "output.weight": (64, 96), "output_norm.weight": (256,)}
    for i in range(80):
        for part in ("attn_v", "attn_k", "ffn_down", "attn_output"):
            t[f"blk.{i}.{part}.weight"] = (32, 256)
    return t


def _mla_moe(n_layers: int, dense: bool) -> dict:
    """DeepSeek-2 names as older files have them (attn_kv_b, not yet split) next to the split ones, an
    attn_v in every third layer (two attn_v-like tensors there: the counter is not the layer), shared
    experts (with `dense`: a dense ffn_down beside the shared one, two per layer for the counter)."""
    t = {"token_embd.weight": (64, 256), "output.weight": (64, 256)}
    for i in range(n_layers):
        b = f"blk.{i}."
        t |= {b + "attn_kv_b.weight": (32, 256), b + "attn_q_a.weight": (32, 256), b + "attn_q_b.weight": (32, 256),
              b + "attn_kv_a_mqa.weight": (32, 256), b + "attn_k_b.weight": (2, 256, 32),
              b + "attn_v_b.weight": (2, 32, 256), b + "attn_output.weight": (32, 256), b + "attn_k.weight": (32, 256),
              b + "ffn_down_shexp.weight": (32, 256), b + "ffn_gate_inp_shexp.weight": (1, 256),
              b + "attn_kv_a_norm.weight": (256,)}
        if i % 3 == 1:
            t[b + "attn_v.weight"] = (32, 256)
        if dense:
            t[b + "ffn_down.weight"] = (32, 256)
        else:
            t |= {b + "ffn_down_exps.weight": (4, 32, 256), b + "ffn_gate_exps.weight": (4, 32, 256),
                  b + "ffn_gate_inp.weight": (4, 256), b + "exp_probs_b.bias": (4,)}
    return t


SYNTHETIC = {
    # (arch, layers, heads, kv heads, experts, tensors, --tensor-type overrides)
    "llama_70b": ("llama", 80, 8, 2, 0, _llama70b(), None),
    "mla_8_experts": ("llama", 9, 4, 1, 8, _mla_moe(9, dense=False), None),
    "mla_4_experts": ("llama", 9, 4, 1, 4, _mla_moe(9, dense=False), None),
    "mla_dense_two_ffn_down": ("llama", 9, 8, 8, 0, _mla_moe(9, dense=True), None),
    "overrides_skip_counters": ("llama", 9, 4, 2, 0, _mla_moe(9, dense=True),
                                {r"blk\.1\.attn_kv_b": "Q8_0", r"blk\.[02]\.ffn_down\.": "Q4_0"}),
}


@pytest.mark.parametrize("case", list(SYNTHETIC))
def test_synthetic_preset_types_equal_llama_quantize(case, tmp_path):
    arch, n_layers, n_head, n_head_kv, n_expert, tensors, overrides = SYNTHETIC[case]
    src = write_synthetic_gguf(tmp_path / "f32.gguf", arch, n_layers, n_head, n_head_kv, n_expert, tensors)
    seen = assert_types_equal(src, tmp_path, overrides)
    if case == "llama_70b":  # attn_v: Q5_K where the Q4_K_M rule leaves the base Q4_K
        assert {seen["q4_k_m"][f"blk.{i}.attn_v.weight"] for i in range(80)} == {"Q5_K", "Q6_K"}
    if case == "mla_8_experts":
        assert seen["q4_k_m"]["blk.0.attn_kv_b.weight"] == seen["q2_k"]["blk.3.attn_k.weight"] == "Q8_0"


# ------------------------------------------------------------------------------------------------
# an importance matrix with one vector per expert, as llama-imatrix writes it for a stacked tensor


@pytest.mark.slow
@pytest.mark.parametrize("kind, source", [("mixtral", "hf"), ("qwen3_moe", "gguf")])
def test_per_expert_imatrix_equals_llama_quantize(kind, source, tmp_path):
    """llama-imatrix stores ne0 x experts values for a stacked expert tensor, and llama-quantize requires that size
    there, weighing expert i's rows with values i*ne0 .. (i+1)*ne0. qconvert refused such an entry in one line ("the
    tensor has 64 columns"), so a MoE model's own importance matrix could not be used. Now both an HF source (one
    record per expert, joined into the stack) and a GGUF source (stacked records) give llama-quantize's bytes with
    it, and the per-expert vectors are really applied (the bytes differ from one shared vector's)."""
    from helpers import write_legacy_imatrix
    from llama_quantize import llama_quantize

    f32 = reference_f32(kind)
    rng = np.random.default_rng(7)
    per_expert, shared = {}, {}
    for t in gguf.GGUFReader(str(f32)).tensors:
        dims = [int(d) for d in t.shape]  # ggml order: ne0 (columns) first
        if len(dims) < 2 or not t.name.endswith(".weight") or t.name == "token_embd.weight":
            continue
        slices = dims[2] if len(dims) == 3 else 1
        per_expert[t.name] = rng.gamma(1.0, 2.0, dims[0] * slices).astype(np.float32)
        shared[t.name] = per_expert[t.name][: dims[0]].copy()
    stacked = [n for n in per_expert if per_expert[n].size != shared[n].size]
    assert stacked and all("_exps." in n for n in stacked)
    imatrix, one_vector = tmp_path / "experts.dat", tmp_path / "shared.dat"
    write_legacy_imatrix(imatrix, per_expert)
    write_legacy_imatrix(one_vector, shared)
    src = f32 if source == "gguf" else ROOT / kind
    ours, flat = tmp_path / "ours.gguf", tmp_path / "flat.gguf"
    from helpers import run_cli

    report = tmp_path / "r.json"
    run_cli(f"{source}->gguf", src, ours, "--type", "q4_k_m", "--imatrix", imatrix, "--allow-requant",
            "--report", report)
    run_cli(f"{source}->gguf", src, flat, "--type", "q4_k_m", "--imatrix", one_vector, "--allow-requant")
    from qconvert.formats.gguf.imatrix import read_imatrix

    theirs = llama_quantize(f32, tmp_path / "theirs.gguf", FTYPES["q4_k_m"], read_imatrix(imatrix))
    a, b, c = (gguf.GGUFReader(str(p)) for p in (ours, theirs, flat))
    want = {t.name: t for t in b.tensors}
    for t in a.tensors:
        assert t.tensor_type == want[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(want[t.name].data).view(np.uint8)), t.name
    assert len(a.tensors) == len(b.tensors)
    flat_exps = {t.name: np.asarray(t.data).view(np.uint8) for t in c.tensors if t.name in stacked}
    assert any(not np.array_equal(np.asarray(t.data).view(np.uint8), flat_exps[t.name])
               for t in a.tensors if t.name in stacked)
    import json

    reasons = {t["out_name"]: t["reason"] for t in json.loads(report.read_text())["tensors"]}
    assert any("values)" in reasons[n] or "per slice" in reasons[n] for n in reasons if "_exps." in n)
