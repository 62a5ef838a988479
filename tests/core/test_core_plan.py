"""converters/plan.py: the one-line refusal of a plan that would lose information, and the verdict counts."""

from __future__ import annotations

import pytest

from qconvert.converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE
from qconvert.converters.errors import RefusedPlan
from qconvert.converters.plan import TensorPlan, check_plan, refusal_message, verdict_counts

SHAPE = (256, 128)


def plan(name: str, verdict: str, target: str = "Q4_K", reason: str = "", alternative: str = "") -> TensorPlan:
    return TensorPlan(name, SHAPE, "4-bit g128 sym", target, verdict, reason=reason, alternative=alternative)


def layer(i: int) -> str:
    return f"model.layers.{i}.mlp.up_proj.weight"


def test_nothing_blocked_is_no_refusal():
    plans = [plan("a", EXACT), plan("b", NEAR_EXACT, reason="scales rounded to f16")]
    assert refusal_message(plans, allow_requant=False) is None
    assert refusal_message([], allow_requant=False) is None
    check_plan(plans, allow_requant=False)  # and check_plan lets it through


def test_requantization_is_no_refusal_once_allowed():
    plans = [plan(layer(0), REQUANTIZE, reason="groups of 128 vs blocks of 256"), plan("b", EXACT)]
    assert refusal_message(plans, allow_requant=True) is None


def test_one_refused_tensor_is_named_with_its_reason():
    plans = [plan("model.embed_tokens.weight", EXACT),
             plan(layer(0), REFUSED, target="Q4_0", reason="rows of 100 are not whole blocks of 32")]
    line = "refused: model.layers.0.mlp.up_proj.weight cannot be stored as Q4_0: rows of 100 are not whole blocks of 32"
    assert refusal_message(plans, allow_requant=False) == line
    assert refusal_message(plans, allow_requant=True) == line  # --allow-requant cannot make it fit
    with pytest.raises(RefusedPlan) as info:
        check_plan(plans, allow_requant=True)
    assert str(info.value) == line


def test_a_refused_tensor_is_named_even_after_requantized_ones():
    plans = [plan(layer(0), REQUANTIZE, reason="needs requantization", alternative="--type q4_0 (exact)"),
             plan(layer(1), REFUSED, target="Q4_0", reason="rows of 100 are not whole blocks of 32")]
    assert refusal_message(plans, allow_requant=False) == (
        "refused: model.layers.1.mlp.up_proj.weight cannot be stored as Q4_0: rows of 100 are not whole blocks "
        "of 32; aligned choice: --type q4_0 (exact)")


def test_several_requantized_tensors_name_three_and_count_the_rest():
    alternatives = ["--type q8_0 (exact)", "--type q4_0 (exact)", "", "--type q8_0 (exact)", ""]
    plans = [plan(layer(i), REQUANTIZE, reason=f"groups of 128 vs blocks of 256 ({i})", alternative=a)
             for i, a in enumerate(alternatives)]
    plans.insert(2, plan("model.norm.weight", EXACT))
    line = ("refused: 5 tensor(s) would need lossy requantization to Q4_K (model.layers.0.mlp.up_proj.weight, "
            "model.layers.1.mlp.up_proj.weight, model.layers.2.mlp.up_proj.weight and 2 more: groups of 128 vs "
            "blocks of 256 (0)); aligned choice: --type q4_0 (exact) / --type q8_0 (exact); "
            "pass --allow-requant to accept the loss")
    assert refusal_message(plans, allow_requant=False) == line
    with pytest.raises(RefusedPlan) as info:
        check_plan(plans, allow_requant=False)
    assert str(info.value) == line


def test_three_requantized_tensors_are_all_named_and_no_alternative_gives_no_hint():
    plans = [plan(layer(i), REQUANTIZE, reason="no aligned type") for i in range(3)]
    assert refusal_message(plans, allow_requant=False) == (
        "refused: 3 tensor(s) would need lossy requantization to Q4_K (model.layers.0.mlp.up_proj.weight, "
        "model.layers.1.mlp.up_proj.weight, model.layers.2.mlp.up_proj.weight: no aligned type); "
        "pass --allow-requant to accept the loss")


def test_the_refusal_names_the_input_file_the_runner_set():
    refused = plan(layer(1), REFUSED, target="Q4_0", reason="rows of 100 are not whole blocks of 32")
    refused.source_file = "/m/model-00002-of-00002.safetensors"
    assert refusal_message([plan(layer(0), EXACT), refused], allow_requant=False) == (
        "refused: model.layers.1.mlp.up_proj.weight in /m/model-00002-of-00002.safetensors cannot be stored as "
        "Q4_0: rows of 100 are not whole blocks of 32")
    requantized = [plan(layer(i), REQUANTIZE, reason="no aligned type") for i in range(4)]
    for i, p in enumerate(requantized):
        p.source_file = f"/m/model-0000{1 + i // 2}-of-00003.safetensors"
    assert refusal_message(requantized, allow_requant=False) == (
        "refused: 4 tensor(s) in /m/model-00001-of-00003.safetensors (and 1 more file) would need lossy "
        "requantization to Q4_K (model.layers.0.mlp.up_proj.weight, model.layers.1.mlp.up_proj.weight, "
        "model.layers.2.mlp.up_proj.weight and 1 more: no aligned type); pass --allow-requant to accept the loss")


def test_verdict_counts_has_every_verdict_even_at_zero():
    assert verdict_counts([]) == {EXACT: 0, NEAR_EXACT: 0, REQUANTIZE: 0, REFUSED: 0}
    plans = [plan("a", EXACT), plan("b", EXACT), plan("c", REQUANTIZE), plan("d", "missing")]
    assert verdict_counts(plans) == {EXACT: 2, NEAR_EXACT: 0, REQUANTIZE: 1, REFUSED: 0, "missing": 1}
    assert verdict_counts(iter(plans)) == verdict_counts(plans)  # any iterable, read once
