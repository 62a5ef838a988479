"""auto-round's native format read against auto-round itself.

Fixtures (tests/producer_fixtures/auto_round/, remade by scripts/producers/auto_round.py): checkpoints auto-round
0.16 wrote on CPU from a one-layer tiny llama, with the dequantized weights its own loader multiplies by
(reference.safetensors) and that loader's logits (logits.safetensors):
- sym4_g32: packing auto_round:auto_gptq (zero - 1 stored), 4-bit sym g32
- asym4_g128: packing auto_round:auto_awq (AWQ layout), 4-bit asym g128
- mixed_asym: packing auto_round (raw zeros), 3-bit asym g32 with extra_config: down_proj 8-bit g128, q_proj
  2-bit g64, k_proj 4-bit sym, o_proj kept in 16 bit
Made live by the same script (too big to commit): sym_wide (auto_gptq at 2/3/5/6/7/8 bits), asym_wide (raw zeros at
5/6/7 bits), gptqmodel_asym (packing auto_round:gptqmodel, with g_idx). auto-round and gptqmodel loaders run in child
processes (they patch transformers).
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

from helpers import edit_safetensors, expect_user_error, gguf_dequant, gguf_tensors, llama_logits, run_cli

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "producer_fixtures" / "auto_round"
PRODUCER = REPO / "scripts" / "producers" / "auto_round.py"
VARIANTS = ("sym4_g32", "asym4_g128", "mixed_asym")
CHILD_TIMEOUT = 600
LAYER = "model.layers.0"
# llama.cpp vs auto-round's loaded model, as a share of the logit range: llama.cpp's CPU dot products quantize the
# activations to Q8_0 and run float32, auto-round's model runs fp16. Measured: Q4_0 0.0675 / 8.64 (0.78%; the same
# weights dequantized into a float32 transformers model differ from llama.cpp by 0.064), Q4_1 0.0679 / 8.62
LLAMA_LOGIT_TOL = 0.03


def _child(args: list[str]) -> str:
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env,
                          cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"child {args[:3]} failed (exit {proc.returncode}):\n{(proc.stderr + proc.stdout)[-3000:]}")
    return proc.stdout


def contract_sample(dense_source: Path, tmp_path: Path) -> Path:
    """auto-round's own checkpoint of a dense llama (4-bit sym g32, packing auto_round:auto_gptq), for
    tests/e2e/test_format_contract.py's READ_ONLY_SAMPLES (auto-round reads only)."""
    out = Path(tmp_path) / "auto-round-sample"
    _child([str(PRODUCER), str(out), "sample", str(dense_source)])
    return out


def _source(path: Path):
    from qconvert.converters.registry import get_format

    return get_format("auto-round").open_reader(path)


def _our_grids(path: Path) -> dict:
    return {r.name: r for r in _source(path).records() if r.is_grid}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _assert_equal_to(reference: dict, path: Path) -> int:
    """Our dequantization of every grid, rounded to fp16 as auto-round's loader computes it, against `reference`
    bit for bit (signed zeros included); returns the number of tensors compared."""
    grids = _our_grids(path)
    assert sorted(grids) == sorted(reference), (sorted(grids), sorted(reference))
    for name, rec in grids.items():
        ours = rec.load().dequantize(torch.float32).to(torch.float16)
        assert _same_bits(ours, reference[name]), (name, float((ours.float() - reference[name].float()).abs().max()))
    return len(grids)


# -- the reader against auto-round's loader -------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantization_equals_stored_oracle(variant):
    ref = load_file(str(FIXTURES / variant / "reference.safetensors"))
    assert _assert_equal_to(ref, FIXTURES / variant) == (6 if variant == "mixed_asym" else 7)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantization_equals_live_loader(variant, tmp_path):
    """auto-round's loader (transformers + auto-round's backends, CPU) run now, in a child process: the producer's
    own dump step over a copy of the fixture."""
    shutil.copytree(FIXTURES / variant, tmp_path / variant, ignore=shutil.ignore_patterns("reference*", "logits*"))
    _child([str(PRODUCER), str(tmp_path), "dump", variant])
    live = load_file(str(tmp_path / variant / "reference.safetensors"))
    assert _assert_equal_to(live, FIXTURES / variant) > 0
    stored = load_file(str(FIXTURES / variant / "logits.safetensors"))["logits"]
    live_logits = load_file(str(tmp_path / variant / "logits.safetensors"))["logits"]
    # the weights are equal bit for bit (above); the runtime's fp16 CPU matmul depends on the CPU's kernels: the
    # same bits on the machine that made the fixture, up to 2e-3 apart on an AMD EPYC with AVX-512 BF16
    assert torch.allclose(live_logits.float(), stored.float(), atol=0.02), (live_logits.float() - stored.float()).abs().max()
    loader = json.loads((tmp_path / variant / "loader.json").read_text())["quant_linear"]
    assert loader == json.loads((FIXTURES / variant / "loader.json").read_text())["quant_linear"]


