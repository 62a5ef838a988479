"""AWQ (GEMM at 2-8 bits, GEMV): reader bit-exact against the producers' own dequantization, conversions judged by
their consumers.

Fixtures (tests/producer_fixtures/awq/):
- gemm_g32, gemm_g128, gemm_3bit_g128 (scripts/producers/awq.py): a tiny llama quantized by gptqmodel 7.6's AWQ on
  CPU (zero_point true; 4-bit group 32 / 128, and 3-bit group 128, gptqmodel's bit stream whose codes straddle
  words), with gptqmodel's own dequantized weights and logits (reference.safetensors);
- gemm_8bit_g32_sym: made by the same script during the tests into a temporary folder (`--make`, ~35 s);
- autoawq_gemv and its GEMM twin autoawq_gemm (scripts/producers/autoawq.py, in .venvs/autoawq): one AutoAWQ 0.2.9
  search on CPU, packed by AutoAWQ's own quantizer as GEMV and as GEMM; the oracle is AutoAWQ's dequantize_gemm
  of the twin, equal (checked by the script) to the fp16 pseudo-quantized weights it packed into both.
gptqmodel itself runs only in child processes: loading a model through it patches transformers in the process
that does.
- reading: our dequantization == the stored oracle bit for bit (fp16), and == gptqmodel's loader run live;
- awq->gptq-v2: exact, and gptqmodel loads the output to the same weights bit for bit;
- awq->gguf Q4_1: near-exact (codes and fp16 scales kept; the block min -s*z and the source's fp16 product
  round once), checked with gguf-py's decode and llama.cpp's logits against gptqmodel's;
- awq->gguf Q4_0 on asymmetric AWQ: refused without --allow-requant, requantized with it;
- awq->uqff (mistral.rs AFQ): near-exact, mistral.rs' log-probabilities match transformers on our dequantization;
- bad inputs: one line, exit 2, naming file and tensor.
"""

from __future__ import annotations

import math

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

import fixtures
import helpers
from qconvert.converters.registry import detect_format, get_format
from qconvert.formats.gguf.names import gguf_arch, qk_row_permutation
from qconvert.formats.awq.layout import (AWQ_ORDER, gemv_zeros_width, pack_gemm, pack_stream, stream_words,
                                         unpack_gemm, unpack_stream)

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "producer_fixtures" / "awq"
PRODUCER = REPO / "scripts" / "producers" / "awq.py"
VARIANTS = ("gemm_g32", "gemm_g128")  # 4-bit GEMM (gptqmodel)
STREAM = "gemm_3bit_g128"  # gptqmodel's 3-bit bit stream, committed
EIGHT = "gemm_8bit_g32_sym"  # gptqmodel's 8-bit symmetric, made by the tests (the `eight_bit` fixture)
GEMV, TWIN = "autoawq_gemv", "autoawq_gemm"  # AutoAWQ: one quantization packed both ways; the oracle is GEMV's
GPTQMODEL_VARIANTS = (*VARIANTS, STREAM)
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


def _dir(variant: str) -> Path:
    """A variant's folder: committed, or (EIGHT) made into a temporary folder by the `eight_bit` fixture."""
    return _MADE.get(variant, FIXTURES / variant)


_MADE: dict[str, Path] = {}


def _prompt(variant: str) -> list[int]:
    return json.loads((_dir(variant) / "versions.json").read_text()).get("prompt_ids") or fixtures.prompt_ids()


def _reference(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(_dir(GEMV if variant == TWIN else variant) / "reference.safetensors"))


def _our_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    src = get_format("awq").open_reader(ckpt)
    return {r.name: r.load().dequantize(torch.float16) for r in src.records() if r.is_grid}


