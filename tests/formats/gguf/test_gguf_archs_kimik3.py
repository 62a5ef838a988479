"""Kimi-K3 (KimiK3ForConditionalGeneration) to llama.cpp's `kimi-k3`, judged by llama.cpp itself.

The tiny checkpoint (tests/support/fixtures_archs.py build_kimi_k3: 256 wide, KDA layers 1-3 and an MLA layer 4,
a dense lead layer, latent MoE layers with a shared expert, the routed experts in compressed-tensors
mxfp4-pack-quantized, bf16 elsewhere, a vision tower beside the text model) is converted by llama.cpp's own
convert_hf_to_gguf.py (the llama-cpp-python sdist's copy: conversion/kimi_k3.py) and by `qconvert ct->gguf`:

- `--type mxfp4` with the dense tensors in F32 (the converter's `--outtype f32`): every tensor's name, type and
  bytes equal (the routed experts GGML MXFP4, the converter's repack of the same codes and exponents), every
  `kimi-k3.*` key and its type equal, and llama.cpp's logits on both files 0 apart;
- the same with the dense 2-D weights in Q8_0 (the converter's `--outtype q8_0`; its router, conv kernels,
  norms and vectors stay F32);
- `--type q4_k_m --allow-requant` equals llama-quantize's Q4_K_M (allow_requantize: it refuses the MXFP4 experts
  otherwise) of the converter's F32 file, tensor by tensor, with the same logits;
- the name and key table of formats/gguf/archs/kimi_k3.py against llama.cpp's vendored gguf-py (which the
  package never imports: gguf 0.19 has no kimi-k3), so that drift is caught;
- a residual norm without its proj is refused in one line, and a kimi-k3 GGUF as a source too (not read back);
- streaming: converting a wider MoE layer (32 experts of 1024 x 1024, 53 MB of MXFP4) to MXFP4 stacks, the
  peak RSS grows by under half those bytes over the tiny model's (measured 20 MB; 31 MB for 64 experts, 42 MB
  for three such layers: the plan keeps each grid's E8M0 scales and zero points, 2 bytes per 32 weights, until
  writing; never a layer's experts). That wider model's file was compared once with the converter's by hand
  (every tensor's bytes equal), not here: the converter on it costs 40 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fixtures_archs
from gguf_arch_files import cached as _cached
from helpers import expect_user_error, gguf_tensors, llama_logits, run_cli

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

ROOT = Path(__file__).parents[2] / "_fixtures" / "archs"
SRC_DIR = Path(__file__).parents[3] / "tests" / "_fixtures" / "llama_cpp_src"
PROMPT = fixtures_archs.arch_prompt()
# the dense tensors as the converter's --outtype writes them: F32, or Q8_0 for the 2-D weights (kv_a_proj_with_mqa
# ends in _mqa) with everything else F32; the routed experts keep their MXFP4 codes (--type mxfp4)
DENSE_F32 = ("--tensor-type", r"^(?!.*\.experts\.)=f32")
DENSE_Q8_0 = ("--tensor-type", r"^(?!.*\.experts\.).*(_proj|_mqa|embed_tokens|lm_head)\.weight$=q8_0", *DENSE_F32,
              "--allow-requant")
EXPERT_STACKS = {f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2, 3) for p in ("gate", "up", "down")}


def _reference_module():
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "scripts" / "llama_cpp_reference.py"
    spec = importlib.util.spec_from_file_location("llama_cpp_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def src() -> Path:
    return _cached(ROOT / "kimi_k3-src", fixtures_archs.build_kimi_k3)


@pytest.fixture(scope="module")
def references(src) -> dict[str, Path]:
    """llama.cpp's converter's files of `src`, --outtype f32 and q8_0, made in one child process."""
    ref = _reference_module()
    outs = {t: ROOT / f"kimi_k3-ref-{t}.gguf" for t in ("f32", "q8_0")}
    done = ROOT / "kimi_k3-ref.done"
    if not done.exists():
        jobs = [[str(src), "--outfile", str(out), "--outtype", t] for t, out in outs.items()]
        cmd = [sys.executable, "-c", ref._CHILD, str(ref.llama_cpp_src()), "qwen2", "--jobs", json.dumps(jobs)]
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0 and all(o.is_file() for o in outs.values()), proc.stderr[-4000:]
        done.write_text("ok")
    return outs


def _ours(src: Path, out: Path, *args) -> Path:
    proc = run_cli("ct->gguf", src, out, "--type", "mxfp4", *args)
    assert "vision_tower.patch_embed.proj.weight" in proc.stdout  # named in the table: dropped
    return out


def _model_keys(path: Path) -> dict:
    """Every kimi-k3.* key with its value and GGUF value types, and general.file_type."""
    r = gguf.GGUFReader(str(path))
    return {k: (f.contents(), [int(t) for t in f.types]) for k, f in r.fields.items()
            if k.startswith("kimi-k3.") or k == "general.file_type"}


def _assert_same_file(ours: Path, theirs: Path) -> dict:
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].tensor_type, list(a[name].shape)) == (b[name].tensor_type, list(b[name].shape)), name
        assert bytes(a[name].data) == bytes(b[name].data), name
    ka, kb = _model_keys(ours), _model_keys(theirs)
    assert ka == kb, {k: (ka.get(k), kb.get(k)) for k in set(ka) | set(kb) if ka.get(k) != kb.get(k)}
    assert {n for n in a if a[n].tensor_type == gguf.GGMLQuantizationType.MXFP4} == EXPERT_STACKS
    return a


@pytest.fixture(scope="module")
def ours_f32(src, tmp_path_factory) -> Path:
    return _ours(src, tmp_path_factory.mktemp("k3") / "k3-f32.gguf", *DENSE_F32)


def test_mxfp4_experts_f32_rest_is_the_converters_file_and_runs_the_same(ours_f32, references):
    ours = ours_f32
    tensors = _assert_same_file(ours, references["f32"])
    # the real layer mix is there: KDA and MLA layers, the dense lead, latent MoE with a shared expert
    assert {"blk.0.ssm_g.weight", "blk.3.attn_k_b.weight", "blk.3.attn_gate.weight", "blk.0.ffn_gate.weight",
            "blk.1.ffn_routed_down.weight", "blk.1.ffn_gate_shexp.weight", "output_res_score.weight"} <= set(tensors)
    got, want = llama_logits(ours, PROMPT), llama_logits(references["f32"], PROMPT)
    assert np.array_equal(got, want)
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show


def test_q8_0_dense_weights_are_the_converters_file(src, references, tmp_path):
    ours = _ours(src, tmp_path / "k3-q8_0.gguf", *DENSE_Q8_0)
    tensors = _assert_same_file(ours, references["q8_0"])
    assert tensors["blk.0.ssm_g.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(references["q8_0"], PROMPT))


def _llama_quantize_requant(src: Path, dst: Path, ftype: int) -> Path:
    """llama.cpp's quantize tool with allow_requantize: it refuses to requantize the MXFP4 experts without it."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, 2, True
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    return dst


