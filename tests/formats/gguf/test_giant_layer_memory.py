"""A many-expert MXFP4 layer (compressed-tensors `mxfp4-pack-quantized`, Kimi-K3's and DeepSeek-V4's form) into GGUF
MXFP4 streams with memory bounded by one expert tensor, not by the layer (issue 26 item 3, issue 29 item 1).

The layer of scripts/bench_giant_layer.py at a CI size: 128 experts x 3 projections of 512 x 1024 (or 1024 x 512)
MXFP4 weights, 272 KB of source bytes each, 104 MB in all. The conversion runs in a child process that first
converts a 4-expert copy (imports, caches), then resets its peak RSS (/proc/self/clear_refs 5) and converts the
layer: the peak's growth over the RSS before must stay under 8 float32 copies of one expert tensor (2 MB each:
the working set of one tensor, whatever the expert count). Measured: 11 MB now; 35 MB before the records
dropped their parameters after planning (every grid's E8M0 scales and zero points, 2 bytes per 32 weights, held
from planning to writing) and before the runner fixed glibc's mmap threshold (freed temporaries kept in a
fragmented heap), growing with the layer. The output is llama.cpp's repack of the source bytes, an expert at a
time (what bench_giant_layer.py checks against the sdist's `repack_mxfp4_blocks`; here its byte rule).

The same for DeepSeek-V4's own files (the `hf` reader of its release layout: int8-packed MXFP4 experts beside
E8M0 `.scale`), and, for every reader giant checkpoints come through, that no planned record holds its grid
parameters (they are read again on use: `TensorRecord.params_loader`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import bench_giant_layer as layer

EXPERTS, HIDDEN, FFN = 128, 1024, 512
ONE_EXPERT_F32 = 4 * HIDDEN * FFN  # one projection of one expert as float32 values

_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    small, big, out = map(Path, sys.argv[1:4])
    fmt, gguf_type = sys.argv[4:6] if len(sys.argv) > 4 else ("compressed-tensors", "mxfp4")
    convert(fmt, small, "gguf", out.with_name("small.gguf"), Options(type=gguf_type), progress=False)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    report = convert(fmt, big, "gguf", out, Options(type=gguf_type), progress=False)
    print(json.dumps({"grown": status("VmHWM") - before, "verdicts": report.summary()["verdicts"]}))
""")


def _convert_within_bound(tmp_path, small, big, out, how: list[str], min_exact: int, one_expert: int) -> None:
    """_CHILD's conversion of `big` (`how`: source format and GGUF type) after `small`: more than `min_exact` exact
    tensors, none requantized, and peak RSS grown by less than 8 float32 expert tensors of `one_expert` bytes."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(small), str(big), str(out), *how],
                          capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["verdicts"]["exact"] > min_exact and got["verdicts"]["requantize"] == 0
    assert got["grown"] < 8 * one_expert, (f"peak RSS grew {got['grown'] / 1e6:.1f} MB = "
                                           f"{got['grown'] / one_expert:.1f} float32 expert tensors")


def _ggml_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ggml's block_mxfp4 rows from compressed-tensors' bytes: per 32 weights the E8M0 byte, then 16 bytes whose
    low nibbles are weights 0..15 and high nibbles 16..31 (the source packs weights 2i, 2i+1 in a byte)."""
    rows = packed.shape[0]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scale.reshape(rows, -1, 1), qs], axis=-1).reshape(rows, -1)


def test_many_expert_mxfp4_layer_memory_bounded_by_one_expert(tmp_path):
    import gguf

    small = layer.build_source(tmp_path / "small", 4, 256, 128)
    big = layer.build_source(tmp_path / "big", EXPERTS, HIDDEN, FFN)
    out = tmp_path / "layer.gguf"
    _convert_within_bound(tmp_path, small, big, out, ["compressed-tensors", "mxfp4"], 3 * EXPERTS, ONE_EXPERT_F32)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for proj in layer.PROJECTIONS:
        stack = tensors[layer.GGUF_STACK[proj]]
        assert stack.tensor_type == gguf.GGMLQuantizationType.MXFP4
        for e in range(EXPERTS):
            packed, scale = layer._expert_bytes(e, proj, HIDDEN, FFN)
            assert np.array_equal(np.asarray(stack.data[e]), _ggml_mxfp4(packed, scale)), (proj, e)


