"""Rotated GPTQ checkpoints (`rotation: "hadamard"`): the online Hadamard before down_proj is folded into
the weight for targets without it (GGUF, hf) and kept, with the rotated grid, for GPTQ targets.

The reference is gptqmodel's own run of the rotated checkpoint (tests/support/fixtures_qqq.py, variant
rot_b4_g128), which applies the transform online.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
import fixtures_qqq
import helpers
from qconvert.formats.gptq.reader import GptqSource
from qconvert.kernels.hadamard import (UnsupportedHadamard, fold_online_hadamard, hadamard_factor, require_foldable,
                                       sylvester_matrix)

VARIANT = "rot_b4_g128"
LOGIT_TOLERANCE = 0.05  # of the logit range, llama.cpp vs gptqmodel (as for plain GPTQ -> GGUF)
HF_TOLERANCE = 0.01  # float32 transformers vs gptqmodel's fp16 kernel


@pytest.fixture(scope="module")
def rot(request):
    res = fixtures_qqq.ensure_qqq_fixtures(names=[VARIANT])
    v = res["variants"][VARIANT]
    _, logits = fixtures.load_reference(v["reference"])
    return {"ckpt": v["ckpt"], "logits": logits[0], "spread": float(np.ptp(logits))}


def _report(path):
    return json.loads(path.read_text())


# -- the transform ------------------------------------------------------------------------------------

def test_fold_matches_gptqmodels_online_transform():
    """W_plain x == W_q (online transform of x), with gptqmodel's own transform code (test-time only)."""
    from gptqmodel.quantization.rotation.hadamard_utils import get_hadK, matmul_hadU_cuda

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(5, 256, generator=g)
    had_k, k = get_hadK(256)
    online = matmul_hadU_cuda(x.double(), had_k, k) @ w.double().T
    folded = x.double() @ fold_online_hadamard(w).double().T
    assert torch.allclose(folded, online, atol=1e-5)
    h = sylvester_matrix(256) / 16
    assert torch.allclose(h @ h.T, torch.eye(256, dtype=torch.float64))


@pytest.mark.parametrize("n", [256, 4096, 12 * 64, 28 * 512, 172 * 64, 11008, 14336])
def test_hadamard_factor_agrees_with_gptqmodel(n):
    from gptqmodel.quantization.rotation.hadamard_utils import get_hadK

    assert hadamard_factor(n) == get_hadK(n)[1]
    require_foldable(n)  # gptqmodel is installed here: its K tables make every such size foldable


def test_fold_of_a_tabulated_size_matches_gptqmodels_online_transform():
    """n = 384 = 12 * 32: the fold uses gptqmodel's own 12x12 table and transform."""
    from gptqmodel.quantization.rotation.hadamard_utils import get_hadK, matmul_hadU_cuda

    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 384, generator=g)
    x = torch.randn(5, 384, generator=g)
    had_k, k = get_hadK(384)
    assert k == 12
    online = matmul_hadU_cuda(x.double(), had_k.double(), k) @ w.double().T
    folded = x.double() @ fold_online_hadamard(w).double().T
    assert torch.allclose(folded, online, atol=1e-5)


# -- conversions --------------------------------------------------------------------------------------