def _clean_copy(variant: str, dest: Path) -> Path:
    """The checkpoint as its producer saved it, without the oracle beside it."""
    shutil.copytree(_dir(variant), dest, ignore=shutil.ignore_patterns("reference.safetensors", "versions.json"))
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
    """gptqmodel's GPTQ loader (tests/support/fixtures.py gptq_reference: GPTQ_TORCH kernel, fp16), in a child
    process."""
    _child(["-c", _GPTQ_CHILD, str(REPO / "tests" / "support" / "fixtures.py"), str(ckpt), str(out),
            ",".join(map(str, prompt))])
    return load_file(str(out))


def _report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def eight_bit(tmp_path_factory) -> str:
    """gptqmodel's 8-bit symmetric AWQ (g32), made now by the producer script in a child process."""
    out = tmp_path_factory.mktemp("awq8") / EIGHT
    _child([str(PRODUCER), "--make", EIGHT, str(out)])
    _MADE[EIGHT] = out
    return EIGHT


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


def test_bit_stream_layout():
    """gptqmodel's 2/3/5-8-bit AWQ: code c of a row in stream bits c*b.., LSB first, across word boundaries."""
    codes = torch.tensor([[5, 3, 7, 1, 0, 6, 2, 4, 7, 7, 6, 2] + [0] * 20], dtype=torch.uint8)  # 32 3-bit codes
    words = pack_stream(codes, 3)
    assert words.shape == (1, 3) and stream_words(32, 3) == 3
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes[0].tolist()))
    assert [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(3)] == [int(w) & 0xFFFFFFFF for w in words[0]]
    # code 10 (6 = 0b110, bits 30..32) straddles words 0 and 1: 0b10 ends word 0, its high bit starts word 1
    assert (int(words[0, 0]) >> 30) & 3 == 0b10 and int(words[0, 1]) & 1 == 1
    g = torch.Generator().manual_seed(5)
    for bits in range(2, 9):
        for count in (8, 40, 128, 264):  # 264 * odd bits / 32 leaves a partly used last word
            rand = torch.randint(0, 2**bits, (3, count), generator=g, dtype=torch.uint8)
            packed = pack_stream(rand, bits)
            assert packed.shape == (3, stream_words(count, bits)), (bits, count)
            assert torch.equal(unpack_stream(packed, bits, count), rand), (bits, count)


def test_gemv_layout():
    """AutoAWQ GEMV: nibble i of word j holds input 8j + i (no interleave); zeros/scales padded per row."""
    codes = torch.arange(16, dtype=torch.uint8)[None, :]
    first = int(pack_stream(codes, 4)[0, 0]) & 0xFFFFFFFF
    assert [(first >> (4 * i)) & 15 for i in range(8)] == list(range(8))
    # AutoAWQ 0.2.9 gemv.py calculate_zeros_width(in_features, group_size)
    widths = {(128, 32): 4, (256, 32): 4, (4096, 32): 16, (128, 64): 2, (1024, 64): 2, (4096, 128): 4,
              (128, 128): 1, (11008, 128): 11}
    assert {k: gemv_zeros_width(*k) for k in widths} == widths
    assert gemv_zeros_width(256, 16) is None


# -- reading -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", (*GPTQMODEL_VARIANTS, GEMV, TWIN))
def test_reader_equals_stored_oracle(variant):
    ref = _reference(variant)
    ours = _our_weights(FIXTURES / variant)
    assert len(ours) == N_GRIDS and set(ours) == {k for k in ref if k != "__logits__"}
    for name, w in ours.items():
        assert w.dtype == torch.float16 and torch.equal(w, ref[name]), name


@pytest.mark.parametrize("variant", GPTQMODEL_VARIANTS)
def test_reader_equals_gptqmodel_live(variant, tmp_path):
    ckpt = _clean_copy(variant, tmp_path / "awq")
    live = _gptqmodel_awq_reference(ckpt, tmp_path / "live.safetensors")
    stored = _reference(variant)
    assert set(live) == set(stored)
    for name, w in _our_weights(ckpt).items():
        assert torch.equal(w, live[name]), name
    # the producer's loader today gives the stored oracle; its fp16 logits only within the CPU's rounding: torch's
    # CPU matmul takes other kernels on other CPUs (on an AMX Xeon the live logits differed from the stored ones,
    # made elsewhere, while every weight above was equal bit for bit)
    live_logits, stored_logits = live["__logits__"].float(), stored["__logits__"].float()
    assert live_logits.shape == stored_logits.shape
    # (measured there: 0.00195 at most, one fp16 step of logits between 2 and 4; allowed: two steps at the largest)
    diff = float((live_logits - stored_logits).abs().max())
    step = 2.0 ** (math.floor(math.log2(float(stored_logits.abs().max()))) - 10)
    assert diff <= 2 * step, (diff, step)