def test_packings_and_zero_conventions_as_measured():
    """sym auto_gptq fields hold z - 1 (7 for 4-bit: the loader's zero is 8); raw packings hold z."""
    from safetensors import safe_open

    src = _source(FIXTURES / "sym4_g32")
    assert (src.packing_format, src.zero_convention) == ("auto_round:auto_gptq", "zp-1")
    with safe_open(str(FIXTURES / "sym4_g32" / "model.safetensors"), "pt") as f:
        words = f.get_tensor(f"{LAYER}.mlp.up_proj.qzeros")
    assert bool((words == 0x77777777).all())  # eight 4-bit fields of 7
    for rec in _our_grids(FIXTURES / "sym4_g32").values():
        assert rec.params.symmetric and bool((rec.params.zeros == 8).all())
    assert (_source(FIXTURES / "asym4_g128").packing_format, _source(FIXTURES / "mixed_asym").packing_format) == (
        "auto_round:auto_awq", "auto_round")


def test_extra_config_overrides_per_layer():
    src = _source(FIXTURES / "mixed_asym")
    grids = {r.name: r for r in src.records()}
    want = {"mlp.down_proj": (8, 128), "self_attn.q_proj": (2, 64), "self_attn.k_proj": (4, 32),
            "mlp.gate_proj": (3, 32), "mlp.up_proj": (3, 32), "self_attn.v_proj": (3, 32)}
    for short, (bits, group) in want.items():
        p = grids[f"{LAYER}.{short}.weight"].params
        assert (p.bits, p.group_size) == (bits, group), short
    assert grids[f"{LAYER}.self_attn.k_proj.weight"].params.symmetric
    assert not grids[f"{LAYER}.mlp.gate_proj.weight"].params.symmetric
    o_proj = grids[f"{LAYER}.self_attn.o_proj.weight"]
    assert not o_proj.is_grid and o_proj.dtype == "float32"  # bits 16: kept in float by auto-round


@pytest.mark.parametrize("variant", VARIANTS)
def test_inspect_names_the_format(variant):
    proc = run_cli("inspect", FIXTURES / variant)
    assert "auto-round" in proc.stdout
    assert src_packing(variant) in proc.stdout


def src_packing(variant: str) -> str:
    return json.loads((FIXTURES / variant / "config.json").read_text())["quantization_config"]["packing_format"]


# -- the other widths and the gptqmodel packing, made now by auto-round (too big to commit) ---------------------

LIVE_VARIANTS = ("sym_wide", "asym_wide", "gptqmodel_asym")


@pytest.fixture(scope="module")
def live_made(tmp_path_factory) -> Path:
    """scripts/producers/auto_round.py make: auto-round quantizes and saves, then its loader dumps the weights."""
    out = tmp_path_factory.mktemp("auto_round_live")
    _child([str(PRODUCER), str(out), "make", ",".join(LIVE_VARIANTS)])
    return out


@pytest.mark.parametrize("variant", LIVE_VARIANTS)
def test_other_widths_equal_the_live_loader(variant, live_made):
    ref = load_file(str(live_made / variant / "reference.safetensors"))
    assert _assert_equal_to(ref, live_made / variant) == 7


