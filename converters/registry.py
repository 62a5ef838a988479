"""Readers and writers register here under a name with aliases; the CLI reaches formats only from here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from .errors import QConvertError

__all__ = ["FormatEntry", "register_format", "get_format", "all_formats", "normalize_name"]

# Every module in this list registers its formats on import. A new format is one module and one line.
_FORMAT_MODULES = (
    "qconvert.formats.hf",
    "qconvert.formats.gptq",
    "qconvert.formats.gguf",
)


@dataclass
class FormatEntry:
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    open_reader: Callable | None = None  # (path, **options) -> ModelSource
    writer: object | None = None  # an object with the Writer interface (converters.plan)
    sniff: Callable | None = None  # (path) -> bool: does this path look like this format?
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
        for module in _FORMAT_MODULES:
            importlib.import_module(module)


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
