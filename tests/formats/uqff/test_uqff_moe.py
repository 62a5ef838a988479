"""MoE models (Mixtral, Qwen3-MoE) through UQFF, checked against mistral.rs 0.9.5 itself (PyPI wheel, CPU).

The oracle is what mistral.rs writes for the same model (tests/support/fixtures_uqff.py ensure_moe_uqff_fixtures:
tiny float32 MixtralForCausalLM / Qwen3MoeForCausalLM quantized in situ by mistral.rs with q8_0 / q4_0 /
afq4 and written with `write_uqff`). Checks:
- mistral.rs' own layout: one stacked layer per expert projection, `<block>.experts.{gate,up,down}_proj`
  [E, out, in], whose bytes are the per-expert quantizations joined (Mixtral's w1/w3/w2 = gate/up/down);
  Mixtral's router is a UQFF layer, Qwen3-MoE's stays in residual.safetensors;
- `hf->uqff`: the same tensor names and bytes as mistral.rs (q8_0 and afq4 every byte; q4_0 every byte
  but the Q6K embedding and lm_head, which mistral.rs rounds with its own Q6K quantizer), and mistral.rs'
  log-probabilities on our file equal those on its own (q8_0: identical);
- `gptq->uqff` of gptqmodel MoE checkpoints keeps every expert's codes (stacked Q4_0 blocks that decode to the
  GPTQ grid exactly) and mistral.rs runs it;
- `uqff->hf` / `uqff->uqff` read stacked layers back per expert (transformers runs the result; a copy is
  byte-identical);
- the stacking session holds one layer's experts at most; non-stackable types and split stacks are refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import fixtures_uqff as FU
from helpers import run_cli

mistralrs = pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")

KINDS = tuple(FU.MOE_ARCH)  # mixtral, qwen3_moe
# mistral.rs' CPU GGUF matmul quantizes activations to Q8 first: GGUF layers are compared with this tolerance
GGUF_TOL = 0.1
PROJ_OF_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
SENSITIVE = ("lm_head.weight", "model.embed_tokens.weight")  # mistral.rs promotes these (q4_0 -> Q6K, afq4 -> afq6)


@pytest.fixture(scope="session")
def mfx():
    info = FU.ensure_moe_uqff_fixtures()
    assert not info["failed"], f"mistral.rs could not write: {info['failed']}"
    return info


def _convert(src_fmt, src, dst_fmt, out, **kw):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    return convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)


def _raw(path: Path) -> dict:
    """Every tensor of one safetensors file, read with safetensors only (no code of ours)."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _uqff(d: Path) -> Path:
    return next(Path(d).glob("*-0.uqff"))


