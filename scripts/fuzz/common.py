"""What the fuzzer's modules share: the repository, the fixtures folder, MB, read_text.

FIXTURES is the one piece of state set at run time: cli.main sets it from --fixtures before any seed is
looked up (and before any child is forked, which inherits it). Read it as `common.FIXTURES` at call time,
never with `from .common import FIXTURES` (that copy would keep the default).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "_fixtures"
DEFAULT_WORK = Path(tempfile.gettempdir()) / f"qconvert-fuzz-{os.getuid()}"
MB = 1024 * 1024


def read_text(path: Path) -> str:
    """A file a child wrote, "" when it is not there."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
