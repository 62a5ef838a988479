"""Our GPTQ reader on MoE checkpoints made by gptqmodel 7.6.0 (tests/support/fixtures_moe.py): every expert's
dequantized weight equals gptqmodel's own, and the router stays a dense fp16 tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import fixtures_moe
from qconvert.formats.gptq.reader import GptqSource

KINDS = ("qwen3_moe", "mixtral")
# the fp16 base names of the router: transformers 5.24 saves Mixtral under its legacy names
BASE_ROUTER = {"qwen3_moe": "model.layers.{L}.mlp.gate.weight", "mixtral": "model.layers.{L}.block_sparse_moe.gate.weight"}
ATTENTION = [f"model.layers.{L}.self_attn.{p}" for L in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory):
    kind = request.param
    ckpt = fixtures_moe.ensure_moe_gptq(kind=kind, bits=4, group_size=32, sym=True)
    # gptqmodel's dequantization in a child process (in this one it would patch transformers for later tests)
    reference = fixtures_moe.moe_gptq_reference_in_child(ckpt, tmp_path_factory.mktemp(kind) / "reference.pt")
    return {"kind": kind, "ckpt": ckpt, "reference": reference}


def _shape(weight_name: str) -> tuple[int, int]:
    """[out, in] of the tiny models' linears: hidden 128, 2 KV heads of 32, expert FFN 128."""
    kv = weight_name.endswith(("k_proj.weight", "v_proj.weight"))
    return (64 if kv else 128, 128)


def _reader_grids(ckpt):
    return {rec.name: rec for rec in GptqSource(ckpt).records() if rec.is_grid}


def test_every_expert_is_quantized_by_gptq(moe):
    coverage = json.loads((moe["ckpt"].parent / "coverage.json").read_text())
    experts = fixtures_moe.expert_module_names()
    assert len(experts) == 2 * fixtures_moe.NUM_EXPERTS * 3
    assert sorted(coverage) == sorted(experts + ATTENTION)
    for name in experts:
        # ExpertsRoutingBypass: the whole calibration set (32 x 64 tokens) reaches every expert, no RTN fallback
        assert coverage[name]["samples"] == "2048" and not coverage[name]["fallback"], name
    qc = json.loads((moe["ckpt"] / "config.json").read_text())["quantization_config"]
    assert qc["meta"]["moe"]["routing"]["class"] == "ExpertsRoutingBypass"


def test_expert_dequantization_equals_gptqmodel(moe):
    ref, grids = moe["reference"], _reader_grids(moe["ckpt"])
    expected = {f"{m}.weight" for m in fixtures_moe.expert_module_names() + ATTENTION}
    assert set(grids) == set(ref) == expected
    for name, theirs in ref.items():
        ours = grids[name].load().dequantize(torch.float32)
        assert ours.shape == theirs.shape == _shape(name), name
        # gptqmodel's TorchLinear multiplies in fp16 (scales[g_idx] * (q - z)); ours in fp32 is the exact
        # product, so ours rounded to fp16 is gptqmodel's value bit for bit
        assert torch.equal(ours.to(torch.float16).to(torch.float32), theirs), name
        # and unrounded it is within half an fp16 ulp of it (the rounding gptqmodel does)
        half_ulp = torch.finfo(torch.float16).eps / 2 * theirs.abs().clamp_min(2.0 ** -14)
        assert bool(((ours - theirs).abs() <= half_ulp).all()), name


def test_router_is_dense_fp16_and_unchanged(moe):
    source = GptqSource(moe["ckpt"])
    dense = {rec.name: rec for rec in source.records() if not rec.is_grid}
    base = moe["ckpt"].parent.parent / f"base_{moe['kind']}" / "model.safetensors"
    with safe_open(str(base), "pt") as f:
        for layer in range(2):
            name = f"model.layers.{layer}.mlp.gate.weight"  # gptqmodel saves both kinds under mlp.gate
            rec = dense[name]
            assert rec.dtype == "float16" and rec.shape == (fixtures_moe.NUM_EXPERTS, 128)
            stored = rec.load().tensor
            assert stored.dtype == torch.float16
            assert torch.equal(stored, f.get_tensor(BASE_ROUTER[moe["kind"]].format(L=layer)))