def _differing(a: dict, b: dict) -> list[str]:
    """Names whose dtype, shape or bytes differ (both dicts must hold the same names)."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:6]
    return sorted(k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or a[k].reshape(-1).view(torch.uint8).numpy().tobytes()
                  != b[k].reshape(-1).view(torch.uint8).numpy().tobytes())


def _block(kind: str) -> str:
    return "block_sparse_moe" if kind == "mixtral" else "mlp"


def _hf_expert_name(kind: str, layer: int, expert: int, proj: str) -> str:
    name = PROJ_OF_MIXTRAL[proj] if kind == "mixtral" else proj
    return f"model.layers.{layer}.{_block(kind)}.experts.{expert}.{name}.weight"


def _transformers_copy(src: Path, dst: Path) -> Path:
    """The model dir as transformers 5 leaves it: config.json without the keys mistral.rs needs and
    transformers no longer writes (rope_theta, Qwen3-MoE's num_experts / max_window_layers), which our
    writer must add itself; weights and tokenizer linked."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "config.json" and not p.name.startswith("."):
            (dst / p.name).symlink_to(p)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("rope_theta", "num_experts", "max_window_layers"):
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# -- what mistral.rs writes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_mistralrs_stacks_experts(mfx, kind):
    """The oracle's layout, independently of our code: stacked [E, out, in] Q8_0 layers whose bytes are
    gguf-py's quantization of each HF expert (Mixtral w1 -> gate_proj, w3 -> up_proj, w2 -> down_proj)."""
    from gguf import GGMLQuantizationType, quants

    d = mfx["uqff"][f"{kind}-q8_0"]
    raw, residual = _raw(_uqff(d)), _raw(d / "residual.safetensors")
    src = _raw(mfx["models"][kind] / "model.safetensors")
    assert not [k for k in list(raw) + list(residual) if ".experts.0." in k]  # nothing per expert
    for layer in range(2):
        for proj, (out, n) in {"gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}.items():
            key = f"model.layers.{layer}.{_block(kind)}.experts.{proj}"
            assert raw[f"{key}.weight.shape"].tolist() == [FU.MOE_EXPERTS, out, n]
            assert int(raw[f"{key}.weight.dtype"]) == int(GGMLQuantizationType.Q8_0)
            joined = np.concatenate([quants.quantize(src[_hf_expert_name(kind, layer, e, proj)].numpy(),
                                                     GGMLQuantizationType.Q8_0).reshape(-1)
                                     for e in range(FU.MOE_EXPERTS)])
            assert np.array_equal(raw[f"{key}.weight"].numpy(), joined), key
        router = f"model.layers.{layer}.{_block(kind)}.gate"
        if kind == "mixtral":  # a mistralrs-quant linear: quantized like the others
            assert raw[f"{router}.weight.shape"].tolist() == [FU.MOE_EXPERTS, 256]
            assert f"{router}.weight" not in residual
        else:  # Qwen3-MoE's router is a candle Linear: dense in the residual
            assert f"{router}.weight.format" not in raw and residual[f"{router}.weight"].shape == (FU.MOE_EXPERTS, 256)


# -- hf -> uqff: what mistral.rs writes, byte for byte --------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_uqff_q8_0_is_mistralrs_own(mfx, tmp_path, kind):
    theirs = mfx["uqff"][f"{kind}-q8_0"]
    src = _transformers_copy(mfx["models"][kind], tmp_path / "src")
    rep = _convert("hf", src, "uqff", tmp_path / "ours", type="q8_0", allow_requant=True)
    ours = tmp_path / "ours"
    assert _uqff(ours).name == "q8_0-0.uqff"
    assert _differing(_raw(_uqff(ours)), _raw(_uqff(theirs))) == []
    assert _differing(_raw(ours / "residual.safetensors"), _raw(theirs / "residual.safetensors")) == []
    experts = [r for r in rep.results if ".experts." in r.plan.name]
    assert len(experts) == 2 * 3 * FU.MOE_EXPERTS and all(r.plan.target == "q8_0" for r in experts)
    cfg = json.loads((ours / "config.json").read_text())
    assert "rope_theta" in cfg and (kind != "qwen3_moe" or (cfg["num_experts"], cfg["max_window_layers"]) == (4, 2))
    got = FU.mistralrs_logprobs(ours, tmp_path / "lp.json", from_uqff="q8_0-0.uqff", arch=FU.MOE_ARCH[kind])
    want = json.loads((theirs / "mistralrs_logprobs.json").read_text())
    assert got["ids"] == want["ids"] and got["steps"] == want["steps"]


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_uqff_q4_0_matches_mistralrs(mfx, tmp_path, kind):
    """q4_0 with mistral.rs' promotion of the embedding and lm_head (to Q6K) spelled out: every expert, router
    and attention layer is mistral.rs' bytes; the two Q6K tensors differ (mistral.rs' Q6K quantizer rounds
    otherwise than ours) but are as close to the float weights as mistral.rs', and mistral.rs runs our file."""
    from gguf import GGMLQuantizationType, quants

    theirs = mfx["uqff"][f"{kind}-q4_0"]
    _convert("hf", mfx["models"][kind], "uqff", tmp_path / "ours", type="q4_0",
             tensor_types=[(r"embed_tokens|lm_head", "q6k")], allow_requant=True)
    ours, raw_theirs = _raw(_uqff(tmp_path / "ours")), _raw(_uqff(theirs))
    assert set(_differing(ours, raw_theirs)) <= set(SENSITIVE)
    src = _raw(mfx["models"][kind] / "model.safetensors")
    for name in SENSITIVE:
        key = name[: -len(".weight")]
        assert int(ours[f"{key}.weight.dtype"]) == int(raw_theirs[f"{key}.weight.dtype"]) == int(GGMLQuantizationType.Q6_K)
        rmse = [float(np.sqrt(np.mean((quants.dequantize(t[name].numpy().reshape(512, -1), GGMLQuantizationType.Q6_K)
                                       - src[name].numpy()) ** 2))) for t in (ours, raw_theirs)]
        assert rmse[0] <= 1.05 * rmse[1], (name, rmse)  # our Q6K rounding is as close to the weights as theirs
    # mistral.rs on ours, against transformers reading ours back (teacher-forced on mistral.rs' tokens)
    got = FU.mistralrs_logprobs(tmp_path / "ours", tmp_path / "lp.json", from_uqff="q4_0-0.uqff", arch=FU.MOE_ARCH[kind])
    _convert("uqff", tmp_path / "ours", "hf", tmp_path / "hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "hf", got, every_weight=True) < GGUF_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_uqff_afq4_is_mistralrs_own(mfx, tmp_path, kind):
    """afq4 (embedding and lm_head as afq6, as mistral.rs promotes them): every byte equal, and mistral.rs loads
    it. (mistral.rs 0.9.5 cannot run AFQ experts on a CPU, its own afq4 MoE files included.)"""
    theirs = mfx["uqff"][f"{kind}-afq4"]
    _convert("hf", mfx["models"][kind], "uqff", tmp_path / "ours", type="afq4",
             tensor_types=[(r"embed_tokens|lm_head", "afq6")], allow_requant=True)
    assert _differing(_raw(_uqff(tmp_path / "ours")), _raw(_uqff(theirs))) == []
    FU.mistralrs_load_only(tmp_path / "ours", tmp_path / "loaded.json", from_uqff="afq4-0.uqff", arch=FU.MOE_ARCH[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_uqff_unquant_stacks_run_exactly(mfx, tmp_path, kind):
    """--type f32 (inline Unquant layers, stacked [E, out, in] float32): mistral.rs runs it and gives the
    unquantized model's log-probabilities."""
    _convert("hf", mfx["models"][kind], "uqff", tmp_path / "ours", type="f32")
    got = FU.mistralrs_logprobs(tmp_path / "ours", tmp_path / "lp.json", from_uqff="f32-0.uqff", arch=FU.MOE_ARCH[kind])
    plain = mfx["plain"][kind]
    assert [s[0][0] for s in got["steps"]] == [s[0][0] for s in plain["steps"]]
    assert max(abs(a[1] - b[1]) for s, t in zip(got["steps"], plain["steps"]) for a, b in zip(s, t)) < 1e-4


# -- gptq -> uqff: the experts' codes kept --------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_gptq_moe_to_uqff_keeps_expert_codes(tmp_path, kind):
    """gptqmodel's 4-bit g32 sym MoE checkpoints (tests/support/fixtures_moe.py): without --type every expert goes to
    Q4_0 with its codes and fp16 scales kept (exact), stacked per projection; the stacked blocks decode
    (gguf-py) to the GPTQ grid exactly; mistral.rs runs the file (Mixtral under its block_sparse_moe names)."""
    import fixtures_moe
    from gguf import GGMLQuantizationType, quants

    from qconvert.formats.gptq.reader import open_gptq

    ckpt = fixtures_moe.ensure_moe_gptq(kind=kind, bits=4, group_size=32, sym=True)
    rep = _convert("gptq", ckpt, "uqff", tmp_path / "ours")
    experts = [r for r in rep.results if ".experts." in r.plan.name]
    assert len(experts) == 2 * 3 * fixtures_moe.NUM_EXPERTS
    assert all(r.plan.target == "q4_0" and r.plan.verdict == "exact" and r.max_abs_err == 0.0 for r in experts)
    raw = _raw(_uqff(tmp_path / "ours"))
    block = _block(kind)  # gptqmodel saves Mixtral under `mlp`; mistral.rs reads `block_sparse_moe`
    records = {r.name: r for r in open_gptq(ckpt).records()}
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{layer}.{block}.experts.{proj}"
            e_, out, n = raw[f"{key}.weight.shape"].tolist()
            stacked = quants.dequantize(raw[f"{key}.weight"].numpy().reshape(e_ * out, -1), GGMLQuantizationType.Q4_0)
            for e in range(e_):
                want = records[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].load().dequantize(torch.float32)
                assert np.array_equal(stacked.reshape(e_, out, n)[e], want.numpy()), (key, e)
    residual = _raw(tmp_path / "ours" / "residual.safetensors")
    assert f"model.layers.0.{block}.gate.weight" in residual  # the router stays dense (fp16, as gptqmodel saved it)
    jinja = FU.chat_template_file(tmp_path / "chat.jinja")
    got = FU.mistralrs_logprobs(tmp_path / "ours", tmp_path / "lp.json", from_uqff="q4_0-0.uqff", jinja=jinja,
                                arch=FU.MOE_ARCH[kind])
    _convert("uqff", tmp_path / "ours", "hf", tmp_path / "hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "hf", got, every_weight=True) < GGUF_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_moe_to_uqff_copies_expert_blocks(mfx, tmp_path, kind):
    """A Q8_0 MoE GGUF (our hf->gguf: experts stacked in ffn_*_exps, which the GGUF reader splits back per expert)
    to UQFF: the blocks are copied into mistral.rs' stacked layers byte for byte. The one difference from
    mistral.rs' own file is Mixtral's router, which GGUF keeps in F32 (llama.cpp's rule) and which therefore
    stays dense in the residual; mistral.rs runs the result."""
    theirs = mfx["uqff"][f"{kind}-q8_0"]
    _convert("hf", mfx["models"][kind], "gguf", tmp_path / "m.gguf", type="q8_0", allow_requant=True)
    rep = _convert("gguf", tmp_path / "m.gguf", "uqff", tmp_path / "ours")
    assert all(r.plan.verdict == "exact" for r in rep.results)
    ours, raw_theirs = _raw(_uqff(tmp_path / "ours")), _raw(_uqff(theirs))
    routers = {k for k in raw_theirs if ".block_sparse_moe.gate.weight" in k}
    assert set(raw_theirs) - set(ours) == routers and (kind == "mixtral") == bool(routers)
    assert _differing(ours, {k: v for k, v in raw_theirs.items() if k not in routers}) == []
    residual = _raw(tmp_path / "ours" / "residual.safetensors")
    assert all(residual[f"model.layers.{i}.{_block(kind)}.gate.weight"].dtype == torch.float32 for i in range(2))
    got = FU.mistralrs_logprobs(tmp_path / "ours", tmp_path / "lp.json", from_uqff="q8_0-0.uqff", arch=FU.MOE_ARCH[kind])
    want = json.loads((theirs / "mistralrs_logprobs.json").read_text())
    if kind == "qwen3_moe":
        assert got["steps"] == want["steps"]
    else:  # an F32 router instead of a Q8_0 one: the same greedy path, log-probs within Q8's rounding
        assert [s[0][0] for s in got["steps"]] == [s[0][0] for s in want["steps"]]


# -- reading stacked layers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_uqff_to_hf_of_mistralrs_moe(mfx, tmp_path, kind):
    """mistral.rs' own q8_0 MoE file read back per expert: each expert's record is gguf-py's decoding of its
    slab of the stack, under the name transformers saves; transformers loads every weight of `uqff->hf` and
    gives mistral.rs' log-probabilities on the same values. (mistral.rs runs Q8_0 layers with Q8-quantized
    activations, and in an MoE that noise can flip a near-tie in the top-2 routing, so the values are handed
    to mistral.rs as float32 Unquant layers - `uqff->uqff --type f32`, an exact decode - where it computes
    in float32 like transformers.)"""
    from gguf import GGMLQuantizationType, quants

    from qconvert.formats.uqff.reader import UqffSource

    d = mfx["uqff"][f"{kind}-q8_0"]
    raw = _raw(_uqff(d))
    records = {r.name: r for r in UqffSource(d).records()}
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{layer}.{_block(kind)}.experts.{proj}"
            e_, out, n = raw[f"{key}.weight.shape"].tolist()
            slabs = quants.dequantize(raw[f"{key}.weight"].numpy().reshape(e_ * out, -1),
                                      GGMLQuantizationType.Q8_0).reshape(e_, out, n)
            for e in range(e_):
                got = records[_hf_expert_name(kind, layer, e, proj)].load().dequantize(torch.float32)
                assert np.array_equal(got.numpy(), slabs[e]), (key, e)
    rep = _convert("uqff", d, "hf", tmp_path / "hf", type="f32")
    assert rep.summary()["max_abs_err"] == 0.0
    rep = _convert("uqff", d, "uqff", tmp_path / "f32", type="f32")
    assert rep.summary()["max_abs_err"] == 0.0
    got = FU.mistralrs_logprobs(tmp_path / "f32", tmp_path / "lp.json", from_uqff="f32-0.uqff", arch=FU.MOE_ARCH[kind])
    assert FU.teacher_forced_gap(tmp_path / "hf", got, every_weight=True) < 1e-4


@pytest.mark.parametrize("name", [f"{k}-{t}" for k in KINDS for t in ("q4_0", "afq4")])
def test_uqff_to_uqff_copies_stacks(mfx, tmp_path, name):
    """Read per expert, written stacked again: mistral.rs' file comes back byte for byte."""
    d = mfx["uqff"][name]
    rep = _convert("uqff", d, "uqff", tmp_path / "out")
    assert rep.summary()["max_abs_err"] == 0.0
    assert _differing(_raw(_uqff(tmp_path / "out")), _raw(_uqff(d))) == []
    assert _differing(_raw(tmp_path / "out" / "residual.safetensors"), _raw(d / "residual.safetensors")) == []


# -- streaming and refusals -----------------------------------------------------------------------------------
def test_stacking_holds_one_layer_of_experts(mfx, tmp_path, monkeypatch):
    """The session holds encoded experts only until their stack is complete: never more than one layer's."""
    from qconvert.formats.uqff import moe

    held, worst = {}, [0]
    real_add = moe.ExpertStacks.add

    def add(self, stack, expert, tensors):
        out = real_add(self, stack, expert, tensors)
        worst[0] = max(worst[0], sum(len(v) for v in self.pending.values()))
        held[stack] = out is None
        return out

    monkeypatch.setattr(moe.ExpertStacks, "add", add)
    _convert("hf", mfx["models"]["qwen3_moe"], "uqff", tmp_path / "ours", type="q8_0", allow_requant=True)
    assert held and not any(held.values())  # every stack was written
    assert 0 < worst[0] <= 3 * FU.MOE_EXPERTS


@pytest.mark.parametrize("kind", KINDS)
def test_unstackable_type_is_refused(mfx, tmp_path, kind):
    """mistral.rs refuses stacked HQQ / FP8 / F8Q8 layers at load: refused before writing, naming the stack."""
    out = tmp_path / "out"
    with pytest.raises(Exception, match="mistral.rs loads stacks only as GGUF blocks, AFQ or unquantized"):
        _convert("hf", mfx["models"][kind], "uqff", out, type="hqq4", allow_requant=True)
    assert not out.exists()


def test_split_stack_is_refused(mfx, tmp_path):
    """One expert typed and its siblings left dense cannot make a stacked layer: a one-line user error."""
    src = mfx["models"]["qwen3_moe"]
    proc = run_cli("hf->uqff", src, tmp_path / "out", "--tensor-type", r"experts\.0\.=q8_0", "--allow-requant",
                   check_rc=2)
    assert "would stay dense" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def _drop_router(t: dict) -> None:
    del t["model.layers.1.mlp.gate.weight"]


def _three_experts(t: dict) -> None:
    t["model.layers.0.mlp.experts.up_proj.weight.shape"] = torch.tensor([3, 512, 256], dtype=torch.uint32)


def _wide_router(t: dict) -> None:
    t["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 512)


@pytest.mark.parametrize("file,edit,needles", [
    ("residual.safetensors", _drop_router, ("model.layers.1.mlp.gate.weight", "neither the UQFF shards nor")),
    ("residual.safetensors", _wide_router, ("model.layers.0.mlp.gate.weight", "num_experts, hidden_size")),
    ("q8_0-0.uqff", _three_experts, ("experts.up_proj.weight", "is not 3 experts' blocks")),
])
def test_bad_moe_uqff_is_refused(mfx, tmp_path, file, edit, needles):
    """A stacked set whose router is missing or mis-shaped, or whose stack does not divide into the experts
    it claims: one-line refusals naming the tensor (not a model with a random router or shifted experts)."""
    from helpers import edit_safetensors, expect_user_error

    src = tmp_path / "src"
    shutil.copytree(mfx["uqff"]["qwen3_moe-q8_0"], src)
    edit_safetensors(src / file, edit)
    expect_user_error("uqff->hf", src, tmp_path, *needles)