def test_reader_8bit_equals_gptqmodel(eight_bit):
    """8-bit symmetric: four codes a word, zero points all 128 (gptqmodel's sym), read as gptqmodel reads them."""
    ref = _reference(eight_bit)  # written by gptqmodel's loader just now (scripts/producers/awq.py --make)
    src = get_format("awq").open_reader(_dir(eight_bit))
    assert src.bits == 8 and src.group_size == 32 and src.zero_point is False
    grids = {r.name: r for r in src.records() if r.is_grid}
    assert len(grids) == N_GRIDS
    for name, rec in grids.items():
        grid = rec.load()
        assert grid.params.symmetric and set(grid.params.zeros.unique().tolist()) == {128}, name
        assert int(grid.codes.max()) > 200 and int(grid.codes.min()) < 50, name  # the full 8-bit range is used
        assert torch.equal(grid.dequantize(torch.float16), ref[name]), name


def test_gemv_layout_read_from_autoawq():
    """AutoAWQ's GEMV and GEMM packings of one quantization give the same grids (codes, zeros, scales) here;
    GEMV's padded zero/scale columns are dropped."""
    gemv = {r.name: r for r in get_format("awq").open_reader(FIXTURES / GEMV).records() if r.is_grid}
    twin = {r.name: r for r in get_format("awq").open_reader(FIXTURES / TWIN).records() if r.is_grid}
    assert set(gemv) == set(twin) and len(gemv) == N_GRIDS
    down = "model.layers.0.mlp.down_proj.weight"
    assert gemv[down].shape == (128, 256) and gemv[down].params.n_groups == 8  # scales stored [128, 32]
    for name in gemv:
        a, b = gemv[name].load(), twin[name].load()
        assert torch.equal(a.codes, b.codes) and torch.equal(a.params.zeros, b.params.zeros), name
        assert torch.equal(a.params.scales, b.params.scales), name
    assert get_format("awq").open_reader(FIXTURES / GEMV).describe()["version"] == "gemv"


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
    for variant in (*GPTQMODEL_VARIANTS, GEMV, TWIN):
        assert detect_format(FIXTURES / variant) == "awq", variant
    assert get_format("autoawq").name == "awq"
    out = helpers.run_cli("inspect", FIXTURES / "gemm_g128").stdout
    assert "format: awq" in out and "group_size: 128" in out and "4-bit g128 asym" in out
    out = helpers.run_cli("inspect", FIXTURES / STREAM).stdout
    assert "3-bit g128 asym" in out and "3-bit stream" in out, out
    out = helpers.run_cli("inspect", FIXTURES / GEMV).stdout
    assert "version: gemv" in out and "4-bit g32 asym" in out, out


