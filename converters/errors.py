"""User-facing errors: one line, naming the file and the tensor, never a traceback."""

from __future__ import annotations

__all__ = ["QConvertError", "BadInput", "RefusedPlan"]


class QConvertError(Exception):
    """An error caused by the user's input or options. The CLI prints it as one line and exits 2."""

    def __init__(self, message: str, *, path: object | None = None, tensor: str | None = None):
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.detail = message
        where = ", ".join(p for p in (self.path, f"tensor {tensor}" if tensor else None) if p)
        super().__init__(printable(f"{where}: {message}" if where else message))


def printable(text: str) -> str:
    """The message as one printable line: names and values read from a damaged file can hold newlines,
    NULs or terminal escapes, which are shown escaped (\\n, \\x00) instead of written raw."""
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


_MAX_CHARS = 2000  # a name read from a damaged file can be megabytes long


class BadInput(QConvertError):
    """A checkpoint that is truncated, corrupt, inconsistent or unsupported."""


class RefusedPlan(QConvertError):
    """A conversion plan that would lose information the user has not agreed to lose."""