def test_lazy_record_parameters_read_on_use_and_not_inherited():
    """A record whose reader re-reads its parameters (`params_loader`) reads them on use, drops them when
    released and reads them again; a record derived from it with parameters of its own (a grid's dense halves:
    `replace(rec, params=None)`) keeps them, not the parent's loader (else the halves were read as grids)."""
    from dataclasses import replace

    from qconvert.converters.records import TensorRecord
    from qconvert.formats.common.float_grids import float_grid
    import torch

    reads = []

    def loader():
        reads.append(1)
        return float_grid("e2m1", torch.full((4, 2), 1.0).to(torch.float8_e8m0fnu), 32)

    rec = TensorRecord("w", (4, 64), "grid", lambda: None, params_loader=loader)
    assert rec.is_grid and not reads
    assert rec.params.n_groups == 2 and rec.params is rec.params and len(reads) == 1
    assert rec.params.zeros.stride() == (0, 0)  # a float grid's unused zero points cost one byte
    rec.release_params()
    assert rec.params.n_groups == 2 and len(reads) == 2
    half = replace(rec, name="w.k", params=None)
    assert not half.is_grid and half.params is None and len(reads) == 2
    eager = TensorRecord("d", (4, 64), "grid", lambda: None, params=loader())
    eager.release_params()  # nothing to read it again with: kept
    assert eager.params is not None and eager.params_loader is None
    # a renamed record (`renamed`, not `replace`) keeps the loader and reads nothing until used
    from qconvert.converters.records import renamed

    reads.clear()
    lazy = renamed(rec, name="w2")
    assert lazy.name == "w2" and lazy.params_loader is loader and lazy._params is None and not reads
    assert lazy.params.n_groups == 2 and len(reads) == 1
    assert renamed(eager, name="d2").params is eager.params  # an eager one keeps its own


# -- the DeepSeek-V4 release layout (formats/hf/deepseek_v4.py): int8-packed MXFP4 experts beside E8M0 `.scale` --

DSV4_EXPERTS, DSV4_FFN, DSV4_HIDDEN = 48, 2048, 256  # per layer; 2 layers: 288 expert tensors of 2 MB as float32
DSV4_EXPERT_F32 = 4 * DSV4_HIDDEN * DSV4_FFN  # one projection of one expert as float32 values (2 MB)
_RELEASE_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # the release's names for them


def _dsv4_wide_fixture():
    """The tiny 2-layer DeepSeek-V4 release checkpoint of test_gguf_archs_deepseek4.py (the same cache entry):
    the dense tensors of the layers built below."""
    import fixtures_archs
    from gguf_arch_files import cached

    root = layer.REPO / "tests" / "_fixtures" / "archs"
    return cached(root / "dsv4-release-wide", lambda d: fixtures_archs.build_deepseek_v4(d, wide=True, layers=2))