# -- awq -> gptq-v2 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", (*VARIANTS, STREAM, EIGHT))
def test_awq_to_gptq_v2_exact_and_gptqmodel_loads_it(variant, tmp_path, request):
    if variant == EIGHT:
        request.getfixturevalue("eight_bit")
    out = tmp_path / "gptq"
    helpers.run_cli("awq->gptq-v2", _clean_copy(variant, tmp_path / "awq"), out, "--report", tmp_path / "r.json")
    rep = _report(tmp_path / "r.json")
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in rep["tensors"]), rep["summary"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # (g128: the 128-wide rows are single groups, which the GPTQ writer stores as per-channel, group -1)
    bits = get_format("awq").open_reader(_dir(variant)).bits
    assert qc["format"] == "gptq_v2" and qc["bits"] == bits and qc["sym"] is (variant == EIGHT)
    ref = _reference(variant)
    loaded = _gptqmodel_gptq_reference(out, tmp_path / "gptq_ref.safetensors", _prompt(variant))
    for name in ref:
        if name != "__logits__":
            assert torch.equal(loaded[name], ref[name]), name
    gap = (loaded["__logits__"] - ref["__logits__"]).abs().max().item()
    assert gap < GPTQ_LOGIT_TOL, gap


def test_autoawq_gemv_to_gptq_v2_exact_and_gptqmodel_loads_it(tmp_path):
    """AutoAWQ's GEMV, and its GEMM twin, to GPTQ: exact, the same GPTQ tensors from both, and gptqmodel's
    GPTQ loader gives AutoAWQ's own dequantized weights bit for bit."""
    outs = {}
    for variant in (GEMV, TWIN):
        outs[variant] = tmp_path / variant
        helpers.run_cli("awq->gptq-v2", _clean_copy(variant, tmp_path / f"src_{variant}"), outs[variant],
                        "--report", tmp_path / f"{variant}.json")
        rep = _report(tmp_path / f"{variant}.json")
        assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in rep["tensors"]), rep["summary"]
    a, b = (load_file(str(outs[v] / "model.safetensors")) for v in (GEMV, TWIN))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    ref = _reference(GEMV)
    loaded = _gptqmodel_gptq_reference(outs[GEMV], tmp_path / "gptq_ref.safetensors", _prompt(GEMV))
    assert {k for k in loaded if k != "__logits__"} == set(ref)
    for name in ref:
        assert torch.equal(loaded[name], ref[name]), name


# -- awq -> gguf ---------------------------------------------------------------------------------------

def _q4_1_formula(grid) -> torch.Tensor:
    """Q4_1 of a grid as the GGUF writer is meant to store it, decoded as ggml does (float32 d*q + m): d = s
    (fp16, exact), m = fp16(-s*z), the codes kept."""
    p = grid.params
    d = p.scales.float().repeat_interleave(p.group_size, 1)
    m = (-(p.scales.float() * p.zeros.float())).half().float().repeat_interleave(p.group_size, 1)
    return d * grid.codes.float() + m, m


@pytest.mark.parametrize("variant", (*VARIANTS, GEMV))
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
    gap = float(np.abs(logits - _judge_logits(variant, tmp_path)).max())
    assert gap < LLAMA_Q4_1_LOGIT_TOL, gap


def _judge_logits(variant: str, tmp_path: Path) -> np.ndarray:
    """The producer's logits where it stored them (gptqmodel); AutoAWQ's GEMV has no CPU forward, so there
    transformers runs our dequantization in float32 (awq->hf --type f32, exact)."""
    ref = _reference(variant)
    if "__logits__" in ref:
        return ref["__logits__"][0].numpy()
    hf = tmp_path / "hf_f32"
    helpers.run_cli("awq->hf", FIXTURES / variant, hf, "--type", "f32")
    return helpers.transformers_logits(hf, _prompt(variant))


@pytest.mark.parametrize("variant", (*VARIANTS, STREAM, EIGHT))
def test_awq_to_gguf_f32_runs_like_gptqmodel(variant, tmp_path, request):
    """Our dequantization, stored exactly (F32) and run by llama.cpp without activation quantization, gives
    gptqmodel's AWQ logits to within its fp16 activations' noise."""
    if variant == EIGHT:
        request.getfixturevalue("eight_bit")
    out = tmp_path / "m.gguf"
    helpers.run_cli("awq->gguf", _dir(variant), out, "--type", "f32", "--report", tmp_path / "r.json")
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


