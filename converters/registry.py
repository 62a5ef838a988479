"""Readers and writers register here under a name with aliases; the CLI reaches formats only from here."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import QConvertError

__all__ = ["FormatEntry", "register_format", "get_format", "all_formats", "normalize_name", "detect_format"]

# Every module (or subpackage) of qconvert.formats that calls register_format() is a format: a new
# format is one new module there, with no list to edit.
_FORMATS_PACKAGE = "qconvert.formats"


@dataclass
class FormatEntry:
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    open_reader: Callable | None = None  # (path, **options) -> ModelSource
    writer: object | None = None  # an object with the Writer interface (converters.plan)
    sniff: Callable | None = None  # (path) -> bool: is this path this format? (files and config, not names)
    extras: dict = field(default_factory=dict)

    @property
    def can_read(self) -> bool:
        return self.open_reader is not None

    @property
    def can_write(self) -> bool:
        return self.writer is not None


_REGISTRY: dict[str, FormatEntry] = {}
_ALIASES: dict[str, str] = {}
_loaded = False


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def register_format(entry: FormatEntry) -> FormatEntry:
    key = normalize_name(entry.name)
    if key in _REGISTRY and _REGISTRY[key] is not entry:
        raise ValueError(f"format {key!r} is already registered")
    _REGISTRY[key] = entry
    for alias in entry.aliases:
        a = normalize_name(alias)
        if _ALIASES.get(a, key) != key:
            raise ValueError(f"alias {a!r} already names format {_ALIASES[a]!r}")
        _ALIASES[a] = key
    return entry


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(_FORMATS_PACKAGE)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{_FORMATS_PACKAGE}.{info.name}")


def detect_format(path: Path) -> str:
    """The registered format whose sniff() claims `path`, or QConvertError.

    A specific format beats a generic one (`extras["generic"]`, e.g. `hf`, which any safetensors folder
    with a config.json resembles): an hqq or UQFF folder is also "a folder of safetensors"."""
    _load_builtin()
    path = Path(path)
    if not path.exists():
        raise QConvertError("no such file or directory", path=path)
    claims = [e for e in all_formats() if e.sniff is not None and e.sniff(path)]
    specific = [e for e in claims if not e.extras.get("generic")]
    if specific or claims:
        return (specific or claims)[0].name
    raise QConvertError("cannot tell the format of this path; name it with --format", path=path)


def get_format(name: str) -> FormatEntry:
    _load_builtin()
    key = normalize_name(name)
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise QConvertError(f"unknown format {name!r}; known formats: {known}")
    return _REGISTRY[key]


def all_formats() -> list[FormatEntry]:
    _load_builtin()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]