def test_q4_k_m_is_llama_quantizes_mix_of_the_converters_file(src, references, tmp_path):
    """`--type q4_k_m --allow-requant` (the MXFP4 experts requantized from their values, 128-wide rows falling
    back to Q5_0 as llama-quantize's do; the conv kernels F32 as in the converter's F32 file) equals
    llama-quantize's Q4_K_M of the converter's F32 file, tensor by tensor, with the same logits."""
    ref = _cached(ROOT / "kimi_k3-ref-q4_k_m.gguf",
                  lambda out: _llama_quantize_requant(references["f32"], out, 15))  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    ours = tmp_path / "k3-q4_k_m.gguf"
    run_cli("ct->gguf", src, ours, "--type", "q4_k_m", "--allow-requant", "--tensor-type", r"conv1d=f32")
    a, b = gguf_tensors(ours), gguf_tensors(ref)
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].tensor_type, list(a[name].shape)) == (b[name].tensor_type, list(b[name].shape)), name
        assert bytes(a[name].data) == bytes(b[name].data), name
    assert _model_keys(ours) == _model_keys(ref)
    assert a["blk.0.ssm_g.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert a["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q5_0
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(ref, PROMPT))


# runs with llama.cpp's vendored gguf-py first on the path: what it names for kimi-k3
_VENDORED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import gguf
    assert gguf.__file__.startswith(sys.argv[1]), gguf.__file__
    arch = gguf.MODEL_ARCH.KIMI_K3
    tmap = gguf.get_tensor_name_map(arch, 1)
    hf = json.loads(sys.argv[2])
    K = gguf.Keys
    print(json.dumps({
        "arch": gguf.MODEL_ARCH_NAMES[arch],
        "tensors": sorted(gguf.TENSOR_NAMES[t].replace("{bid}", "0") for t in gguf.MODEL_TENSORS[arch]),
        "mapped": {h: tmap.get_name(h, try_suffixes=(".weight", ".bias")) for h in hf},
        "keys": {"kda_head_dim": K.KDA.HEAD_DIM, "kda_gate_lower_bound": K.KDA.GATE_LOWER_BOUND,
                 "expert_latent_length": K.LLM.EXPERT_LATENT_LENGTH, "situ_beta": K.Activation.SITU_BETA,
                 "situ_linear_beta": K.Activation.SITU_LINEAR_BETA, "attn_res_block_size": K.AttnRes.BLOCK_SIZE},
    }))
