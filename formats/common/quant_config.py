"""The reader preamble every quantized checkpoint folder shares: config.json read (bounded, checked), its
`quantization_config` split off the model's config, and the values producers write in it read as their own
loaders read them."""

from __future__ import annotations

from ...converters.errors import BadInput
from ...converters.validate import REQUIRED, ConfigView


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
