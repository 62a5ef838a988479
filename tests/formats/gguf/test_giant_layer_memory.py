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
time (what bench_giant_layer.py checks against the sdist's `repack_mxfp4_blocks`; here its byte rule)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np

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
    convert("compressed-tensors", small, "gguf", out.with_name("small.gguf"), Options(type="mxfp4"), progress=False)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    report = convert("compressed-tensors", big, "gguf", out, Options(type="mxfp4"), progress=False)
    print(json.dumps({"grown": status("VmHWM") - before, "verdicts": report.summary()["verdicts"]}))
""")


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
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(small), str(big), str(out)], capture_output=True,
                          text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["verdicts"]["exact"] > 3 * EXPERTS and got["verdicts"]["requantize"] == 0
    assert got["grown"] < 8 * ONE_EXPERT_F32, (f"peak RSS grew {got['grown'] / 1e6:.1f} MB = "
                                               f"{got['grown'] / ONE_EXPERT_F32:.1f} float32 expert tensors")
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
