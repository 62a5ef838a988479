"""The command line: main parses the options, sets common.FIXTURES, hashes and preloads qconvert (before the
first fork), then runs the fuzzer and reports, or reruns one case (--replay) and shows what it did.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from . import common
from .child import child_case
from .common import DEFAULT_WORK, read_text
from .fuzzer import Fuzzer
from .report import print_summary, write_markdown, write_summary_json
from .seeds import READERS, Seed, seeds_for
from .tested_code import code_hash, preload_qconvert


def replay(args) -> int:
    text = args.replay
    if Path(text).exists():  # a kept case.json (indented) or a findings .jsonl (its first line)
        whole = Path(text).read_text().strip()
        try:
            json.loads(whole)
            text = whole
        except json.JSONDecodeError:
            text = whole.splitlines()[0]
    case = json.loads(text)
    reader = case["reader"]
    args.seed = case.get("master_seed", args.seed)
    args.mutations = case.get("only")
    args.replay_mode = True
    fz = Fuzzer(args)
    seeds = {s.name: s for s in seeds_for(reader, fz.work)}
    seed = seeds.get(case["seed"]) or (Seed(case["seed"], Path(case["seed_path"]),
                                             "file" if str(case.get("seed_path", "")).endswith(".gguf") else "dir")
                                        if case.get("seed_path") else None)
    if seed is None:
        print(f"seed {case['seed']!r} of reader {reader} not found; known: {sorted(seeds)}", file=sys.stderr)
        return 2
    fz.seed_of[(reader, seed.name)] = seed
    job = fz.case_job(reader, seed, int(case["case"]))
    fz.pool.submit(job, child_case, fz.on_case)
    while fz.pool.running or fz.ref_queue:
        fz._submit_refs()
        fz.pool.drain()
    o, meta, res = fz.last
    case_dir = Path(job["dir"])
    print(f"reader {reader}, seed {seed.name} ({seed.path}), case {case['case']}, master seed {args.seed}")
    print(f"mutation [{meta.get('kind')}]: {meta.get('mutation')} (structural: {meta.get('structural')})")
    for c in res.get("commands", []):
        print(f"\n$ qconvert {' '.join(c['argv'])}\n-> exit {c['rc']} in {c['seconds']} s")
        err = read_text(case_dir / f"{c['name']}.err")
        if err.strip():
            print(err.rstrip()[-6000:])
    for extra in ("hang.txt", "crash.txt"):
        text = read_text(case_dir / extra)
        if text.strip():
            print(f"\n{extra}:\n{text.rstrip()[-4000:]}")
    print(f"\noutcome: {o.outcome} {o.signature}\n{o.line}")
    print(f"case folder (mutated input in {case_dir / 'in'}): {case_dir}")
    return 0 if o.outcome in ("ok", "exact", "changed", "refused") else 1


def replay_findings(args) -> int:
    """Rerun every case of a findings .jsonl with this code (after a fix): one line per case, old outcome ->
    new; exit 1 when any still ends in a defect."""
    from .classify import DEFECTS

    still = 0
    args.quiet = True
    for line in Path(args.replay_findings).read_text().splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        args.seed = case.get("master_seed", args.seed)
        args.mutations = case.get("only")
        args.replay_mode = True
        fz = Fuzzer(args)
        seed = {s.name: s for s in seeds_for(case["reader"], fz.work)}.get(case["seed"])
        if seed is None:
            print(f"{case['reader']} #{case['case']} {case['seed']}: seed not found")
            still += 1
            continue
        fz.seed_of[(case["reader"], seed.name)] = seed
        job = fz.case_job(case["reader"], seed, int(case["case"]))
        fz.pool.submit(job, child_case, fz.on_case)
        while fz.pool.running or fz.ref_queue:
            fz._submit_refs()
            fz.pool.drain()
        o = fz.last[0]
        still += o.outcome in DEFECTS
        print(f"{case['reader']} #{case['case']} {case['seed']}: {case['outcome']} -> {o.outcome}: {o.line[:200]}",
              flush=True)
        shutil.rmtree(fz.cases_dir, ignore_errors=True)
    return 1 if still else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=PACKAGE_DOC.splitlines()[0])
    ap.add_argument("--readers", default=",".join(READERS), help=f"comma-separated, of {', '.join(READERS)}")
    ap.add_argument("--cases", type=int, default=100, help="cases per reader")
    ap.add_argument("--seed", type=int, default=0, help="master seed")
    ap.add_argument("--jobs", type=int, default=2, help="parallel forked children")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case (over it: hang)")
    ap.add_argument("--findings", help="write every finding as a JSON line here")
    ap.add_argument("--report-md", help="write the findings grouped by reader, outcome and signature (markdown)")
    ap.add_argument("--summary-json", help="write the counts and seed problems as JSON")
    ap.add_argument("--keep", help="copy every failing case (mutated input, stderr) into this folder")
    ap.add_argument("--work", default=str(DEFAULT_WORK), help="cache of GGUF seeds and seed references")
    ap.add_argument("--targets", default="hf,gguf", help="conversions run per case after inspect: hf (--type f32, "
                    "always; compared with the seed's for silent corruption) and gguf (--type f16)")
    ap.add_argument("--inspect", action=argparse.BooleanOptionalAction, default=True,
                    help="run `qconvert inspect` on every case before the conversions (--no-inspect: faster)")
    ap.add_argument("--fixtures", default=str(common.FIXTURES), help="the test fixtures folder the seeds come from")
    ap.add_argument("--max-seeds", type=int, default=0, help="use only the first K seeds of each reader")
    ap.add_argument("--mutations", help="only mutation kinds matching this regex (e.g. 'gguf|cfg')")
    ap.add_argument("--replay", help="rerun one case: a findings JSON line, a file holding one, or a case JSON")
    ap.add_argument("--table", metavar="SUMMARY_JSON", help="print docs/fuzzing.md's table of a --summary-json file")
    ap.add_argument("--replay-findings", metavar="FINDINGS_JSONL", help="rerun every case of a --findings file")
    ap.add_argument("--verbose", action="store_true", help="print every case")
    ap.add_argument("--quiet", action="store_true", help="print only the table")
    args = ap.parse_args(argv)
    args.replay_mode = False
    if args.table:
        from .report import docs_table

        print(docs_table(json.loads(Path(args.table).read_text())))
        return 0
    common.FIXTURES = Path(args.fixtures).resolve()  # before any seed is looked up or child forked

    code = code_hash()  # of the code preloaded next
    preload_qconvert()

    args.code_hash = code
    if args.replay:
        return replay(args)
    if args.replay_findings:
        return replay_findings(args)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    unknown = [r for r in readers if r not in READERS]
    if unknown:
        ap.error(f"unknown readers {unknown}; known: {', '.join(READERS)}")
    fz = Fuzzer(args)
    fz.run(readers, args.cases)
    print_summary(fz, args.quiet)
    if args.report_md:
        write_markdown(Path(args.report_md), fz, sys.argv[1:] if argv is None else list(argv))
    if args.summary_json:
        write_summary_json(Path(args.summary_json), fz)
    return 0
