"""Readers and writers register here under a name with aliases; the CLI reaches formats only from here."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import QConvertError

__all__ = ["FormatEntry", "OptionSpec", "OPTION_KINDS", "register_format", "get_format", "all_formats",
           "normalize_name", "detect_format", "describe_data", "declared_options"]

# Every module (or subpackage) of qconvert.formats that calls register_format() is a format: a new
# format is one new module there, with no list to edit.
_FORMATS_PACKAGE = "qconvert.formats"


# how the CLI reads an option's value: a path (passed on as str), a size such as 2G (bytes, int), one of
# `choices`, or plain text
OPTION_KINDS = ("path", "size", "choice", "text", "flag")  # flag: on when given (Options.extra[key] True)


@dataclass(frozen=True)
class OptionSpec:
    """A writer-specific command-line option a format accepts as a conversion *target*: the CLI offers the
    union of every format's options and refuses one the chosen target does not declare, so no option is
    silently ignored. Its parsed value goes into `Options.extra[key]`."""
    flag: str  # "--imatrix"
    key: str  # the Options.extra key the writer reads
    kind: str = "text"  # one of OPTION_KINDS
    help: str = ""
    metavar: str = ""
    choices: tuple[str, ...] = ()  # kind "choice" only

    def __post_init__(self):
        if not self.flag.startswith("--"):
            raise ValueError(f"option flag {self.flag!r} must start with --")
        if self.kind not in OPTION_KINDS:
            raise ValueError(f"option {self.flag}: kind {self.kind!r} is not one of {', '.join(OPTION_KINDS)}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"option {self.flag}: choices go with kind 'choice' (and it needs them)")


@dataclass
class FormatEntry:
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    open_reader: Callable | None = None  # (path, **options) -> ModelSource
    writer: object | None = None  # an object with the Writer interface (converters.plan)
    sniff: Callable | None = None  # (path) -> bool: is this path this format? (files and config, not names)
    extras: dict = field(default_factory=dict)
    # CLI facts, as a target: its writer-specific options, the vocabulary of --type, example command lines
    options: tuple[OptionSpec, ...] = ()
    type_help: str = ""
    examples: tuple[str, ...] = ()

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
    aliases = [normalize_name(alias) for alias in entry.aliases]
    for a in aliases:  # every check before any change: a refused registration leaves the registry as it was
        if _ALIASES.get(a, key) != key:
            raise ValueError(f"alias {a!r} already names format {_ALIASES[a]!r}")
        if a in _REGISTRY and a != key:
            raise ValueError(f"alias {a!r} is the name of format {a!r}")
    _REGISTRY[key] = entry
    for a in aliases:
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


def declared_options() -> dict[str, tuple[OptionSpec, tuple[str, ...]]]:
    """Every writer-specific option any format declares: flag -> (spec, the formats declaring it). Formats
    may share a flag only with the same spec, since the CLI offers one option for it."""
    found: dict[str, tuple[OptionSpec, tuple[str, ...]]] = {}
    for entry in all_formats():
        for spec in entry.options:
            known, names = found.get(spec.flag, (spec, ()))
            if known != spec:
                raise ValueError(f"option {spec.flag} is declared differently by {names[0]} and {entry.name}")
            found[spec.flag] = (spec, names + (entry.name,))
    return found
