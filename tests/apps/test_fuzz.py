"""A bounded fuzz run (scripts/fuzz) of all 18 readers on mutated real checkpoints: each case must end
`exact` (exit 0, every output tensor equal to the seed's conversion), `changed` (exit 0 after a data
mutation, which no reader can tell from other values) or `refused` (exit 2, one line naming a file of the
input, nothing left at OUT) -- never a traceback, a hang, an allocation beyond the input's size, a refusal
naming no file or otherwise malformed, a warning before the error line, or silently different tensors. A
second run proves the oracle: a mutation that swaps two like tensors' bytes under unchanged headers (what a
reader silently misreading its input produces) must be counted `silent` in every case.

Seeds: the gptqmodel GPTQ / QQQ checkpoints, hqq's transformers and qmodel.pt folders, mistral.rs' UQFF
folders, the dense base models, the FP8 and gpt-oss MXFP4 checkpoints of fixtures_float / fixtures_archs, the
producer fixtures (AWQ, auto-round, bitsandbytes, compressed-tensors, MLX, ModelOpt, AMD Quark, torchao), and GGUFs written by
qconvert and llama.cpp (made by the fuzzer). The fuzzer runs in its own process (a fork server that must not
have run torch before forking).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fixtures_archs
import fixtures_float
import fixtures_qqq
import fixtures_uqff

REPO = Path(__file__).resolve().parents[2]
FUZZ = REPO / "scripts" / "fuzz"  # a package: `python scripts/fuzz` runs its __main__.py
HQQ_PY = REPO / ".venvs" / "hqq" / "bin" / "python"
HQQ_ROOT = REPO / "tests" / "_fixtures" / "hqq"
FLOAT = REPO / "tests" / "_fixtures" / "float"
# the 18 readers qconvert has; the run fuzzes every reader scripts/fuzz/seeds.py registers (these at least)
READERS = ("gptq", "gptq-v2", "qqq", "hqq", "hqq-pt", "gguf", "uqff", "hf", "awq", "auto-round", "bitsandbytes",
           "compressed-tensors", "mlx", "modelopt", "fp8", "mxfp4", "quark", "torchao")
CASES = 20  # per reader; with --jobs 2 the run takes about a minute and a half on 2 cores
MASTER_SEED = 9
BAD = ("silent", "warning-first", "no-file", "bad-refusal", "traceback", "hang", "alloc", "error")
CANARY_READERS = ("hf", "gptq", "awq", "modelopt", "gguf", "mxfp4")  # safetensors and GGUF inputs; hf and gguf targets


def _float_fixtures() -> None:
    """The FP8 (DeepSeek-V3 in both block layouts) and gpt-oss MXFP4 seeds, made as test_float_grids makes
    them (cached in tests/_fixtures/float; the fuzzer's seeds list names them)."""
    for kind in ("transformers", "transformers-ue8m0", "deepseek"):
        path = FLOAT / f"deepseek_fp8_{kind}"
        if not (path / "config.json").exists():
            dense = fixtures_archs.build_arch_model(FLOAT / "deepseek_dense", "deepseek_v3")
            block, rule = ((16, 32), kind) if kind.startswith("transformers") else ((128, 128), "deepseek")
            shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
            fixtures_float.fp8_checkpoint(dense, path.with_name(path.name + ".tmp"), block=block, rule=rule)
            shutil.move(str(path.with_name(path.name + ".tmp")), str(path))
    path = FLOAT / "gpt_oss_mxfp4"
    if not (path / "config.json").exists():
        dense = fixtures_archs.build_arch_model(FLOAT / "gpt_oss_dense", "gpt_oss")
        shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
        fixtures_archs.gpt_oss_mxfp4_checkpoint(dense, path.with_name(path.name + ".tmp"))
        shutil.move(str(path.with_name(path.name + ".tmp")), str(path))


def _fuzz(tmp_path: Path, readers, cases: int, *extra: str) -> dict:
    """A fuzz run of `readers` (None: every reader scripts/fuzz/seeds.py registers) -> its summary JSON."""
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(FUZZ), *(["--readers", ",".join(readers)] if readers else []),
                           "--cases", str(cases),
                           "--seed", str(MASTER_SEED), "--jobs", "2", "--timeout", "30", "--quiet",
                           "--summary-json", str(summary), *extra],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(summary.read_text())
    assert result["finished"] and not result["seed_failures"], result["seed_failures"]
    return result


