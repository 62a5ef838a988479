"""AWQ (GEMM layout): reader bit-exact against gptqmodel's own AWQ loader, conversions judged by their consumers.

Fixtures (tests/producer_fixtures/awq/, remade by scripts/producers/awq.py): a tiny llama quantized by gptqmodel
7.6's AWQ on CPU (4-bit, zero_point true, group 32 and 128), with gptqmodel's own dequantized weights and logits
(reference.safetensors). gptqmodel itself runs only in child processes: loading a model through it patches
transformers in the process that does.
- reading: our dequantization == the stored oracle bit for bit (fp16), and == gptqmodel's loader run live;
- awq->gptq-v2: exact, and gptqmodel loads the output to the same weights bit for bit;
- awq->gguf Q4_1: near-exact (codes and fp16 scales kept; the block min -s*z and the source's fp16 product
  round once), checked with gguf-py's decode and llama.cpp's logits against gptqmodel's;
- awq->gguf Q4_0 on asymmetric AWQ: refused without --allow-requant, requantized with it;
- awq->uqff (mistral.rs AFQ): near-exact, mistral.rs' log-probabilities match transformers on our dequantization;
- bad inputs: one line, exit 2, naming file and tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import helpers
from qconvert.converters.registry import detect_format, get_format
from qconvert.formats.gguf.names import gguf_arch, qk_row_permutation
from qconvert.formats.awq.layout import AWQ_ORDER, pack_gemm, unpack_gemm

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "producer_fixtures" / "awq"
PRODUCER = REPO / "scripts" / "producers" / "awq.py"
VARIANTS = ("gemm_g32", "gemm_g128")
N_GRIDS = 7  # q, k, v, o, gate, up, down of the one decoder layer
CHILD_TIMEOUT = 600
# logits span ~8. gptqmodel's AWQ model runs fp16 activations; transformers in float32 on the same weights
# differs from it by 0.0028 (measured, both variants), llama.cpp on an F32 GGUF of them by 0.0008 from
# transformers. llama.cpp's CPU Q4_1 matmul quantizes the activations to Q8_1 first: 0.033 (g32) / 0.029 (g128)
# from gptqmodel, of which the Q4_1 weights' own rounding (<= 1.8e-4 a weight) is a small part
LLAMA_F32_LOGIT_TOL = 0.01
LLAMA_Q4_1_LOGIT_TOL = 0.06
# the GPTQ torch kernel and the AWQ torch kernel multiply the same fp16 weights in different op orders
GPTQ_LOGIT_TOL = 0.02


def _prompt(variant: str) -> list[int]:
    return json.loads((FIXTURES / variant / "versions.json").read_text())["prompt_ids"]


def _reference(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / variant / "reference.safetensors"))


def _our_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    src = get_format("awq").open_reader(ckpt)
    return {r.name: r.load().dequantize(torch.float16) for r in src.records() if r.is_grid}


def _clean_copy(variant: str, dest: Path) -> Path:
    """The checkpoint as gptqmodel saved it, without the oracle beside it."""
    shutil.copytree(FIXTURES / variant, dest, ignore=shutil.ignore_patterns("reference.safetensors", "versions.json"))
    return dest


def _child(args: list[str]) -> None:
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"child {args[:2]} failed (exit {proc.returncode}):\n{(proc.stderr + proc.stdout)[-3000:]}")


def _gptqmodel_awq_reference(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """gptqmodel's AWQ loader, run now, in a child process (scripts/producers/awq.py --reference)."""
    _child([str(PRODUCER), "--reference", str(ckpt), str(out)])
    return load_file(str(out))


_GPTQ_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fx", sys.argv[1]); fx = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fx)
fx.gptq_reference(sys.argv[2], sys.argv[3], [int(t) for t in sys.argv[4].split(",")])
"""


def _gptqmodel_gptq_reference(ckpt: Path, out: Path, prompt: list[int]) -> dict[str, torch.Tensor]:
    """gptqmodel's GPTQ loader (tests/fixtures.py gptq_reference: GPTQ_TORCH kernel, fp16), in a child process."""
    _child(["-c", _GPTQ_CHILD, str(REPO / "tests" / "fixtures.py"), str(ckpt), str(out), ",".join(map(str, prompt))])
    return load_file(str(out))


