"""DivPrune (METHODS-2.md, implemented from the spec only): the greedy max-min diversity subset against a
brute-force reference, its tie rule on a hand-made set, the budget rule, and the method on every family: the
image's tokens as placed (LLaVA-NeXT's newlines among the candidates), original M-RoPE positions on Qwen, each
checked against the bare language model fed by hand."""

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_greedy_matches,
    feed_language_model,
    greedy,
    inputs_for,
    make_image,
)
from test_qwen_vl import _prompt, _reference_generate

import vtoken
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def reference(features, count):
    """Brute force from the spec: the full distance matrix D = 1 - cos (fp32), the first pick by each column's
    second-smallest entry, then max-min picks; the first index wins ties. Kept indices, ascending."""
    unit = F.normalize(features.float(), dim=-1)
    distance = (1 - unit @ unit.T).tolist()
    length = len(distance)
    if count >= length:
        return list(range(length))
    second = [sorted(distance[i][j] for i in range(length))[1] for j in range(length)]
    picks = [max(range(length), key=lambda j: (second[j], -j))]
    while len(picks) < count:
        rest = [j for j in range(length) if j not in picks]
        picks.append(max(rest, key=lambda j: (min(distance[s][j] for s in picks), -j)))
    return sorted(picks)


def test_ties_go_to_the_first_index():
    """Four unit vectors at right angles: every column's nearest other token is at distance 1, so token 0 comes
    first; token 2 (distance 2) next; tokens 1 and 3 then tie at distance 1 from the picks: 1 wins."""
    features = torch.tensor([[[1.0, 0], [0, 1], [-1, 0], [0, -1]]])
    assert vtoken.DivPrune(budget=3).select(VisualTokens(features, (1, 4))).kept.tolist() == [[0, 1, 2]]
    assert vtoken.DivPrune(budget=2).select(VisualTokens(features, (1, 4))).kept.tolist() == [[0, 2]]


def test_the_first_pick_is_the_token_farthest_from_its_nearest_other():
    """Tokens 0-2 sit in a cluster, token 3 alone: 3 is picked first, even with budget 1; an exact duplicate's
    nearest other token is at distance 0, so duplicates are picked last."""
    features = torch.tensor([[[1.0, 0.0], [1.0, 0.05], [1.0, -0.05], [0.0, 1.0], [1.0, 0.0]]])
    assert vtoken.DivPrune(budget=1).select(VisualTokens(features, (1, 5))).kept.tolist() == [[3]]
    assert reference(features[0], 1) == [3]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 5, 0.3, 39, 40])
def test_random_sets_equal_brute_force(seed, budget):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(3, 40, 6, generator=g)
    features[1, 20:25] = features[1, 3]  # duplicates
    valid = torch.rand(3, 40, generator=g) > 0.3
    valid[0] = True
    selection = vtoken.DivPrune(budget=budget).select(VisualTokens(features, (1, 40), valid=valid))
    for c in range(3):
        index = valid[c].nonzero().squeeze(1)
        count = vtoken.tokens_to_keep(budget, len(index))
        assert selection.kept_of(c).tolist() == index[reference(features[c, index], count)].tolist()


def test_budget_rule_and_planned_count():
    """k = the library's rule (half up): 0.098 * 576 = 56.4 -> 56 as the official int(round(.)); 0.5 * 5 = 2.5 ->
    3 here, 2 in the official code (half to even)."""
    assert vtoken.DivPrune().planned_count(576) == 56
    assert vtoken.DivPrune(budget=0.5).planned_count(5) == 3
    assert vtoken.DivPrune(budget=300).planned_count(200) == 200
    with pytest.raises(vtoken.VTokenError, match="scope='crop'"):
        vtoken.DivPrune(scope="crop")
    with pytest.raises(vtoken.BudgetError, match="budget=1.5"):
        vtoken.DivPrune(budget=1.5)


def test_llava_equals_brute_force_on_the_stock_tokens_and_the_llm_fed_by_hand(llava, photos):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, "divprune") as handle:
        logits = model(**inputs).logits
    with torch.no_grad():
        stock = model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output[0]
    kept = reference(stock, 56)
    (record,) = handle.records
    assert (record.tokens_in, record.tokens_out, record.kept.tolist()) == (576, 56, kept)
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, stock[kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("size", [(800, 300), (300, 900)])
def test_llava_next_selects_among_the_packed_tokens_newlines_included(size):
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(*size, 2)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, vtoken.DivPrune(budget=0.1)) as handle:
        logits = model(**inputs).logits
    with torch.no_grad():
        stock = model.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
        ).pooler_output[0]  # the model's own packing, newlines included
    kept = reference(stock, vtoken.tokens_to_keep(0.1, len(stock)))
    assert handle.records[0].kept.tolist() == kept and handle.records[0].tokens_in == len(stock)
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, stock[kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    with pytest.raises(vtoken.VTokenError, match="layout='native'"):
        vtoken.patch(model, "divprune", layout="official")


def test_qwen2_vl_keeps_original_positions():
    model, processor = TINY_MODELS["tiny-qwen2-vl"]()
    inputs = processor(images=[make_image(448, 448, 3)], text=[_prompt(processor, "what is it?")], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, vtoken.DivPrune(budget=40)) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 4)
    with torch.no_grad():
        stock = torch.cat(
            model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        )
    kept = torch.tensor(reference(stock, 40))
    assert handle.records[0].kept.tolist() == kept.tolist()
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.image_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[kept]] = True
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep.nonzero().squeeze(1), stock[kept], steps=4)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)
