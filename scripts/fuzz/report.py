"""What a run reports: the counts table and the findings by signature on the console, the findings grouped
by reader, outcome and signature as markdown (--report-md), the counts, seed problems and findings as JSON
(--summary-json). The findings JSON lines (--findings) are written by the Fuzzer as cases finish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .classify import OUTCOMES
from .common import REPO

if TYPE_CHECKING:
    from .fuzzer import Fuzzer

COMMAND = "python scripts/fuzz"  # how the report says to run the fuzzer


def table(counts: dict[str, dict[str, int]]) -> str:
    cols = list(OUTCOMES[1:]) + ["skipped"]
    w = max([8] + [len(r) for r in counts])
    head = f"{'reader':<{w}} " + " ".join(f"{c:>9}" for c in cols) + f" {'total':>6}"
    rows = [head]
    total = {c: 0 for c in cols}
    for reader in sorted(counts):
        row = counts[reader]
        rows.append(f"{reader:<{w}} " + " ".join(f"{row.get(c, 0):>9}" for c in cols) + f" {sum(row.values()):>6}")
        for c in cols:
            total[c] += row.get(c, 0)
    rows.append(f"{'all':<{w}} " + " ".join(f"{total[c]:>9}" for c in cols) + f" {sum(total.values()):>6}")
    return "\n".join(rows)


def print_summary(fz: Fuzzer, quiet: bool) -> None:
    print(table(fz.counts))
    if fz.seed_failures:
        print("seed problems:\n  " + "\n  ".join(fz.seed_failures))
    by_sig = {}
    for r in fz.findings:
        by_sig.setdefault((r["reader"], r["outcome"], r["signature"]), 0)
        by_sig[(r["reader"], r["outcome"], r["signature"])] += 1
    if by_sig and not quiet:
        print("\nfindings by signature:")
        for (reader, outcome, sig), n in sorted(by_sig.items()):
            print(f"  {reader:>8} {outcome:<13} {n:>4}  {sig}"[:220])
    print(f"{sum(sum(r.values()) for r in fz.counts.values())} cases in {fz.seconds:.0f} s")


def write_summary_json(path: Path, fz: Fuzzer, finished: bool = True) -> None:
    """The counts so far (finished False: written every minute while a run goes on) or at the end."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps({
        "finished": finished, "code": fz.hash, "git": fz.__dict__.setdefault("git", _git_head()),
        "counts": fz.counts, "seed_failures": fz.seed_failures, "seconds": round(fz.seconds, 1),
        "command_seconds": fz.command_seconds, "kind_counts": fz.kind_counts,
        "findings": [{k: r[k] for k in ("reader", "outcome", "signature", "case", "seed", "mutation", "line")}
                     for r in fz.findings]}, indent=1))
    tmp.replace(path)


def write_markdown(path: Path, fz: Fuzzer, argv: list[str]) -> None:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in fz.findings:
        groups.setdefault((r["reader"], r["outcome"], r["signature"]), []).append(r)
    lines = ["# qconvert fuzz findings", "",
             f"Run: `{COMMAND} {' '.join(argv)}` at {time.strftime('%Y-%m-%d %H:%M')} "
             f"(code {fz.hash}, git {_git_head()}), {sum(sum(r.values()) for r in fz.counts.values())} cases "
             f"in {fz.seconds:.0f} s.", "", "```", table(fz.counts), "```", ""]
    if fz.seed_failures:
        lines += ["Seed problems:", ""] + [f"- {s}" for s in fz.seed_failures] + [""]
    for reader in sorted({k[0] for k in groups}):
        lines += [f"## {reader}", ""]
        for outcome in OUTCOMES[::-1]:
            sigs = sorted((k for k in groups if k[0] == reader and k[1] == outcome), key=lambda k: -len(groups[k]))
            if not sigs:
                continue
            lines += [f"### {outcome}", ""]
            for k in sigs:
                ex = min(groups[k], key=lambda r: r["case"])
                case = {x: ex[x] for x in ("reader", "seed", "case", "master_seed")}
                if ex.get("only"):
                    case["only"] = ex["only"]
                lines += [f"- **{k[2]}** ({len(groups[k])} case(s)); e.g. case {ex['case']}, seed `{ex['seed']}`: "
                          f"{ex['mutation']}", f"  - {ex['command']}: `{ex['line'][:240]}`",
                          f"  - reproduce: `{COMMAND} --replay '{json.dumps(case)}'`"]
            lines.append("")
    Path(path).write_text("\n".join(lines) + "\n")


def _git_head() -> str:
    try:
        import subprocess
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except Exception:
        return "?"


DOC_COLUMNS = ("exact", "changed", "refused", "noisy", "silent", "no-file", "traceback", "hang", "bad-refusal",
               "warning-first", "alloc", "error", "ok", "skipped")


def docs_table(summary: dict) -> str:
    """The markdown table of docs/fuzzing.md from a --summary-json file: per reader the cases, each outcome
    and the seconds its cases took in their children (the readers run interleaved, so the run's wall time
    is the total's)."""
    counts, secs = summary["counts"], summary.get("command_seconds", {})
    head = ["reader", "cases", *DOC_COLUMNS, "child s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = {c: 0 for c in DOC_COLUMNS}
    for reader in sorted(counts):
        row = counts[reader]
        rows.append(f"| {reader} | {sum(row.values())} | " + " | ".join(str(row.get(c, 0)) for c in DOC_COLUMNS)
                    + f" | {secs.get(reader, {}).get('case', 0):.0f} |")
        for c in DOC_COLUMNS:
            total[c] += row.get(c, 0)
    rows.append(f"| all | {sum(total.values())} | " + " | ".join(str(total[c]) for c in DOC_COLUMNS)
                + f" | wall {summary.get('seconds', 0):.0f} |")
    return "\n".join(rows)