def test_awq_3bit_to_gguf_default_refused(tmp_path):
    """3-bit g128 has no GGUF type that keeps it (the default Q3_K quantizes its sub-block scales): refused with
    f32 proposed; test_awq_to_gguf_f32_runs_like_gptqmodel converts it so."""
    out = tmp_path / "m.gguf"
    err = helpers.run_cli("awq->gguf", FIXTURES / STREAM, out, check_rc=2).stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and not out.exists(), err
    for needle in ("requantization to Q3_K", "aligned choice: --type f32 (exact)", "--allow-requant"):
        assert needle in err, (needle, err)


# llama.cpp's CPU Q8_0 matmul quantizes the activations to Q8_0 as well: measured 0.0325 from gptqmodel's fp16
# AWQ model (F32 of the same weights: under LLAMA_F32_LOGIT_TOL), as Q4_1's 0.03 above
LLAMA_Q8_0_LOGIT_TOL = 0.06


def test_awq_8bit_to_gguf_q8_0(eight_bit, tmp_path):
    """8-bit symmetric AWQ and Q8_0 share codes (q - 128) and the fp16 scale per 32-block: the codes are kept.
    gptqmodel rounds each (q - z) * s to fp16 and ggml decodes d * (q - 128) in float32, the exact product, so
    the verdict is near-exact: the GGUF holds the unrounded value, within half an fp16 ulp of gptqmodel's."""
    out = tmp_path / "q8.gguf"
    helpers.run_cli("awq->gguf", _dir(eight_bit), out, "--type", "Q8_0", "--report", tmp_path / "r.json")
    grids = [t for t in _report(tmp_path / "r.json")["tensors"] if t["source"].startswith("8-bit")]
    assert len(grids) == N_GRIDS and {(t["target"], t["verdict"]) for t in grids} == {("Q8_0", "near-exact")}
    ref = _reference(eight_bit)
    tensors = helpers.gguf_tensors(out)
    source = get_format("awq").open_reader(_dir(eight_bit))
    src = {r.name: r for r in source.records()}
    arch = gguf_arch(source.config)
    for t in grids:
        decoded = torch.from_numpy(np.ascontiguousarray(helpers.gguf_dequant(tensors[t["out_name"]]))).reshape(t["shape"])
        perm = qk_row_permutation(t["name"], source.config, arch)
        if perm is not None:
            decoded = decoded[torch.argsort(perm)]
        grid = src[t["name"]].load()
        p = grid.params
        g = p.group_of_column(t["shape"][1])
        exact = (grid.codes.float() - p.zeros.float()[:, g]) * p.scales.float()[:, g]
        assert torch.equal(decoded, exact), t["name"]  # the codes and scales are the source's, unrounded
        assert torch.equal(decoded.half(), ref[t["name"]]), t["name"]  # gptqmodel's value is that, rounded to fp16
        assert abs(t["max_abs_err"] - (decoded - ref[t["name"]].float()).abs().max().item()) < 1e-9
    logits = helpers.llama_logits(out, _prompt(eight_bit))
    gap = float(np.abs(logits - ref["__logits__"][0].numpy()).max())
    assert gap < LLAMA_Q8_0_LOGIT_TOL, gap


def test_awq_to_gguf_default_type_is_q4_1(tmp_path):
    helpers.run_cli("awq->gguf", FIXTURES / "gemm_g128", tmp_path / "m.gguf", "--report", tmp_path / "r.json")
    grids = [t for t in _report(tmp_path / "r.json")["tensors"] if t["source"].startswith("4-bit")]
    assert {(t["target"], t["verdict"]) for t in grids} == {("Q4_1", "near-exact")}


# -- awq -> uqff (mistral.rs) -----------------------------------------------------------------------------

# mistral.rs' AFQ stores bias = -scale*zero in float32 and computes scale*q + bias in float32, where gptqmodel
# rounds (q - z)*s to fp16 (weights differ by <= 1.2e-4): measured teacher-forced log-prob gap 4.6e-4 against
# transformers in float32 on our fp16 weights (exact UQFF families reach 1e-4 in tests/formats/uqff/test_uqff.py)
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

