import pytest

import vtoken
from vtoken.budget import tokens_to_keep
from vtoken.errors import (
    MissingSignalError,
    UnknownMethodError,
    UnsupportedModelError,
    VTokenError,
)


@pytest.mark.parametrize(
    "budget, n, k",
    [
        (0.5, 576, 288),
        (0.25, 576, 144),
        (0.1, 576, 58),
        (0.05, 576, 29),
        (1.0, 576, 576),
        (1e-9, 576, 1),
        (0.125, 4, 1),
        (0.375, 4, 2),
        (144, 576, 144),
        (576, 576, 576),
        (10_000, 576, 576),
        (1, 576, 1),
    ],
)
def test_tokens_to_keep_rounds_half_up(budget, n, k):
    assert tokens_to_keep(budget, n) == k


def _assert_untouched(model):
    assert vtoken.handle_of(model) is None
    assert "generate" not in model.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize(
    "method, params, error, words",
    [
        ("no-such-method", {}, UnknownMethodError, ["no-such-method", "fastervlm", "random", "pool"]),
        ("pool", {"bogus": 1}, VTokenError, ["bogus", "budget"]),
        ([], {}, VTokenError, ["non-empty"]),
        (42, {}, VTokenError, ["42"]),
    ],
)
def test_bad_patch_calls_raise_and_leave_model_unpatched(llava, method, params, error, words):
    model = llava[0]
    with pytest.raises(error) as err:
        vtoken.patch(model, method, **params)
    for word in words:
        assert word in str(err.value)
    _assert_untouched(model)


def test_params_next_to_method_object_are_rejected(llava):
    with pytest.raises(VTokenError, match="set them on the object"):
        vtoken.patch(llava[0], vtoken.FasterVLM(budget=0.5), budget=0.25)
    _assert_untouched(llava[0])


def test_two_encoder_methods_cannot_compose(llava):
    with pytest.raises(VTokenError, match="all act at the encoder stage"):
        vtoken.patch(llava[0], [vtoken.FasterVLM(), vtoken.Pool()])
    _assert_untouched(llava[0])


def test_non_vlm_model_is_rejected():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    )
    with pytest.raises(UnsupportedModelError) as err:
        vtoken.patch(model, "random", budget=0.5)
    assert "LlamaForCausalLM" in str(err.value) and "llava-1.5" in str(err.value)  # the families, briefly
    _assert_untouched(model)


def test_cls_method_on_a_tower_without_cls_is_rejected(llava):
    """LLaVA variants that feed every token ('full' strategy) have no [CLS] score FasterVLM could use."""
    from transformers import LlavaForConditionalGeneration

    config = llava[0].config.__class__.from_dict(llava[0].config.to_dict())
    config.vision_feature_select_strategy = "full"
    model = LlavaForConditionalGeneration(config)
    with pytest.raises(MissingSignalError) as err:
        vtoken.patch(model, "fastervlm", budget=0.25)
    assert "fastervlm" in str(err.value) and "cls_attention" in str(err.value)
    _assert_untouched(model)
    vtoken.patch(model, "random", budget=0.25)  # a method that needs no signal still applies
    vtoken.unpatch(model)


def test_registries():
    assert {"fastervlm", "random", "pool"} <= set(vtoken.available_methods())
    assert "LlavaForConditionalGeneration" in vtoken.supported_models()["llava-1.5"]


@pytest.mark.parametrize("budget, text", [(0.25, "25%"), (0.125, "12.5%"), (1.0, "100%"), (144, "144 tokens"),
                                          (1, "1 token")])  # fmt: skip
def test_a_budget_reads_with_its_unit(budget, text):
    from vtoken.budget import describe

    assert describe(budget) == text


def test_a_method_is_described_by_what_it_applies():
    from vtoken.registry import describe_method

    assert describe_method(vtoken.FasterVLM(budget=25)) == "fastervlm(budget=25 tokens)"
    assert describe_method(vtoken.FasterVLM(budget=0.25)) == "fastervlm(budget=25%)"
    assert describe_method(vtoken.HiRED(budget=0.25)) == "hired(budget=25%)"  # its `rate` alias follows the budget
    assert describe_method(vtoken.HiRED(budget=0.25, alpha=0.3)) == "hired(budget=25%, alpha=0.3)"
    assert describe_method(vtoken.FastV(layer=1)) == "fastv(layer=1, keep=50%)"