def _report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# -- layout --------------------------------------------------------------------------------------------

def test_gemm_nibble_order():
    """Nibble i of a word holds column AWQ_ORDER[i] (AutoAWQ / gptqmodel pack_awq); unpack inverts pack."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)[:, :16]  # columns 0..15 hold their own index
    words = pack_gemm(codes)
    first = int(words[0, 0]) & 0xFFFFFFFF
    assert [(first >> (4 * i)) & 15 for i in range(8)] == list(AWQ_ORDER)
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_gemm(pack_gemm(rand)), rand)


# -- reading -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_reader_equals_stored_oracle(variant):
    ref = _reference(variant)
    ours = _our_weights(FIXTURES / variant)
    assert len(ours) == N_GRIDS and set(ours) == {k for k in ref if k != "__logits__"}
    for name, w in ours.items():
        assert w.dtype == torch.float16 and torch.equal(w, ref[name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_reader_equals_gptqmodel_live(variant, tmp_path):
    ckpt = _clean_copy(variant, tmp_path / "awq")
    live = _gptqmodel_awq_reference(ckpt, tmp_path / "live.safetensors")
    stored = _reference(variant)
    assert set(live) == set(stored)
    for name, w in _our_weights(ckpt).items():
        assert torch.equal(w, live[name]), name
    # the producer's loader today gives the stored oracle, logits included
    assert torch.equal(live["__logits__"], stored["__logits__"])


def test_grid_params_and_float16_product():
    """Integer zero points, fp16 scales, [out, in]; the product rounds in fp16 as gptqmodel's does: a float32
    product differs from the oracle (measured: 41302 of 147456 weights in g32), the fp16 one does not."""
    src = get_format("awq").open_reader(FIXTURES / "gemm_g32")
    ref = _reference("gemm_g32")
    rec = next(r for r in src.records() if r.name == "model.layers.0.mlp.down_proj.weight")
    p = rec.params
    assert rec.shape == (128, 256) and p.group_size == 32 and p.n_groups == 8
    assert p.scales.dtype == torch.float16 and p.compute_dtype == torch.float16 and p.integer_zeros
    assert not p.symmetric  # zero_point true: the data's zero points vary
    grid = rec.load()
    exact = (grid.codes.float() - p.zeros.float().repeat_interleave(32, 1)) * p.scales.float().repeat_interleave(32, 1)
    assert not torch.equal(exact, ref[rec.name].float())
    assert torch.equal(exact.half(), ref[rec.name])


def test_sniff_and_inspect():
    for variant in VARIANTS:
        assert detect_format(FIXTURES / variant) == "awq"
    assert get_format("autoawq").name == "awq"
    out = helpers.run_cli("inspect", FIXTURES / "gemm_g128").stdout
    assert "format: awq" in out and "group_size: 128" in out and "4-bit g128 asym" in out


# -- awq -> gptq-v2 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_awq_to_gptq_v2_exact_and_gptqmodel_loads_it(variant, tmp_path):
    out = tmp_path / "gptq"
    helpers.run_cli("awq->gptq-v2", _clean_copy(variant, tmp_path / "awq"), out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in rep["tensors"]), rep["summary"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # (g128: the 128-wide rows are single groups, which the GPTQ writer stores as per-channel, group -1)
    assert qc["format"] == "gptq_v2" and qc["sym"] is False
    ref = _reference(variant)
    loaded = _gptqmodel_gptq_reference(out, tmp_path / "gptq_ref.safetensors", _prompt(variant))
    for name in ref:
        if name != "__logits__":
            assert torch.equal(loaded[name], ref[name]), name
    gap = (loaded["__logits__"] - ref["__logits__"]).abs().max().item()
    assert gap < GPTQ_LOGIT_TOL, gap


# -- awq -> gguf ---------------------------------------------------------------------------------------

def _q4_1_formula(grid) -> torch.Tensor:
    """Q4_1 of a grid as the GGUF writer is meant to store it, decoded as ggml does (float32 d*q + m): d = s
    (fp16, exact), m = fp16(-s*z), the codes kept."""
    p = grid.params
    d = p.scales.float().repeat_interleave(p.group_size, 1)
    m = (-(p.scales.float() * p.zeros.float())).half().float().repeat_interleave(p.group_size, 1)
    return d * grid.codes.float() + m, m


@pytest.mark.parametrize("variant", VARIANTS)
def test_awq_to_gguf_q4_1_near_exact(variant, tmp_path):
    out = tmp_path / "m.gguf"
    helpers.run_cli("awq->gguf", FIXTURES / variant, out, "--type", "Q4_1", "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    grids = [t for t in rep["tensors"] if t["source"].startswith("4-bit")]
    assert len(grids) == N_GRIDS and {t["verdict"] for t in grids} == {"near-exact"}
    assert {t["target"] for t in grids} == {"Q4_1"}
    tensors = helpers.gguf_tensors(out)
    ref = _reference(variant)
    source = get_format("awq").open_reader(FIXTURES / variant)
    src = {r.name: r for r in source.records()}
    arch = gguf_arch(source.config)
    for t in grids:
        decoded = torch.from_numpy(np.ascontiguousarray(helpers.gguf_dequant(tensors[t["out_name"]]))).reshape(t["shape"])
        perm = qk_row_permutation(t["name"], source.config, arch)  # llama.cpp's rope order of q/k rows
        if perm is not None:
            decoded = decoded[torch.argsort(perm)]
        expected, m = _q4_1_formula(src[t["name"]].load())
        assert torch.equal(decoded, expected), t["name"]  # the codes and scales are the source's
        # against gptqmodel's fp16 weights: its product rounds once to fp16, the block min once, float32 once
        r = ref[t["name"]].float()
        bound = 2.0**-11 * (r.abs() + m.abs()) + 2.0**-23 * (decoded.abs() + m.abs()) + 2.0**-24
        assert bool(((decoded - r).abs() <= bound).all()), t["name"]
        assert abs(t["max_abs_err"] - (decoded - r).abs().max().item()) < 1e-9
    logits = helpers.llama_logits(out, _prompt(variant))
    gap = float(np.abs(logits - ref["__logits__"][0].numpy()).max())
    assert gap < LLAMA_Q4_1_LOGIT_TOL, gap


@pytest.mark.parametrize("variant", VARIANTS)
def test_awq_to_gguf_f32_runs_like_gptqmodel(variant, tmp_path):
    """Our dequantization, stored exactly (F32) and run by llama.cpp without activation quantization, gives
    gptqmodel's AWQ logits to within its fp16 activations' noise."""
    out = tmp_path / "m.gguf"
    helpers.run_cli("awq->gguf", FIXTURES / variant, out, "--type", "f32", "--report", tmp_path / "r.json")
    assert {t["verdict"] for t in _report(tmp_path / "r.json")["tensors"]} == {"exact"}
    logits = helpers.llama_logits(out, _prompt(variant))
    gap = float(np.abs(logits - _reference(variant)["__logits__"][0].numpy()).max())
    assert gap < LLAMA_F32_LOGIT_TOL, gap


def test_awq_to_gguf_q4_0_asymmetric(tmp_path):
    """Q4_0 has no zero point: asymmetric AWQ cannot keep its codes there. Refused without --allow-requant
    (the error proposes an aligned type), requantized with Q4_0's own quantizer with it."""
    out = tmp_path / "q40.gguf"
    proc = helpers.run_cli("awq->gguf", FIXTURES / "gemm_g32", out, "--type", "Q4_0", check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and not out.exists(), err
    # measured: the checker refuses 7 tensors and proposes f32 (exact: fp16 weights widen losslessly); Q4_1,
    # near-exact, is what the default --type picks (test_awq_to_gguf_default_type_is_q4_1)
    for needle in ("refused: 7 tensor(s)", "requantization to Q4_0", "aligned choice: --type f32 (exact)",
                   "--allow-requant"):
        assert needle in err, (needle, err)
    helpers.run_cli("awq->gguf", FIXTURES / "gemm_g32", out, "--type", "Q4_0", "--allow-requant",
                    "--report", tmp_path / "r.json")
    grids = [t for t in _report(tmp_path / "r.json")["tensors"] if t["source"].startswith("4-bit")]
    assert {t["verdict"] for t in grids} == {"requantize"} and {t["target"] for t in grids} == {"Q4_0"}
    ref = _reference("gemm_g32")
    logits = helpers.llama_logits(out, _prompt("gemm_g32"))
    assert float(np.abs(logits - ref["__logits__"][0].numpy()).max()) < 1.0  # lossy, but the same model


def test_awq_to_gguf_default_type_is_q4_1(tmp_path):
    helpers.run_cli("awq->gguf", FIXTURES / "gemm_g128", tmp_path / "m.gguf", "--report", tmp_path / "r.json")
    grids = [t for t in _report(tmp_path / "r.json")["tensors"] if t["source"].startswith("4-bit")]
    assert {(t["target"], t["verdict"]) for t in grids} == {("Q4_1", "near-exact")}


# -- awq -> uqff (mistral.rs) -----------------------------------------------------------------------------

# mistral.rs' AFQ stores bias = -scale*zero in float32 and computes scale*q + bias in float32, where gptqmodel
# rounds (q - z)*s to fp16 (weights differ by <= 1.2e-4): measured teacher-forced log-prob gap 4.6e-4 against
# transformers in float32 on our fp16 weights (exact UQFF families reach 1e-4 in tests/test_uqff.py)
UQFF_LOGPROB_TOL = 2e-3


def test_awq_to_uqff_afq_loads_in_mistralrs(tmp_path):
    pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")
    import fixtures_uqff as FU

    out = tmp_path / "uqff"
    helpers.run_cli("awq->uqff", FIXTURES / "gemm_g32", out, "--report", tmp_path / "r.json")
    grids = [t for t in _report(tmp_path / "r.json")["tensors"] if t["source"].startswith("4-bit")]
    assert {(t["target"], t["verdict"]) for t in grids} == {("afq4", "near-exact")}
    assert max(t["max_abs_err"] for t in grids) < 2.0**-12  # float32 product vs gptqmodel's fp16 rounding
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=next(out.glob("*-0.uqff")).name,
                                    jinja=FU.chat_template_file(tmp_path / "chat.jinja"))
    helpers.run_cli("awq->hf", FIXTURES / "gemm_g32", tmp_path / "hf", "--type", "f32")
    gap = FU.teacher_forced_gap(tmp_path / "hf", mistral)
    assert gap < UQFF_LOGPROB_TOL, gap