def test_other_widths_are_read_at_their_own_bits(live_made):
    want = {"sym_wide": {"self_attn.q_proj": 5, "self_attn.k_proj": 6, "self_attn.v_proj": 7, "mlp.gate_proj": 2,
                         "mlp.up_proj": 3, "mlp.down_proj": 8, "self_attn.o_proj": 4},
            "asym_wide": {"self_attn.q_proj": 5, "self_attn.k_proj": 6, "self_attn.v_proj": 7, "mlp.up_proj": 5}}
    for variant, layers in want.items():
        src = _source(live_made / variant)
        grids = _our_grids(live_made / variant)
        for short, bits in layers.items():
            p = grids[f"{LAYER}.{short}.weight"].params
            assert p.bits == bits, (variant, short)
            assert p.symmetric == (variant == "sym_wide"), (variant, short)
        assert src.zero_convention == ("zp-1" if variant == "sym_wide" else "raw")
    src = _source(live_made / "gptqmodel_asym")
    assert (src.packing_format, src.zero_convention) == ("auto_round:gptqmodel", "raw")
    assert all("g_idx" in parts for parts in src.modules.values())


# -- aligned paths --------------------------------------------------------------------------------------

_GPTQMODEL_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fx", sys.argv[1]); fx = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fx)
fx.gptq_reference(sys.argv[2], sys.argv[3], [int(t) for t in sys.argv[4].split(",")])
"""


def _prompt(variant: str) -> list[int]:
    return load_file(str(FIXTURES / variant / "logits.safetensors"))["ids"].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_gptq_v2_is_exact_and_gptqmodel_loads_the_same_weights(variant, tmp_path):
    out = tmp_path / "gptq"
    run_cli("auto-round->gptq-v2", FIXTURES / variant, out, "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    verdicts = {t["name"]: t["verdict"] for t in report["tensors"]}
    assert set(verdicts.values()) == {"exact"}, verdicts
    ref_path = tmp_path / "gptqmodel.safetensors"
    _child(["-c", _GPTQMODEL_CHILD, str(REPO / "tests" / "support" / "fixtures.py"), str(out), str(ref_path),
            ",".join(map(str, _prompt(variant)))])
    loaded = load_file(str(ref_path))
    stored = load_file(str(FIXTURES / variant / "reference.safetensors"))  # auto-round's own weights
    for name, w in stored.items():
        assert _same_bits(loaded[name], w), name  # gptqmodel's weights are auto-round's, bit for bit
    span = float(stored_logits(variant).max() - stored_logits(variant).min())
    assert float((loaded["__logits__"][0] - stored_logits(variant)).abs().max()) < 0.01 * span


def stored_logits(variant: str) -> torch.Tensor:
    return load_file(str(FIXTURES / variant / "logits.safetensors"))["logits"].float()


def _gguf_grids(variant: str, qtype: str, tmp_path: Path) -> tuple[Path, list]:
    """Convert to GGUF `qtype`; [(report entry, our record, gguf-py's decode of the output in HF row order)]
    for every grid."""
    from qconvert.formats.gguf.names import gguf_arch, qk_row_permutation

    out = tmp_path / "m.gguf"
    run_cli("auto-round->gguf", FIXTURES / variant, out, "--type", qtype, "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    source = _source(FIXTURES / variant)
    grids = {r.name: r for r in source.records() if r.is_grid}
    arch = gguf_arch(source.config)
    tensors = gguf_tensors(out)
    rows = []
    for t in report["tensors"]:
        if t["name"] not in grids:
            continue
        assert t["target"] == qtype, t
        decoded = torch.from_numpy(np.ascontiguousarray(gguf_dequant(tensors[t["out_name"]]))).reshape(t["shape"])
        perm = qk_row_permutation(t["name"], source.config, arch)  # llama.cpp's rope order of q/k rows
        if perm is not None:
            decoded = decoded[torch.argsort(perm)]
        rows.append((t, grids[t["name"]], decoded))
    assert len(rows) == len(grids)
    return out, rows


def test_sym_g32_to_q4_0_is_exact_and_llama_cpp_agrees(tmp_path):
    variant = "sym4_g32"
    out, rows = _gguf_grids(variant, "Q4_0", tmp_path)
    for t, rec, decoded in rows:
        assert t["verdict"] == "exact", t
        assert torch.equal(decoded, rec.load().dequantize(torch.float32)), t["name"]  # gguf-py decode == ours
    got = llama_logits(out, _prompt(variant))
    want = stored_logits(variant).numpy()
    assert float(np.abs(got - want).max()) < LLAMA_LOGIT_TOL * float(want.max() - want.min())


def test_asym_g128_to_q4_1_keeps_codes_near_exact(tmp_path):
    variant = "asym4_g128"
    out, rows = _gguf_grids(variant, "Q4_1", tmp_path)
    worst = 0.0
    for t, rec, decoded in rows:
        assert t["verdict"] in ("exact", "near-exact"), t
        p = rec.params
        ours = rec.load().dequantize(torch.float32)
        # Q4_1 keeps the codes and the fp16 scale; only the block min -s*z rounds to fp16 (half an ulp of |s*z|),
        # then d*q + m rounds once in float32
        sz = (p.scales.float() * p.zeros.float()).abs().repeat_interleave(p.group_size, dim=1)
        bound = 2.0 ** -11 * sz + 2.0 ** -23 * (ours.abs() + sz) + 2.0 ** -24
        err = (decoded - ours).abs()
        assert bool((err <= bound).all()), (t["name"], float(err.max()))
        worst = max(worst, float(err.max()))
    assert worst > 0  # measured, not assumed: the min does round
    got = llama_logits(out, _prompt(variant))
    want = stored_logits(variant).numpy()
    assert float(np.abs(got - want).max()) < LLAMA_LOGIT_TOL * float(want.max() - want.min())


# -- bad input ------------------------------------------------------------------------------------------

def _copy(tmp_path: Path, variant: str = "sym4_g32") -> Path:
    dst = tmp_path / "src"
    shutil.copytree(FIXTURES / variant, dst, ignore=shutil.ignore_patterns("reference*", "logits*", "loader.json"))
    return dst


def _edit_qc(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("part", ["scales", "qzeros"])
def test_missing_part_is_refused(tmp_path, part):
    src = _copy(tmp_path)
    edit_safetensors(src / "model.safetensors", lambda t: t.pop(f"{LAYER}.mlp.up_proj.{part}"))
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "model.safetensors", f"{LAYER}.mlp.up_proj.{part}",
                      f"qweight without {part}")


def test_wrong_packed_shape_is_refused(tmp_path):
    src = _copy(tmp_path)
    edit_safetensors(src / "model.safetensors",
                     lambda t: t.update({f"{LAYER}.mlp.up_proj.qweight": t[f"{LAYER}.mlp.up_proj.qweight"][:8]}))
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "model.safetensors", f"{LAYER}.mlp.up_proj.qweight",
                      "in_features")


def test_unknown_bits_is_refused(tmp_path):
    src = _copy(tmp_path)
    _edit_qc(src, bits=9)
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "model.safetensors", "qweight", "unsupported bits 9")


def test_unknown_packing_format_is_refused(tmp_path):
    src = _copy(tmp_path)
    _edit_qc(src, packing_format="auto_round:marlin_planar")
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "config.json", "unknown packing_format",
                      "auto_round:marlin_planar")


def test_group_size_not_dividing_in_features_is_refused(tmp_path):
    src = _copy(tmp_path)
    _edit_qc(src, group_size=48)
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "model.safetensors", "group_size 48 does not divide")


def test_zero_field_outside_the_code_range_is_refused(tmp_path):
    """auto_gptq's z - 1 fields: a field of 15 would be zero point 16 (auto-round's packer clamps to 14)."""
    src = _copy(tmp_path)
    edit_safetensors(src / "model.safetensors",
                     lambda t: t[f"{LAYER}.mlp.up_proj.qzeros"].fill_(-1))  # every field 0xF
    expect_user_error("auto-round->gptq-v2", src, tmp_path, f"{LAYER}.mlp.up_proj.qzeros", "zero point 16")


def test_activation_quantization_is_refused(tmp_path):
    src = _copy(tmp_path)
    _edit_qc(src, act_bits=8)
    expect_user_error("auto-round->gptq-v2", src, tmp_path, "config.json", "act_bits is 8")


def test_packed_layer_the_config_keeps_in_float_is_refused(tmp_path):
    src = _copy(tmp_path)
    _edit_qc(src, extra_config={f"{LAYER}.mlp.up_proj": {"bits": 16}})
    expect_user_error("auto-round->gptq-v2", src, tmp_path, f"{LAYER}.mlp.up_proj.qweight", "16-bit")