@pytest.fixture(scope="module")
def seeds(fx):
    """Every fixture the fuzzer draws seeds from (built once, cached in tests/_fixtures)."""
    fixtures_qqq.ensure_qqq_fixtures()
    info = fixtures_uqff.ensure_uqff_fixtures()
    assert not info["failed"], f"mistral.rs could not write: {info['failed']}"
    if not all((HQQ_ROOT / v / ".done").exists() for v in ("b4_g64_ax1", "b4_g64_ax0_bf16", "legacy_b4_g64_ax0")):
        assert HQQ_PY.exists(), f"{HQQ_PY} is missing: run `bash scripts/test_env.d/20-hqq.sh` (scripts/run_tests.sh does)"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(HQQ_PY), str(REPO / "tests" / "support" / "fixtures_hqq.py"), "build", "--root",
                               str(HQQ_ROOT)], capture_output=True, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _float_fixtures()
    return fx


def test_fuzz_every_reader(seeds, tmp_path):
    result = _fuzz(tmp_path, None, CASES)  # a reader whose seeds are registered later is fuzzed here too
    counts = result["counts"]
    assert set(READERS) <= set(counts), sorted(set(READERS) - set(counts))
    for reader in counts:
        row = counts.get(reader, {})
        assert sum(row.values()) == CASES, (reader, row)
        assert row.get("skipped", 0) <= CASES // 4, (reader, row)  # the mutations reach every reader
        assert row.get("exact", 0) + row.get("changed", 0) + row.get("refused", 0) > 0, (reader, row)
        assert row.get("ok", 0) == 0, (reader, row)  # every exit 0 was compared with the seed's conversion
    total = {o: sum(row.get(o, 0) for row in counts.values()) for o in ("exact", "changed")}
    assert total["exact"] > 0 and total["changed"] > 0, total  # the oracle saw equal and changed outputs
    bad = [f for f in result["findings"] if f["outcome"] in BAD]
    by_signature: dict[tuple[str, str, str], list[dict]] = {}
    for f in bad:
        by_signature.setdefault((f["reader"], f["outcome"], f["signature"]), []).append(f)
    report = "\n".join(
        f"{reader} {outcome} x{len(cases)}: {sig}\n    e.g. case {cases[0]['case']} ({cases[0]['seed']}): "
        f"{cases[0]['mutation']}\n    {cases[0]['line'][:300]}\n    reproduce: python scripts/fuzz --replay "
        f"'{json.dumps({'reader': reader, 'seed': cases[0]['seed'], 'case': cases[0]['case'], 'master_seed': MASTER_SEED})}'"
        for (reader, outcome, sig), cases in sorted(by_signature.items()))
    assert not bad, f"{len(bad)} of {len(counts) * CASES} fuzz cases broke the bad-input contract:\n{report}"


def test_fuzz_oracle_flags_a_silent_tensor_change(seeds, tmp_path):
    """The oracle's own test: `--mutations canary` swaps the bytes of two tensors of one dtype and shape
    (values that differ) under unchanged headers and calls it structural -- a valid-looking input converted
    with two tensors' values exchanged, what a silently misreading reader gives. Every case must exit 0 and
    be counted `silent`, naming both tensors; the comparison is per tensor value, for hf and GGUF outputs."""
    result = _fuzz(tmp_path, CANARY_READERS, 2, "--mutations", "canary", "--no-inspect", "--targets", "hf")
    for reader in CANARY_READERS:
        assert result["counts"].get(reader) == {"silent": 2}, (reader, result["counts"].get(reader))
    for f in result["findings"]:
        assert f["outcome"] == "silent" and "differ" in f["line"], f
        assert f["mutation"].startswith("canary:"), f
