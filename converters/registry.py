"""Readers and writers register here under a name with aliases; the CLI reaches formats only from here."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import QConvertError

__all__ = ["FormatEntry", "register_format", "get_format", "all_formats", "normalize_name", "detect_format",
           "describe_data"]

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
    raise QConvertError(f"not a format qconvert reads: {describe_data(path)}; qconvert reads "
                        f"{', '.join(e.name for e in all_formats() if e.can_read)}", path=path)


def describe_data(path: Path) -> str:
    """What a path holds, in a few words, from its data (magic bytes, the config's quant_method), for
    messages about inputs no format claims."""
    path = Path(path)
    if path.is_file():
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError:
            return "an unreadable file"
        if head[:4] == b"GGUF":
            return "a GGUF file"
        if head[:2] == b"PK":
            return "a zip archive (a torch.save file?)"
        if len(head) >= 9 and head[8:9] == b"{":
            return "a safetensors file"
        return f"a file starting with bytes {head[:8].hex()}" if head else "an empty file"
    if not path.is_dir():
        return "neither a file nor a folder"
    config = path / "config.json"
    if config.is_file():
        from .validate import read_json

        try:
            cfg = read_json(config)
        except QConvertError:
            return "a folder whose config.json is not valid JSON"
        qc = cfg.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            return f"a checkpoint folder whose config.json quantization_config is not a JSON object ({qc!r:.40})"
        if isinstance(qc, dict) and qc:
            method = qc.get("quant_method", qc.get("method"))
            fmt = qc.get("format") or qc.get("checkpoint_format")
            what = f"quant_method {method!r}" + (f", format {fmt!r}" if isinstance(fmt, str) else "")
            return f"a checkpoint folder with {what}, which qconvert does not read yet"
        if not any(path.glob("*.safetensors")):
            return "a folder with a config.json but no .safetensors weights"
        return "a checkpoint folder"
    kinds = sorted({p.suffix for p in path.iterdir() if p.is_file() and p.suffix})
    return "a folder without config.json" + (f" (files: {', '.join(kinds[:6])})" if kinds else " (empty)")


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
