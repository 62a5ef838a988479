"""A bounded fuzz run (scripts/fuzz) of every reader on mutated real checkpoints: each case must end `ok`
(exit 0, with the seed's own tensors when the mutation was structural) or `refused` (exit 2, one line naming
a file of the input, nothing left at OUT) -- never a traceback, a hang, an allocation beyond the input's
size, a malformed refusal, a warning before the error line, or silently different tensors.

Seeds: the gptqmodel GPTQ / QQQ checkpoints, hqq's transformers and qmodel.pt folders, mistral.rs' UQFF
folders, the dense base models, and GGUFs written by qconvert and llama.cpp (made by the fuzzer). The fuzzer
runs in its own process (a fork server that must not have run torch before forking).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fixtures_qqq
import fixtures_uqff

REPO = Path(__file__).resolve().parents[2]
FUZZ = REPO / "scripts" / "fuzz"  # a package: `python scripts/fuzz` runs its __main__.py
HQQ_PY = REPO / ".venvs" / "hqq" / "bin" / "python"
HQQ_ROOT = REPO / "tests" / "_fixtures" / "hqq"
READERS = ("gptq", "gptq-v2", "qqq", "hqq", "hqq-pt", "gguf", "uqff", "hf")
CASES = 40  # per reader; with --jobs 2 the run takes about a minute and a half on 2 cores
MASTER_SEED = 9
BAD = ("silent", "warning-first", "bad-refusal", "traceback", "hang", "alloc", "error")


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
    return fx


def test_fuzz_every_reader(seeds, tmp_path):
    summary = tmp_path / "summary.json"
    findings = tmp_path / "findings.jsonl"
    proc = subprocess.run([sys.executable, str(FUZZ), "--readers", ",".join(READERS), "--cases", str(CASES),
                           "--seed", str(MASTER_SEED), "--jobs", "2", "--timeout", "30", "--quiet",
                           "--summary-json", str(summary), "--findings", str(findings)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(summary.read_text())
    assert not result["seed_failures"], result["seed_failures"]
    counts = result["counts"]
    for reader in READERS:
        row = counts.get(reader, {})
        assert sum(row.values()) == CASES, (reader, row)
        assert row.get("skipped", 0) <= CASES // 4, (reader, row)  # the mutations reach every reader
        assert row.get("ok", 0) + row.get("refused", 0) > 0, (reader, row)
    bad = [f for f in result["findings"] if f["outcome"] in BAD]
    by_signature: dict[tuple[str, str, str], list[dict]] = {}
    for f in bad:
        by_signature.setdefault((f["reader"], f["outcome"], f["signature"]), []).append(f)
    report = "\n".join(
        f"{reader} {outcome} x{len(cases)}: {sig}\n    e.g. case {cases[0]['case']} ({cases[0]['seed']}): "
        f"{cases[0]['mutation']}\n    {cases[0]['line'][:300]}\n    reproduce: python scripts/fuzz --replay "
        f"'{json.dumps({'reader': reader, 'seed': cases[0]['seed'], 'case': cases[0]['case'], 'master_seed': MASTER_SEED})}'"
        for (reader, outcome, sig), cases in sorted(by_signature.items()))
    assert not bad, f"{len(bad)} of {len(READERS) * CASES} fuzz cases broke the bad-input contract:\n{report}"