# -- bad inputs ----------------------------------------------------------------------------------------

def _edited(tmp_path: Path, *, tensors=None, quant=None) -> Path:
    ckpt = _clean_copy("gemm_g32", tmp_path / "bad")
    if tensors is not None:
        helpers.edit_safetensors(ckpt / "model.safetensors", tensors)
    if quant is not None:
        cfg = json.loads((ckpt / "config.json").read_text())
        quant(cfg["quantization_config"])
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
BAD_TENSORS = {
    "missing scales": (lambda t: t.pop(f"{Q}.scales"), ("qweight without scales", f"{Q}.scales")),
    "missing qzeros": (lambda t: t.pop(f"{Q}.qzeros"), ("qweight without qzeros", f"{Q}.qzeros")),
    "scales one group short": (lambda t: t.__setitem__(f"{Q}.scales", t[f"{Q}.scales"][:-1].clone()),
                               ("scales shape (3, 128)", "expected (4, 128)", f"{Q}.scales")),
    "qzeros one group short": (lambda t: t.__setitem__(f"{Q}.qzeros", t[f"{Q}.qzeros"][:-1].clone()),
                               ("qzeros shape (3, 16)", f"{Q}.qzeros")),
    "qweight narrower than config": (lambda t: t.__setitem__(f"{Q}.qweight", t[f"{Q}.qweight"][:, :8].clone()),
                                     ("implies out_features 64", "config.json", f"{Q}.qweight")),
    "qweight not int32": (lambda t: t.__setitem__(f"{Q}.qweight", t[f"{Q}.qweight"].to(torch.int64)),
                          ("qweight dtype I64 is not int32", f"{Q}.qweight")),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_bad_tensors_refused(case, tmp_path):
    edit, needles = BAD_TENSORS[case]
    ckpt = _edited(tmp_path, tensors=edit)
    helpers.expect_user_error("awq->gptq-v2", ckpt, tmp_path, "model.safetensors", *needles)


BAD_CONFIGS = {
    "not awq": (lambda q: q.update(quant_method="gptq"), ("quant_method is 'gptq', not awq", "config.json")),
    "8 bits": (lambda q: q.update(bits=8), ("quantization_config.bits is 8", "only 4-bit AWQ is read")),
    "autoawq w_bit 3": (lambda q: (q.pop("bits"), q.update(w_bit=3)), ("quantization_config.w_bit is 3",)),
    "gemv": (lambda q: q.update(version="gemv", format="gemv", checkpoint_format="gemv"),
             ("'gemv'", "only the GEMM layout")),
    "unknown version": (lambda q: q.update(version="fancy", format="fancy", checkpoint_format="fancy"),
                        ("'fancy' is not an AWQ layout",)),
    "version and format disagree": (lambda q: q.update(version="gemv"), ("disagree",)),
    # the first quantized module in file order is mlp.down_proj (256 inputs)
    "group not dividing in_features": (lambda q: q.update(group_size=48),
                                       ("in_features 256 is not a multiple of group_size 48", f"{DOWN}.qweight")),
    "group other than stored": (lambda q: q.update(group_size=64), ("scales shape (8, 128)", "expected (4, 128)",
                                                                     f"{DOWN}.scales")),
    "group 0": (lambda q: q.update(group_size=0), ("group_size is 0",)),
    "not converted but quantized": (lambda q: q.update(modules_to_not_convert=["q_proj"]),
                                    ("modules_to_not_convert lists 'q_proj'", f"{Q}.qweight")),
    "not converted, by prefix": (lambda q: q.update(modules_to_not_convert=["model.layers.0"]),
                                 ("modules_to_not_convert lists 'model.layers.0'", f"{DOWN}.qweight")),
    "not converted, bad regex": (lambda q: q.update(modules_to_not_convert=["visual("]),
                                 ("modules_to_not_convert entry 'visual('", "not a valid regular expression")),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configs_refused(case, tmp_path):
    edit, needles = BAD_CONFIGS[case]
    ckpt = _edited(tmp_path, quant=edit)
    helpers.expect_user_error("awq->gguf", ckpt, tmp_path, "bad", *needles, out_name="o.gguf")


def test_modules_to_not_convert_that_match_nothing_quantized(tmp_path):
    """AutoAWQ lists modules it kept in float (a vision tower); transformers matches them as regexes from the
    start or as suffixes, so "self_attn" names no module here and "lm_head" only a dense one."""
    ckpt = _edited(tmp_path, quant=lambda q: q.update(modules_to_not_convert=["visual", "self_attn", "lm_head"]))
    assert len(_our_weights(ckpt)) == N_GRIDS


def test_autoawq_spellings_read(tmp_path):
    """AutoAWQ's own keys (w_bit, q_group_size, version "GEMM") read like gptqmodel's."""
    def autoawq(q):
        for k in ("bits", "group_size", "format", "checkpoint_format"):
            q.pop(k)
        q.update(w_bit=4, q_group_size=32, version="GEMM")
    ckpt = _edited(tmp_path, quant=autoawq)
    ref = _reference("gemm_g32")
    for name, w in _our_weights(ckpt).items():
        assert torch.equal(w, ref[name]), name