""")


def test_name_table_mirrors_llama_cpps_vendored_gguf_py():
    from qconvert.formats.gguf.archs import arch_for_config, kimi_k3

    table = {**kimi_k3.KIMI_K3_GLOBAL_TENSORS,
             **{f"blk.0.{g}": f"model.layers.0.{h}" for g, h in kimi_k3.KIMI_K3_BLOCK_TENSORS.items()}}
    asked = [h for g, h in table.items() if g.removeprefix("blk.0.") not in kimi_k3.CONVERTER_MADE]
    proc = subprocess.run([sys.executable, "-c", _VENDORED, str(SRC_DIR / "gguf-py"), json.dumps(asked)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vendored = json.loads(proc.stdout)
    assert vendored["arch"] == kimi_k3.KIMI_K3_ARCH
    assert sorted(table) == vendored["tensors"]  # every tensor kind of MODEL_TENSORS[KIMI_K3], no other
    for gguf_name, hf in table.items():
        if hf in vendored["mapped"]:  # the HF name the vendored TensorNameMap gives the same GGUF name
            assert vendored["mapped"][hf] == gguf_name, (hf, vendored["mapped"][hf], gguf_name)
    assert {k: t for k, (t, _) in kimi_k3.KIMI_K3_KEYS.items()} == vendored["keys"]
    # no longer refused as not written: the config maps to the entry
    arch, _ = arch_for_config({"architectures": ["KimiK3ForConditionalGeneration"]})
    assert arch is not None and arch.name == "kimi-k3"


def test_unpaired_residual_score_is_refused(src, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "k3-bad"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["language_model.model.layers.2.mlp_res_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    expect_user_error("ct->gguf", bad, tmp_path, "model.layers.2.mlp_res_norm.weight", "res_proj",
                      out_name="out.gguf")


def test_kimi_k3_gguf_is_not_read_back(ours_f32, tmp_path):
    expect_user_error("gguf->gguf", ours_f32, tmp_path, "kimi-k3", "not read back", "res_norm * res_proj",
                      out_name="back.gguf")


# the conversion alone in a child, then its own peak RSS (bytes) on the last line
_CONVERT = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out = map(Path, sys.argv[1:3])
    report = convert("compressed-tensors", src, "gguf", out, Options(type="mxfp4"), progress=False)
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "verdicts": report.summary()["verdicts"]}))
""")

def _peak_rss(src: Path, out: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(out)], capture_output=True, text=True,
                          cwd="/tmp", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = result["verdicts"]
    assert counts["exact"] > 0 and counts["exact"] == sum(counts.values()), counts
    return result["peak_rss"]


def test_wide_experts_stream(src, tmp_path):
    wide = _cached(ROOT / "kimi_k3-wide", lambda d: fixtures_archs.build_kimi_k3(
        d, layers=2, experts=32, expert_ff=1024, latent=1024))
    expert_bytes = 3 * 32 * (1024 * 1024 // 2 + 1024 * 1024 // 32)  # one MoE layer: packed codes + E8M0
    base = _peak_rss(src, tmp_path / "tiny.gguf")
    peak = _peak_rss(wide, tmp_path / "wide.gguf")
    assert peak - base < expert_bytes / 2, (peak - base, expert_bytes)
    stacks = {n: t for n, t in gguf_tensors(tmp_path / "wide.gguf").items() if n.endswith("_exps.weight")}
    assert len(stacks) == 3 and all(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in stacks.values())
