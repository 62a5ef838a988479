"""The reader preamble every checkpoint folder shares: config.json read once (bounded, checked), the model's
config with its quantization keys split off, the quantization config as a typed view (config.json's
`quantization_config`, or the file beside it a producer writes instead), and values producers write in it
read as their own loaders read them. Each reader then checks its own quant_method and fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...converters.errors import BadInput
from ...converters.validate import REQUIRED, ConfigView, read_json

__all__ = ["CheckpointConfig", "read_config", "config_bits", "without_quantization_config", "MAX_BITS"]


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint folder's config.json: `raw` as the file holds it, `path` the file (named in refusals)."""

    raw: dict
    path: Path
    quant_keys: tuple[str, ...] = ("quantization_config",)  # the keys that describe the quantization, not the model

    @property
    def model(self) -> dict:
        """The model's config without its quantization keys: what a writer carries into its output."""
        return {k: v for k, v in self.raw.items() if k not in self.quant_keys}

    def quantization(self, fallback: str | None = None) -> ConfigView | None:
        """config.json's quantization_config as a typed view (prefix "quantization_config."), or, when it is
        absent or empty and the `fallback` file beside config.json exists (gptqmodel's quantize_config.json),
        that file's object (prefix ""); None (or the empty view) when there is none."""
        qc = ConfigView(self.raw, self.path).view("quantization_config", default=None)
        if (qc is None or not qc.data) and fallback and (self.path.parent / fallback).exists():
            where = self.path.parent / fallback
            qc = ConfigView(read_json(where), where)
        return qc


def read_config(folder: Path, quant_keys: tuple[str, ...] = ("quantization_config",)) -> CheckpointConfig:
    """config.json of a checkpoint folder (BadInput naming it when it is missing, too large or not an object)."""
    where = Path(folder) / "config.json"
    return CheckpointConfig(read_json(where), where, quant_keys)


MAX_BITS = 16  # what a module's bits may say before the supported widths are checked at its tensors


def config_bits(view: ConfigView, key: str = "bits", default=REQUIRED) -> int:
    """A bit width as gptqmodel reads one (_normalize_quant_bits): an integer, an integral float or a
    string of digits ("4"); anything else (a list, "four", true) is refused naming the key."""
    value = view.get(key)
    if isinstance(value, str) and value.strip().isdigit() and len(value) <= 4:
        return _in_range(view, key, int(value))
    if isinstance(value, float) and value.is_integer():
        return _in_range(view, key, int(value))
    return view.int(key, default=default, lo=1, hi=MAX_BITS)


def _in_range(view: ConfigView, key: str, bits: int) -> int:
    if not 1 <= bits <= MAX_BITS:
        raise BadInput(f"{view.prefix}{key} is {bits}: expected an integer in [1, {MAX_BITS}]", path=view.path)
    return bits


def without_quantization_config(obj):
    """A config with every `quantization_config` key dropped, at any depth: mistral.rs drops them all, so a
    UQFF folder's config is read and written without them."""
    if isinstance(obj, dict):
        return {k: without_quantization_config(v) for k, v in obj.items() if k != "quantization_config"}
    if isinstance(obj, list):
        return [without_quantization_config(v) for v in obj]
    return obj
