"""Streaming: converting a sharded checkpoint holds about one tensor at a time, never the model.

Peak memory is read from the kernel's resource accounting (ru_maxrss) in a fresh process, as the
increase over the same process after a warm-up conversion (imports, allocator, code paths)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from synthetic_gptq import EXAMPLE, make_synthetic_gptq

PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out, example = map(Path, sys.argv[1:4])
    convert("gptq", example, "gguf", out.with_name("warmup.gguf"), Options(), progress=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = convert("gptq", src, "gguf", out, Options(), progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "verdicts": report.summary()["verdicts"]}))
""")


def test_peak_memory_below_twice_the_largest_shard(tmp_path):
    info = make_synthetic_gptq(tmp_path / "src", hidden=1024, intermediate=2816, layers=24, shard_mb=48)
    assert len(info["shards"]) >= 4
    total = sum(p.stat().st_size for p in info["shards"])
    out = tmp_path / "out.gguf"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "src"), str(out), str(EXAMPLE)],
                          capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = result["peak"] - result["base"]
    assert result["verdicts"]["exact"] == 24 * (7 + 2) + 3  # every tensor exact: 7 grids + 2 norms a layer, 3 more
    assert out.stat().st_size > 0.9 * total  # the whole model was written
    assert grown < 2 * info["largest_shard_bytes"], (grown / 1e6, info["largest_shard_bytes"] / 1e6, total / 1e6)
