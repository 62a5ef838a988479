"""Atomic output: a conversion writes under a temporary name beside OUT and renames it into place only when
every tensor is written, so that a failed or killed run leaves nothing at OUT; temporaries of killed runs are
removed by the next run in the same folder."""

from __future__ import annotations

import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from .errors import QConvertError

__all__ = ["atomic_output", "remove_stale_temporaries"]


@contextmanager
def atomic_output(out: Path, is_file: bool, force: bool, several_files: bool = False):
    """Yield a temporary path next to `out`; rename it to `out` only if the block succeeds.

    `several_files`: the writer may write more files next to `out` than `out` itself (split GGUF
    parts named after it). It gets `<temporary folder>/<out's name>` and writes every file in that
    folder; only when all are written are they renamed next to `out`, after checking that none would
    replace an existing file without `force`."""
    out = Path(out)
    if out.exists() and not force:
        raise QConvertError("output exists; pass --force to replace it", path=out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = out.with_name(f".{out.name}{_TMP_MARK}{_HOST}-{os.getpid()}")
    _remove(tmp)
    if not is_file or several_files:
        tmp.mkdir()
    try:
        if not several_files:
            yield tmp
            if out.exists():
                _remove(out)
            os.replace(tmp, out)
            return
        yield tmp / out.name
        written = sorted(tmp.iterdir())
        clashes = [out.with_name(p.name) for p in written if out.with_name(p.name).exists()]
        if clashes and not force:
            raise QConvertError("output exists; pass --force to replace it", path=clashes[0])
        for p in written:
            _remove(out.with_name(p.name))
            os.replace(p, out.with_name(p.name))
    finally:
        _remove(tmp)


# A temporary output is `.<out name>.qconvert-tmp-<host>-<pid>`: a run killed with SIGKILL cannot remove
# its own, so every run removes those beside its output whose process (on this host) is gone.
_TMP_MARK = ".qconvert-tmp-"
_HOST = socket.gethostname().replace("-", "_") or "host"
_TMP_NAME = re.compile(r"^\..+\.qconvert-tmp-(?P<host>[^-]+)-(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries in `folder` left by qconvert runs on this host whose process no longer
    exists (killed runs); those of live runs, and of other hosts sharing the folder, stay."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_NAME.match(entry.name)
        if m and m["host"] == _HOST and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
