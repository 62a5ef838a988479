"""Checked access to the JSON files a checkpoint carries (config.json, quantize_config.json, tokenizer.json,
indexes): bounded parsing and typed, range-checked values, each failure a one-line `BadInput` naming the
file and the key.

A config value reaches arithmetic and loops (`range(num_hidden_layers)`, `hidden_size // num_heads`), so a
wrong type or a huge number must stop here, before anything loops or allocates:

    cfg = ConfigView(read_json(path), path)
    n_layers = cfg.int("num_hidden_layers", lo=1, hi=MAX_LAYERS)
    eps = cfg.float("rms_norm_eps", default=1e-6, lo=0.0, hi=1.0)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from .errors import BadInput

__all__ = ["read_json", "parse_json", "json_kind", "ConfigView", "REQUIRED", "MAX_JSON_BYTES", "MAX_JSON_DEPTH",
           "check_side_files", "MAX_SIDE_FILE_BYTES"]

MAX_JSON_BYTES = 256 * 1024 * 1024  # a tokenizer.json of a 256k vocabulary is ~20 MB; an index a few MB
MAX_JSON_DEPTH = 64  # real configs nest 4-6 deep, tokenizer.json ~8
MAX_NUMBER_CHARS = 64  # a 5,000-digit integer costs quadratic time to parse and means nothing here


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


def _too_deep(data: Any) -> bool:
    """True when containers nest deeper than MAX_JSON_DEPTH (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise ValueError(f"a number of {len(text)} characters")
        return kind(text)
    return parse


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str, path: object) -> Any:
    """Parse JSON text with bounded depth and number length, rejecting NaN/Infinity; BadInput on failure."""
    deep = BadInput(f"not valid JSON (nested deeper than {MAX_JSON_DEPTH} levels)", path=path)
    try:
        data = json.loads(text, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except json.JSONDecodeError as e:
        msg = e.msg.removesuffix(" at")  # json's "Unterminated string starting at" names its position itself
        raise BadInput(f"not valid JSON ({msg} at line {e.lineno} column {e.colno})", path=path) from None
    except RecursionError:  # json's scanner stops at the interpreter's recursion limit
        raise deep from None
    except ValueError as e:
        raise BadInput(f"not valid JSON ({e})", path=path) from None
    if isinstance(data, (dict, list)) and _too_deep(data):
        raise deep
    return data


def read_json(path: Path, *, expect: type | None = dict, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read a JSON file; `expect` is the type of the top-level value (None: any)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BadInput(f"JSON file of {size} bytes is larger than the {max_bytes} this reader accepts", path=path)
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BadInput("file not found", path=path) from None
    except IsADirectoryError:
        raise BadInput("is a directory, expected a JSON file", path=path) from None
    except OSError as e:
        raise BadInput(f"cannot read file ({e.strerror or type(e).__name__})", path=path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"not valid JSON (not UTF-8 at byte {e.start})", path=path) from None
    data = parse_json(text, path)
    if expect is not None and not isinstance(data, expect):
        want = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise BadInput(f"expected {want}, found {json_kind(data)}", path=path)
    return data


def json_kind(value: Any) -> str:
    """How a JSON value reads in a message: "an object", "a string", "null"..."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ConfigView:
    """Typed, range-checked reads from one JSON object; `prefix` names where it sits in the file."""

    def __init__(self, data: Any, path: object, prefix: str = ""):
        if not isinstance(data, dict):
            where = prefix.rstrip(".") or "the file"
            raise BadInput(f"{where} is {json_kind(data)}, expected a JSON object", path=path)
        self.data = data
        self.path = path
        self.prefix = prefix

    def _bad(self, key: str, value: Any, expected: str) -> BadInput:
        return BadInput(f"{self.prefix}{key} is {_show(value)}: expected {expected}", path=self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def _value(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value); a missing key without a default is an error."""
        if key in self.data and self.data[key] is not None:
            return True, self.data[key]
        if default is REQUIRED:
            if key in self.data:
                return True, None  # present but null: let the typed check name it
            raise BadInput(f"{self.prefix}{key} is missing", path=self.path)
        return False, default

    def int(self, key: str, default: Any = REQUIRED, *, lo: int | None = None, hi: int | None = None) -> Any:
        present, v = self._value(key, default)
        if not present:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, v, _range("an integer", lo, hi))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(key, v, _range("an integer", lo, hi))
        return v

    def float(self, key: str, default: Any = REQUIRED, *, lo: float | None = None, hi: float | None = None) -> Any:
        present, v = self._value(key, default)
        if not present:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(key, v, _range("a number", lo, hi))
        v = float(v)
        if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(key, v, _range("a finite number", lo, hi))
        return v

    def str(self, key: str, default: Any = REQUIRED, *, choices=None) -> Any:
        present, v = self._value(key, default)
        if not present:
            return v
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        if choices is not None and v not in choices:
            raise self._bad(key, v, "one of " + ", ".join(map(repr, choices)))
        return v

    def bool(self, key: str, default: Any = REQUIRED) -> Any:
        present, v = self._value(key, default)
        if not present:
            return v
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def list(self, key: str, default: Any = REQUIRED) -> Any:
        present, v = self._value(key, default)
        if not present:
            return v
        if not isinstance(v, list):
            raise self._bad(key, v, "a list")
        return v

    def str_list(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of strings (config.json's `architectures`: class names)."""
        v = self.list(key, default)
        if isinstance(v, list) and not all(isinstance(x, str) for x in v):
            raise self._bad(key, v, "a list of strings")
        return v

    def view(self, key: str, default: Any = REQUIRED) -> "ConfigView | Any":
        """A nested object as a ConfigView (missing with a default: the default, e.g. None)."""
        present, v = self._value(key, default)
        if not present:
            return v if not isinstance(v, dict) else ConfigView(v, self.path, f"{self.prefix}{key}.")
        if not isinstance(v, dict):
            raise self._bad(key, v, "a JSON object")
        return ConfigView(v, self.path, f"{self.prefix}{key}.")


def _range(what: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{what} in [{lo}, {hi}]"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


# A side file (tokenizer.model, merges.txt, a chat template) is a few MB at most; one beyond this is not one.
MAX_SIDE_FILE_BYTES = 1 << 30


def check_side_files(files: Mapping[str, Path]) -> None:
    """The files a converted model carries beside its weights (tokenizer, generation config, chat template),
    checked before the output is created: its runtime parses them when it loads the model, so a copy of a
    truncated or null tokenizer.json would leave a model nothing can load. A JSON file must parse (bounded by
    read_json) into an object, with the keys its loaders dereference of the right type; any other file must be
    a regular file of a sane size (stat only: it is copied, never parsed here)."""
    for name, path in files.items():
        path = Path(path)
        if name.endswith(".json"):
            _check_side_keys(name, read_json(path), path)
            continue
        try:
            info = path.stat()
        except OSError as e:
            raise BadInput(f"cannot read file ({e.strerror or type(e).__name__})", path=path) from None
        if not path.is_file():
            raise BadInput("is not a regular file, expected a tokenizer or template file", path=path)
        if info.st_size > MAX_SIDE_FILE_BYTES:
            raise BadInput(f"file of {info.st_size} bytes is larger than the {MAX_SIDE_FILE_BYTES} a tokenizer or "
                           "template file can be", path=path)


def _check_side_keys(name: str, data: dict, path: Path) -> None:
    """The keys of a side JSON file that its loaders read without a check of their own: tokenizer.json's
    `model` (the tokenizers library deserializes it whole), and a chat template (a string, or the list of
    named templates tokenizer_config.json may hold)."""
    view = ConfigView(data, path)
    if name == "tokenizer.json":
        view.view("model")
    if name in ("tokenizer_config.json", "chat_template.json"):
        template = view.get("chat_template")
        if template is not None and not isinstance(template, (str, list)):
            raise view._bad("chat_template", template, "a string or a list of named templates")