def _edited(tmp_path: Path, *, tensors=None, quant=None, variant="gemm_g32") -> Path:
    ckpt = _clean_copy(variant, tmp_path / "bad")
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
    # 4-bit words read as 8-bit: the first module in file order is mlp.down_proj ([256, 16] words, 128 outputs)
    "8 bits": (lambda q: q.update(bits=8), ("qweight shape (256, 16) does not hold 128 outputs of 8 bits",
                                            "expected (256, 32)", f"{DOWN}.qweight")),
    "autoawq w_bit 3": (lambda q: (q.pop("bits"), q.update(w_bit=3)), ("does not hold 128 outputs of 3 bits",
                                                                       "expected (256, 12)")),
    "9 bits": (lambda q: q.update(bits=9), ("quantization_config.bits is 9", "AWQ packs 2 through 8 bits")),
    "1 bit": (lambda q: q.update(bits=1), ("quantization_config.bits is 1",)),
    # GEMM words read as GEMV: down_proj's [256, 16] would be 256 outputs of 128 inputs (config: 128 of 256)
    "gemm read as gemv": (lambda q: q.update(version="gemv", format="gemv", checkpoint_format="gemv"),
                          ("implies in_features 128", "GEMV: [out, in/8]", f"{DOWN}.qweight")),
    "gemv_fast": (lambda q: q.update(version="gemv_fast", format="gemv_fast", checkpoint_format="gemv_fast"),
                  ("'gemv_fast'", "only the GEMM", "and GEMV")),
    "gemv at 3 bits": (lambda q: q.update(bits=3, version="gemv", format="gemv", checkpoint_format="gemv"),
                       ("with 3 bits: the GEMV layout is 4-bit only",)),
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


GV_DOWN = "model.layers.0.mlp.down_proj"
BAD_GEMV = {
    # AutoAWQ's GEMV has no zero/scale width for groups of 16 (calculate_zeros_width raises)
    "group 16": (dict(quant=lambda q: q.update(group_size=16)), ("group_size 16", "groups of 32, 64 or >= 128")),
    # the file's [out, 32] scales are 4 words of 8 padded group columns; group 64 wants 2 words
    "group other than stored": (dict(quant=lambda q: q.update(group_size=64)),
                                ("qzeros shape (128, 4)", "expected (128, 2)", f"{GV_DOWN}.qzeros")),
    "scales without the padding": (dict(tensors=lambda t: t.__setitem__(f"{GV_DOWN}.scales",
                                                                       t[f"{GV_DOWN}.scales"][:, :8].clone())),
                                   ("scales shape (128, 8)", "expected (128, 32)", f"{GV_DOWN}.scales")),
    "qweight in GEMM orientation": (dict(tensors=lambda t: t.__setitem__(f"{GV_DOWN}.qweight", t[f"{GV_DOWN}.qweight"]
                                                                        .reshape(256, 16).clone())),
                                    ("implies in_features 128", "GEMV: [out, in/8]", f"{GV_DOWN}.qweight")),
}


@pytest.mark.parametrize("case", sorted(BAD_GEMV))
def test_bad_gemv_refused(case, tmp_path):
    edit, needles = BAD_GEMV[case]
    ckpt = _edited(tmp_path, variant=GEMV, **edit)
    helpers.expect_user_error("awq->gptq-v2", ckpt, tmp_path, "bad", *needles)


def test_bad_bit_stream_refused(tmp_path):
    """A 3-bit stream one word short of its 128 outputs (12 words)."""
    q = "model.layers.0.self_attn.q_proj"
    ckpt = _edited(tmp_path, variant=STREAM, tensors=lambda t: t.__setitem__(f"{q}.qweight", t[f"{q}.qweight"][:, :11]
                                                                             .clone()))
    helpers.expect_user_error("awq->gptq-v2", ckpt, tmp_path, "model.safetensors", f"{q}.qweight",
                              "does not hold 128 outputs of 3 bits", "expected (128, 12)")


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
