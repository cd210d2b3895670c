"""FasterVLM spec parity (METHODS.md) and invariant 7: scores without output_attentions, SDPA kept on."""

import pytest
import torch
from conftest import eager_cls_attention, inputs_for

import vtoken
from vtoken.adapters.probes import ClsAttentionProbe
from vtoken.tokens import VisualTokens


def test_selection_is_topk_of_the_cls_map_in_ascending_order():
    """A hand-made [CLS] map whose top-k is known."""
    scores = torch.zeros(2, 16)
    scores[0, [3, 15, 0, 7]] = torch.tensor([0.9, 0.8, 0.7, 0.6])
    scores[1, [12, 1, 5, 9]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tokens = VisualTokens(torch.randn(2, 16, 4), (4, 4), {"cls_attention": scores})
    kept = vtoken.FasterVLM(budget=3).select(tokens).kept
    assert kept.tolist() == [[0, 3, 15], [1, 5, 12]]
    assert vtoken.FasterVLM(budget=0.25).select(tokens).kept.tolist() == [[0, 3, 7, 15], [1, 5, 9, 12]]


def test_probe_equals_eager_attention_row(llava, photos):
    model, processor = llava
    pixel_values = inputs_for(processor, [photos["astronaut"], photos["rocket"]], ["a", "b"])["pixel_values"]
    tower = model.model.vision_tower
    with torch.no_grad(), ClsAttentionProbe(tower.encoder.layers[-2].self_attn) as probe:
        tower(pixel_values)
    torch.testing.assert_close(
        probe.scores, eager_cls_attention(model.model.vision_tower, pixel_values), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("budget", [288, 144, 58, 29])
def test_kept_set_is_topk_of_eager_cls_attention(llava, photos, budget):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"], photos["coffee"]], ["what is in the image?", "hi"])
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=budget) as handle:
        model(**inputs)
    reference = eager_cls_attention(model.model.vision_tower, inputs["pixel_values"])
    for record, scores in zip(handle.records, reference, strict=True):
        expected = scores.topk(budget).indices.sort().values
        assert torch.equal(record.kept, expected)


def test_scores_need_no_attention_weights_and_sdpa_stays_on(llava, photos, monkeypatch):
    """Invariant 7: no `output_attentions`, the vision tower and the LLM keep running SDPA."""
    model, processor = llava
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is in the image?"])
    calls = []
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.sdpa_attention_forward

    def spy(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return original(module, *args, **kwargs)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    seen_output_attentions = []
    hook = model.model.vision_tower.register_forward_pre_hook(
        lambda m, a, kw: seen_output_attentions.append(kw.get("output_attentions")), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.25):
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    assert "CLIPAttention" in calls and "LlamaAttention" in calls
    assert not any(seen_output_attentions)
    assert model.model.vision_tower.config._attn_implementation == "sdpa"