def build_deepseek4_layers(out, experts: int, ffn: int):
    """The tiny DeepSeek-V4 release checkpoint (hidden 256, 2 layers: sliding, CSA) with `experts` routed experts
    of width `ffn` per layer, in the release's form: per expert and projection an int8 `.weight` [out, in / 2]
    (two E2M1 codes a byte) and an E8M0 `.scale` [out, in / 32], the bytes of bench_giant_layer's experts
    (`_expert_bytes`), 16 experts a shard; the router and the shared expert redrawn at the new sizes; every other
    tensor the fixture's."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = _dsv4_wide_fixture()
    out.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    config.update(n_routed_experts=experts, moe_intermediate_size=ffn)
    hidden = config["hidden_size"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(0)
    dense = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if ".ffn.experts." in name:
                continue
            if name.endswith(".ffn.gate.weight"):
                dense[name] = torch.randn(experts, hidden, generator=gen) / hidden ** 0.5
            elif name.endswith(".ffn.gate.bias"):
                dense[name] = torch.zeros(experts)
            elif ".shared_experts." in name:
                shape = (hidden, ffn) if ".w2." in name else (ffn, hidden)
                dense[name] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
            else:
                dense[name] = f.get_tensor(name)
    shards = [("model-dense.safetensors", dense)]
    save_file(dense, str(out / shards[0][0]), metadata={"format": "pt"})
    weight_map = dict.fromkeys(dense, shards[0][0])
    for i in range(config["num_hidden_layers"]):
        for first in range(0, experts, layer.EXPERTS_PER_SHARD):
            tensors = {}
            for e in range(first, min(first + layer.EXPERTS_PER_SHARD, experts)):
                for w, proj in _RELEASE_PROJ.items():
                    packed, scale = layer._expert_bytes(e, proj, hidden, ffn)
                    head = f"layers.{i}.ffn.experts.{e}.{w}"
                    tensors[head + ".weight"] = torch.from_numpy(packed).view(torch.int8)
                    tensors[head + ".scale"] = torch.from_numpy(scale).view(torch.float8_e8m0fnu)
            shard = f"model-layer{i}-experts{first}.safetensors"
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_deepseek4_release_experts_memory_bounded_by_one_expert(tmp_path):
    """DeepSeek-V4's own files (hf reader, release layout) into GGUF with the experts kept MXFP4 (`--type f32`:
    the dense tensors F32): the peak RSS grows by less than 8 float32 copies of one expert tensor over a 4-expert
    copy's, for 288 expert tensors (the records read their E8M0 `.scale` on use and drop them once planned), and
    every expert is llama.cpp's repack of its source bytes."""
    import gguf

    small = build_deepseek4_layers(tmp_path / "small", 4, 256)
    big = build_deepseek4_layers(tmp_path / "big", DSV4_EXPERTS, DSV4_FFN)
    out = tmp_path / "layers.gguf"
    _convert_within_bound(tmp_path, small, big, out, ["hf", "f32"], 6 * DSV4_EXPERTS, DSV4_EXPERT_F32)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for i in range(2):
        for proj in layer.PROJECTIONS:
            stack = tensors[layer.GGUF_STACK[proj].replace("blk.0.", f"blk.{i}.")]
            assert stack.tensor_type == gguf.GGMLQuantizationType.MXFP4
            for e in range(DSV4_EXPERTS):
                packed, scale = layer._expert_bytes(e, proj, DSV4_HIDDEN, DSV4_FFN)
                assert np.array_equal(np.asarray(stack.data[e]), _ggml_mxfp4(packed, scale)), (i, proj, e)


# -- every reader giant checkpoints come through: no record holds its parameters once planned -----------------

def _dsv4_fp8_fixture():
    """test_gguf_archs_deepseek4.py's full-release form (FP8 128x128-block linears with E8M0 exponents beside
    the MXFP4 experts), the same cache entries."""
    import fixtures_archs
    from gguf_arch_files import cached

    root = layer.REPO / "tests" / "_fixtures" / "archs"
    f32 = cached(root / "dsv4-release", lambda d: fixtures_archs.build_deepseek_v4(d, wide=False, layers=4))
    bf16 = cached(root / "dsv4-release-bf16", lambda d: fixtures_archs.deepseek_v4_bf16(f32, d))
    return cached(root / "dsv4-release-fp8", lambda d: fixtures_archs.deepseek_v4_fp8(bf16, d))


def _gpt_oss_mxfp4_fixture():
    """test_float_grids.py's gpt-oss in OpenAI's MXFP4 form (`*_blocks` / `*_scales`), the same cache entry."""
    import shutil

    import fixtures_archs

    path = layer.REPO / "tests" / "_fixtures" / "float" / "gpt_oss_mxfp4"
    if not (path / "config.json").exists():
        dense = fixtures_archs.build_arch_model(path.with_name("gpt_oss_dense"), "gpt_oss")
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        fixtures_archs.gpt_oss_mxfp4_checkpoint(dense, tmp)
        shutil.move(str(tmp), str(path))
    return path


def _fp8_blocks_fixture(tmp):
    """A DeepSeek-V3-shaped FineGrainedFP8 checkpoint (`weight_scale_inv` per 128x128 block), tiny and random."""
    import fixtures_float

    cfg, tensors = fixtures_float.deepseek_v3_fp8_shapes(hidden=256, inter=256, moe_inter=128, experts=4, layers=2,
                                                         heads=2, q_lora=128, kv_lora=128, nope=64, rope=32, v=64)
    return fixtures_float.write_random_fp8_model(tmp / "fp8", cfg, tensors, max_shard_bytes=1 << 20)


