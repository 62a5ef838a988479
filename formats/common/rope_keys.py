"""transformers 5 keeps a model's rope settings in one `rope_parameters` dict; runtimes whose model configs were
written against transformers 4's config.json (mistral.rs 0.9.5, mlx-lm 0.32) read the same values at the top
level (`rope_theta`, `partial_rotary_factor`) and a non-default rope under `rope_scaling`. A writer for such a
runtime lifts them out, leaving `rope_parameters` as it is (transformers 5 reads the folder the same way)."""

from __future__ import annotations

__all__ = ["with_top_level_rope"]


def with_top_level_rope(config: dict, keys: tuple[str, ...] = ("rope_theta",), scaling: bool = False) -> dict:
    """`config` with each of `keys` that `rope_parameters` holds copied to the top level where absent there,
    and, with `scaling`, `rope_scaling` set where absent: a non-default `rope_parameters`' copy, else null."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return config
    out = dict(config)
    for key in keys:
        if key not in out and key in rope:
            out[key] = rope[key]
    if scaling and out.get("rope_scaling") is None:
        # null for the default rope: some of mlx-lm's configs (EXAONE 4's) require the key
        out["rope_scaling"] = dict(rope) if rope.get("rope_type", "default") != "default" else None
    return out