def test_gguf_refused_without_allow_requant(rot, tmp_path):
    out = tmp_path / "m.gguf"
    proc = helpers.run_cli("gptq->gguf", rot["ckpt"], out, check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "down_proj" in err and "rotation 'hadamard'" in err
    assert "no equivalent" in err and "--allow-requant" in err
    assert not out.exists()


@pytest.mark.parametrize("type_args", [[], ["--tensor-type", "down_proj=q8_0"]], ids=["f32", "q8_0"])
def test_gguf_folded_runs_in_llama_cpp(rot, tmp_path, prompt, type_args):
    out = tmp_path / "m.gguf"
    helpers.run_cli("gptq->gguf", rot["ckpt"], out, "--allow-requant", *type_args, "--report", tmp_path / "r.json")
    for t in _report(tmp_path / "r.json")["tensors"]:
        if ".mlp.down_proj." in t["name"]:
            assert t["verdict"] == "requantize" and t["max_abs_err"] is not None, t
            assert (t["max_abs_err"] == 0) == (not type_args), t  # F32 holds W_plain exactly; Q8_0 does not
        else:
            assert t["verdict"] in ("exact", "near-exact"), t
    got = helpers.llama_logits(out, prompt)
    assert np.abs(got - rot["logits"]).max() <= LOGIT_TOLERANCE * rot["spread"]


def test_hf_folded_matches_and_skipping_the_fold_is_wrong(rot, tmp_path, prompt):
    out = tmp_path / "hf"
    helpers.run_cli("gptq->hf", rot["ckpt"], out, "--type", "f32", "--allow-requant")
    good = np.abs(helpers.transformers_logits(out, prompt) - rot["logits"]).max()
    assert good <= HF_TOLERANCE * rot["spread"], good
    # the same model with the stored (rotated) down_proj grid as it is, i.e. without the fold
    src = GptqSource(rot["ckpt"])
    tensors = load_file(str(out / "model.safetensors"))
    replaced = 0
    for name in tensors:
        if name.endswith("mlp.down_proj.weight"):
            tensors[name] = src._load_grid(name[: -len(".weight")]).dequantize(torch.float32)
            replaced += 1
    assert replaced == 2
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    bad = np.abs(helpers.transformers_logits(out, prompt) - rot["logits"]).max()
    assert bad > 0.2 * rot["spread"] and bad > 50 * good, (bad, good)


@pytest.mark.parametrize("target", ["gptq-v2", "gptq"])
def test_gptq_target_keeps_rotation(rot, tmp_path, prompt, target):
    out = tmp_path / "g"
    helpers.run_cli(f"gptq->{target}", rot["ckpt"], out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert rep["summary"]["verdicts"]["exact"] == rep["summary"]["tensors"] and rep["summary"]["max_abs_err"] == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["rotation"] == "hadamard" and qc["checkpoint_format"] == target.replace("-", "_")
    a, b = load_file(str(rot["ckpt"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name in a:
        if name.endswith("down_proj.qweight") or name.endswith("down_proj.scales"):
            assert torch.equal(a[name], b[name]), name  # the rotated grid itself
    got = fixtures_qqq.gptq_logits(out, prompt)
    assert np.array_equal(got, rot["logits"])


def test_unknown_rotation_refused(rot, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(rot["ckpt"], bad)
    for fname in ("config.json", "quantize_config.json"):
        cfg = json.loads((bad / fname).read_text())
        qc = cfg.get("quantization_config", cfg)
        qc["rotation"] = "givens"
        (bad / fname).write_text(json.dumps(cfg))
    proc = helpers.run_cli("gptq->gguf", bad, tmp_path / "o.gguf", "--allow-requant", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "unknown rotation 'givens'" in err and "config.json" in err
    assert not (tmp_path / "o.gguf").exists()


def test_tabulated_hadamard_size_refused_without_gptqmodel(tmp_path):
    """A rotated checkpoint whose intermediate size needs one of gptqmodel's tabulated K matrices, read
    where gptqmodel cannot be imported (a stub package that raises ImportError shadows it)."""
    import os
    import subprocess
    import sys
    from qconvert.kernels.bitpack import pack_rows

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    inter = 12 * 32  # = 384 = 12 * 2^5
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": inter,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                   "desc_act": False, "checkpoint_format": "gptq", "rotation": "hadamard"}}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    prefix = "model.layers.0.mlp.down_proj"
    codes = torch.full((inter, 64), 8, dtype=torch.int64)
    tensors = {f"{prefix}.qweight": pack_rows(codes, 4),
               f"{prefix}.qzeros": torch.full((3, 8), 0x77777777, dtype=torch.int64).to(torch.int32),
               f"{prefix}.scales": torch.ones(3, 64, dtype=torch.float16),
               f"{prefix}.g_idx": (torch.arange(inter) // 128).to(torch.int32)}
    save_file(tensors, str(ckpt / "model.safetensors"))
    blocker = tmp_path / "no_gptqmodel" / "gptqmodel"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    proc = subprocess.run([sys.executable, "-m", "qconvert", "gptq->hf", str(ckpt), str(tmp_path / "o"),
                           "--allow-requant"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "install gptqmodel" in err
    assert len(err.splitlines()) == 1 and "384 = 12 * 32" in err and prefix in err, err


def test_rotated_checkpoint_with_tabulated_size_folds_like_gptqmodel_runs_it(tmp_path, prompt):
    """A real gptqmodel-rotated checkpoint whose intermediate size is 384 = 12 * 32 (like llama-2's
    11008 = 172 * 64, a tabulated K): the folded hf model reproduces gptqmodel's own run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path / "base384"
    cfg = LlamaConfig(**{k: v for k, v in json.loads((fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base") /
                                                       "config.json").read_text()).items()
                         if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")})
    cfg.intermediate_size = 384
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(str(base), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base") / f
        if src.exists():
            shutil.copy(src, base / f)
    ckpt = fixtures_qqq.quantize_rotated(base, tmp_path / "rot384", bits=4, group_size=128, rotation="hadamard")
    reference = fixtures_qqq.gptq_logits(ckpt, prompt)
    helpers.run_cli("gptq->hf", ckpt, tmp_path / "hf", "--type", "f32", "--allow-requant")
    got = helpers.transformers_logits(tmp_path / "hf", prompt)
    spread = float(np.ptp(reference))
    assert np.abs(got - reference).max() <= HF_TOLERANCE * spread, (np.abs(got - reference).max(), spread)
