"""A finished child's files (case.json, result.json, the commands' stderr, hang.txt, crash.txt) -> its
outcome and a signature that groups equal findings; OUTCOMES in order of severity (a case takes its worst
command's); compare_digests and compared_outcome turn an exit 0 into `exact`, `changed` or
`silent`.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from .common import MB, REPO, read_text

# exit 0 is `exact` (every output tensor equal to the seed's conversion), `changed` (a data mutation -- bytes
# of a tensor, which no reader can tell from other values -- changed some) or `silent` (any other mutation
# changed some: it should have been refused); `ok` is an exit 0 that could not be compared (the seed's own
# conversion failed, reported as a seed problem)
OUTCOMES = ("skipped", "ok", "exact", "changed", "refused", "noisy", "silent", "warning-first", "no-file",
            "bad-refusal", "traceback", "hang", "alloc", "error")
SEVERITY = {o: i for i, o in enumerate(OUTCOMES)}
DEFECTS = ("silent", "warning-first", "no-file", "bad-refusal", "traceback", "hang", "alloc", "error")
FINDING_OUTCOMES = DEFECTS + ("noisy",)


LIBRARY_TEXT = re.compile(
    r"Traceback|<class |\b[A-Z]\w*(?:Error|Exception|Warning)\b|deserializ|MetadataIncompleteBuffer|HeaderTooLarge|"
    r"InvalidHeader|InvalidOffset|out of bounds|unpack requires|invalid load key|PytorchStreamReader|"
    r"DefaultCPUAllocator|Weights only load failed|cannot reshape|index out of range|not enough values to unpack|"
    r"has no attribute|not subscriptable|unsupported operand|invalid literal for|codec can't decode|"
    r"object is not|positional argument|unexpected keyword|must be real number|division by zero|"
    r"math domain error|buffer size|WeightsUnpickler|GLOBAL |Unsupported global|expected str, bytes|"
    r"not supported between instances|object cannot be interpreted|can't multiply sequence")
ALLOC_TEXT = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|Unable to allocate|"
                        r"memory allocation of \d+ bytes failed|std::bad_alloc|out of memory|OutOfMemory")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)', re.M)


def _rel_repo(path: str) -> str | None:
    try:
        p = Path(path).resolve()
        rel = p.relative_to(REPO)
    except (ValueError, OSError):
        return None
    if rel.parts[:1] in (("scripts",), ("tests",)) or ".venv" in rel.parts:
        return None
    return str(rel)


def tb_signature(text: str, most_recent_first: bool = False) -> tuple[str, str]:
    """(exception line, "ExcType at file:function" of the innermost qconvert frame)."""
    frames = [(m["file"], m["func"], m["line"]) for m in _FRAME.finditer(text)]
    if most_recent_first:
        frames = frames[::-1]
    ours = [(r, fn, ln) for f, fn, ln in frames if (r := _rel_repo(f))]
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    exc = next((ln for ln in reversed(lines) if not ln.startswith((" ", "\t")) and ":" in ln
                and not ln.startswith(("File", "Traceback", "Thread", "Current thread", "Fatal"))), lines[-1] if lines else "")
    etype = exc.split(":", 1)[0].strip() if exc else "?"
    where = f"{ours[-1][0]}:{ours[-1][1]}" if ours else (f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else "?")
    return exc.strip()[:300], f"{etype} at {where}"


def _normalize(msg: str, root: str) -> str:
    msg = msg.replace(root, "IN")
    msg = re.sub(r"\((?:[^()]|\([^()]*\))*\)", "(…)", msg)  # what a message quotes in parentheses: the example shows it
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:160]


@dataclass
class Outcome:
    outcome: str
    command: str = ""
    line: str = ""
    signature: str = ""


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def classify_command(name: str, rc: int | None, err: str, root: str, target: Path | None, case_dir: Path) -> Outcome:
    lines = [ln.rstrip("\r") for ln in err.split("\n") if ln.strip()]  # lines as a terminal shows them
    if ALLOC_TEXT.search(err):
        exc, sig = tb_signature(err)
        first = next((ln for ln in lines if ALLOC_TEXT.search(ln)), exc)
        return Outcome("alloc", name, first[:300], sig if "at ?" not in sig else _normalize(first, root))
    if rc == 0:
        if lines:
            return Outcome("noisy", name, lines[0][:300], "stderr on success: " + _normalize(lines[0], root))
        return Outcome("ok", name)
    if rc == 2:
        idx = next((i for i, ln in enumerate(lines) if ln.startswith("qconvert: error: ")), None)
        if idx is None:
            return Outcome("bad-refusal", name, (lines[-1] if lines else "")[:300],
                           "no `qconvert: error:` line: " + _normalize(lines[-1] if lines else "", root))
        line = lines[idx]
        msg = line[len("qconvert: error: "):]
        detail = msg.split(": ", 1)[1] if root in msg.split(": ", 1)[0] and ": " in msg else msg
        if idx > 0:
            return Outcome("warning-first", name, lines[0][:300], "before the error: " + _normalize(lines[0], root))
        if len(lines) > 1:
            return Outcome("bad-refusal", name, line[:300], "several lines: " + _normalize(detail, root))
        if _CONTROL.search(msg):
            return Outcome("bad-refusal", name, line[:300], "control characters in the message: " +
                           _normalize(_CONTROL.sub("?", detail), root)[:60])
        if LIBRARY_TEXT.search(msg):
            return Outcome("bad-refusal", name, line[:300], "library text: " + _normalize(detail, root))
        if root not in msg:
            return Outcome("no-file", name, line[:300], "names no input file: " + _normalize(msg, root))
        if target is not None:
            left = [p.name for p in case_dir.iterdir() if ".qconvert-tmp-" in p.name and target.name in p.name]
            if target.exists() or left:
                return Outcome("bad-refusal", name, line[:300],
                               f"left output behind ({target.name if target.exists() else left[0]})")
        return Outcome("refused", name, line[:300], _normalize(detail, root))
    exc, sig = tb_signature(err)
    debug = read_text(case_dir / f"{name}.debug.err")
    if _FRAME.search(debug):  # the same command with --debug: the exception and its innermost qconvert frame
        _, sig = tb_signature(debug)
    if rc is None:
        return Outcome("traceback", name, exc or "crashed", sig)
    return Outcome("traceback", name, (lines[-1] if lines else exc or f"exit {rc}")[:300], sig if exc else f"exit {rc}")


def classify_case(case_dir: Path, status: int | None, rusage, killed: bool) -> tuple[Outcome, dict, dict]:
    meta = json.loads(read_text(case_dir / "case.json") or "{}")
    res = json.loads(read_text(case_dir / "result.json") or "{}")
    root = str(case_dir / "in")
    hang = read_text(case_dir / "hang.txt")
    crash = read_text(case_dir / "crash.txt")
    done = {c["name"]: c for c in res.get("commands", [])}
    names = [n for n in ("inspect", "convert", "to-gguf") if (case_dir / f"{n}.err").exists()]
    current = names[-1] if names else "setup"
    if meta.get("skip"):
        return Outcome("skipped", "", meta["skip"], "skipped"), meta, res
    if not meta:  # the fuzzer itself failed before the case ran (copying or mutating the seed)
        exc, sig = tb_signature(read_text(case_dir / "setup.err"))
        return Outcome("error", "setup", exc or "no case.json", "fuzzer: " + sig), meta, res
    if hang.strip() or killed:
        _, sig = tb_signature(hang, most_recent_first=True) if hang.strip() else ("", "killed")
        return Outcome("hang", current, "over the time bound", "hang: " + sig.split(" at ", 1)[-1]), meta, res
    worst = Outcome("ok")
    for n in names:
        err = read_text(case_dir / f"{n}.err")
        if n in done:
            o = classify_command(n, done[n]["rc"], err, root, Path(done[n]["out"]) if done[n].get("out") else None,
                                 case_dir)
        else:  # the child died in this command
            sig_no = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
            text = err + "\n" + crash
            if ALLOC_TEXT.search(text):
                o = classify_command(n, None, text, root, None, case_dir)
            else:
                exc, sig = tb_signature(crash or err, most_recent_first=bool(crash))
                what = f"killed by {signal.Signals(sig_no).name}" if sig_no else f"child exit {os.WEXITSTATUS(status) if status is not None else '?'}"
                o = Outcome("traceback", n, f"{what} {exc}".strip()[:300], f"{what} at {sig.split(' at ', 1)[-1]}")
        if SEVERITY[o.outcome] > SEVERITY[worst.outcome]:
            worst = o
    growth = res.get("rss_growth")
    if growth is None and rusage is not None:
        growth = None  # ru_maxrss includes the forked parent's pages; only the child's own reading counts
    bound = res.get("bound", 512 * MB)
    if growth is not None and growth > bound and SEVERITY[worst.outcome] < SEVERITY["alloc"]:
        worst = Outcome("alloc", current, f"RSS grew by {growth // MB} MB (bound {bound // MB} MB)",
                        f"rss growth {meta.get('kind')}")
    return worst, meta, res


def compare_digests(ref: dict, got: dict) -> str | None:
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    differ = sorted(k for k in set(ref) & set(got) if ref[k] != got[k])
    if not (missing or extra or differ):
        return None
    parts = []
    for what, names in (("missing", missing), ("extra", extra), ("differ", differ)):
        if names:
            parts.append(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return "; ".join(parts)


def compared_outcome(worst: Outcome, meta: dict, diff: str | None) -> Outcome:
    """An exit-0 case's outcome once its output was compared with the seed's (diff None: every tensor equal)."""
    if worst.outcome == "ok":
        worst = Outcome("exact" if not diff else "changed" if not meta.get("structural") else "ok",
                        worst.command, diff[:300] if diff else "", worst.signature)
    if diff and meta.get("structural") and SEVERITY[worst.outcome] < SEVERITY["silent"]:
        return Outcome("silent", "convert", diff[:300], f"silent {meta.get('kind')}: " +
                       "; ".join(re.sub(r"^\d+ ", "", part.split(" (")[0]) for part in diff.split("; ")))
    return worst