def _kimi_k3_fixture():
    """test_gguf_archs_kimik3.py's tiny Kimi-K3 (compressed-tensors MXFP4 experts), the same cache entry."""
    import fixtures_archs
    from gguf_arch_files import cached

    return cached(layer.REPO / "tests" / "_fixtures" / "archs" / "kimi_k3-src", fixtures_archs.build_kimi_k3)


_PRODUCED = layer.REPO / "tests" / "producer_fixtures"
_LAZY_READERS = {  # reader: (its source, the target planned, its options)
    "hf-deepseek4-mxfp4": ("hf", lambda tmp: _dsv4_wide_fixture(), "gguf", {"type": "f32"}),
    "hf-deepseek4-fp8": ("hf", lambda tmp: _dsv4_fp8_fixture(), "gguf", {"type": "f32", "allow_requant": True}),
    "fp8": ("fp8", _fp8_blocks_fixture, "hf", {"allow_requant": True}),
    "modelopt-nvfp4": ("modelopt", lambda tmp: _PRODUCED / "modelopt" / "nvfp4", "gguf", {"type": "f32"}),
    "mxfp4-gpt-oss": ("mxfp4", lambda tmp: _gpt_oss_mxfp4_fixture(), "gguf", {"type": "mxfp4"}),
    "gptq": ("gptq", lambda tmp: _PRODUCED / "gptq_smollm3" / "model", "gguf", {"type": "q4_0"}),
    "awq": ("awq", lambda tmp: _PRODUCED / "awq" / "gemm_g128", "gguf", {"type": "q4_1", "allow_requant": True}),
    "auto-round": ("auto-round", lambda tmp: _PRODUCED / "auto_round" / "asym4_g128", "gguf",
                   {"type": "q4_1", "allow_requant": True}),
    "mlx-moe": ("mlx", lambda tmp: _PRODUCED / "mlx" / "moe" / "model", "gguf",
                {"type": "q8_0", "allow_requant": True}),
    # records the GGUF writer renames (`renamed`): Kimi-K3's out of `language_model.`, GLM's kept MTP block
    "ct-kimi-k3": ("compressed-tensors", lambda tmp: _kimi_k3_fixture(), "gguf", {"type": "mxfp4"}),
    "gptq-glm4moe-mtp": ("gptq", lambda tmp: _PRODUCED / "gptq_glm4moe" / "model", "gguf",
                         {"type": "q4_0", "allow_requant": True}),
}


@pytest.mark.parametrize("case", sorted(_LAZY_READERS))
def test_planned_records_hold_no_parameters(case, tmp_path):
    """After planning (what the runner keeps until it writes), every grid record of the readers that giant
    checkpoints come through holds no scales or zero points (it reads them again with its codes:
    `params_loader`), and reads them again on use, the same as the first reading: before, each held its
    parameters from planning to writing (for a 2.8T model tens of GB, 1/16-1/64 of the code bytes)."""
    import torch

    from qconvert.converters.plan import Options
    from qconvert.converters.registry import get_format
    from qconvert.converters.run import open_source, plan_conversion

    fmt, path, target, opts = _LAZY_READERS[case]
    options = Options(**opts)
    source = open_source(fmt, path(tmp_path), options)
    pairs = plan_conversion(source, get_format(target).writer.for_conversion(source, options), options, progress=False)
    grids = [rec for rec, _ in pairs if rec.is_grid]
    assert grids, "no quantized tensor read"
    held = [rec.name for rec in grids if rec.params_loader is None or rec._params is not None]
    assert not held, f"{len(held)} of {len(grids)} planned records hold their parameters: {held[:3]}"
    # read again on use, the same as a fresh reader's first reading (a renamed record: under its source name)
    again = {name: rec.params for rec in grids[:8] for name in (rec.name, rec.source_name) if name}
    fresh = {rec.name: rec for rec in open_source(fmt, path(tmp_path), options).records() if rec.name in again}
    assert fresh, "no planned record under its reader's name"
    for name, rec in fresh.items():
        assert torch.equal(again[name].scales, rec.params.scales), name
