"""SCOPE (METHODS-4-images.md): the saliency-weighted coverage greedy against a plain-loop reference written from the
spec (ties, zero saliency, alpha, invalid tokens, split budgets), its op against MMTok's (weights of 1), then the
method through `vtoken.patch` on LLaVA-1.5 and LLaVA-NeXT (the official budgets; "split" with the official layout)
against eager [CLS] attention and the bare language model fed by hand, saliency="received" on Qwen2.5-VL with
original positions, padded batches, keep-all identity and the refusals."""

import math

import pytest
import torch
from conftest import (
    assert_batch_equals_one_by_one,
    assert_identity,
    captured_llm_input,
    eager_cls_attention,
    feed_language_model,
    make_image,
    mask_outside_unpadded,
)
from test_hiprune import qwen_received

import vtoken
from vtoken.api import check
from vtoken.kernels import greedy_max_coverage, greedy_weighted_coverage
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def reference(x, s, keep, alpha=1.0, valid=None):
    """One crop's picks in pick order, a loop over the steps from the spec (each step's gains over all columns at
    once, in float64): x [N, D] features, s [N] saliency, `keep` = T (capped at the valid tokens); invalid tokens are
    neither candidates nor rows to cover."""
    n = len(x)
    valid = torch.ones(n, dtype=torch.bool) if valid is None else valid.bool()
    x = x.double()
    unit = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    cover = (unit @ unit.T).clamp(min=0) * valid[:, None]  # rows i: what is covered; columns j: the candidates
    weight = s.double() ** alpha
    covered = torch.zeros(n, dtype=torch.float64)  # m
    picks = []
    for _ in range(keep):
        gain = weight * (cover - covered[:, None]).clamp(min=0).sum(0)
        gain[~valid] = -math.inf
        gain[picks] = -math.inf
        pick = max(range(n), key=lambda j: (float(gain[j]), -j))  # the first index on ties
        picks.append(pick)
        covered = torch.maximum(covered, cover[pick])
    return picks


def _tokens(x, s, image=None, valid=None, counts=None, saliency="cls"):
    crops = x.shape[0]
    signals = {"cls_attention": s, "vision_features": x} if saliency == "cls" else {"received_attention": s,
                                                                                   "projected": x}  # fmt: skip
    image = torch.arange(crops) if image is None else image
    return VisualTokens(x, (1, x.shape[1]), signals, image, valid, valid_counts=counts)


def clustered(crops, n, dim, seed, clusters=6):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g) * 3
    member = torch.randint(clusters, (crops, n), generator=g)
    return centres[member] + torch.randn(crops, n, dim, generator=g)


def test_a_hand_made_image_whose_answer_is_known():
    """Three groups of identical tokens (orthogonal groups): each pick covers its whole group, so T = 3 takes one
    token of each group, the most salient one first within a group's gain (a group of 4 beats one of 2 unless its
    saliency is lower)."""
    x = torch.eye(3)[torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])][None]
    s = torch.tensor([[0.1, 0.3, 0.2, 0.1, 0.9, 0.8, 0.05, 0.05, 0.05]])
    # gains: group 0 (4 rows) 4 * 0.3 = 1.2 at token 1; group 1 (2 rows) 2 * 0.9 = 1.8 at token 4; group 2 3 * 0.05
    picks = reference(x[0], s[0], 3)
    assert picks == [4, 1, 6]
    assert vtoken.SCOPE(budget=3).select(_tokens(x, s)).kept.tolist() == [[1, 4, 6]]


def test_ties_and_zero_saliency_go_to_the_lowest_unpicked_index():
    """One-hot duplicates tie exactly (the first wins); with zero saliency every gain is 0: the lowest indices."""
    x = torch.eye(4)[torch.tensor([2, 2, 0, 1, 0, 3])][None]
    s = torch.ones(1, 6)
    assert reference(x[0], s[0], 4) == [0, 2, 3, 5]
    assert vtoken.SCOPE(budget=4).select(_tokens(x, s)).kept.tolist() == [[0, 2, 3, 5]]
    zero = torch.zeros(1, 6)
    assert vtoken.SCOPE(budget=3).select(_tokens(x, zero)).kept.tolist() == [[0, 1, 2]] == [reference(x[0], zero[0], 3)]


@pytest.mark.parametrize("n, budget, alpha", [(50, 8, 1.0), (50, 0.3, 0.5), (36, 36, 1.0), (40, 1, 2.0), (30, 12, 0.0)])
def test_random_clustered_crops_equal_the_reference(n, budget, alpha):
    """Several crops of clustered features, scattered invalid tokens (T capped at the valid ones)."""
    x = clustered(3, n, 8, n)
    s = torch.rand(3, n, generator=torch.Generator().manual_seed(7)).softmax(-1)
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[1, ::3] = False
    valid[2, n // 3 :] = False
    counts = valid.sum(1).tolist()
    selection = vtoken.SCOPE(budget=budget, alpha=alpha).select(_tokens(x, s, valid=valid, counts=counts))
    for c in range(3):
        keep = vtoken.tokens_to_keep(budget, counts[c])
        assert selection.kept_of(c).tolist() == sorted(reference(x[c], s[c], keep, alpha, valid[c]))


def test_split_budgets_share_an_image_equally_over_its_crops():
    x = clustered(5, 40, 6, 3)
    s = torch.rand(5, 40, generator=torch.Generator().manual_seed(1))
    image = torch.tensor([0, 0, 0, 0, 0])
    selection = vtoken.SCOPE(budget=32, scope="split").select(_tokens(x, s, image))
    assert selection.kept.shape == (5, 6)  # 32 // 5 = 6 each
    for c in range(5):
        assert selection.kept_of(c).tolist() == sorted(reference(x[c], s[c], 6))
    assert vtoken.SCOPE(budget=160, scope="split").count_before_encoding(576, (24, 24), 5) == 32


def test_the_op_without_weights_is_mmtoks_and_weights_of_one_change_nothing():
    g = torch.Generator().manual_seed(4)
    matrix = torch.rand(2, 30, 25, generator=g) ** 2
    excluded = torch.zeros(2, 25, dtype=torch.bool)
    excluded[1, 3:7] = True
    counts = torch.tensor([9, 12])
    mmtok = greedy_max_coverage(matrix, excluded, counts, 12)
    assert torch.equal(greedy_weighted_coverage(matrix, None, excluded, counts, 12), mmtok)
    assert torch.equal(greedy_weighted_coverage(matrix, torch.ones(2, 25), excluded, counts, 12), mmtok)
    assert mmtok[0, 9:].tolist() == [25] * 3  # padded with N past the count


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(alpha=-1), "alpha=-1"),
        (dict(alpha=math.inf), "alpha=inf"),
        (dict(saliency="keys"), "saliency='keys'; accepted: cls, received"),
        (dict(scope="image"), "scope='image'; accepted: crop, split"),
        (dict(budget=0), "budget=0"),
        (dict(budget=1.5), "budget=1.5"),
    ],
)
def test_parameters_are_checked_at_construction(params, match):
    with pytest.raises(vtoken.VTokenError, match=match):
        vtoken.SCOPE(**params)


# --------------------------------------------------------------------------- through vtoken.patch
def _inputs(processor, size=(300, 400)):
    return processor(images=[make_image(*size)], text=[build_prompt(processor, "what?")], return_tensors="pt")


def llava_signals(model, crops):
    """[CLS] saliency (eager, feature layer) and the feature layer's patch states (before the projector)."""
    tower = model.model.vision_tower
    with torch.no_grad():
        hidden = tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:]
    return eager_cls_attention(tower, crops), hidden, model.model.multi_modal_projector(hidden)


@pytest.mark.parametrize("budget", [64, 0.1])
def test_llava_equals_the_reference_and_the_language_model_fed_by_hand(budget):
    model, processor = TINY_MODELS["tiny-llava"]()
    inputs = _inputs(processor)
    with torch.no_grad(), vtoken.patched(model, vtoken.SCOPE(budget=budget)) as handle:
        logits = model(**inputs).logits
    s, x, projected = llava_signals(model, inputs["pixel_values"])
    keep = vtoken.tokens_to_keep(budget, 576)
    kept = sorted(reference(x[0], s[0], keep))
    assert handle.records[0].kept.tolist() == kept and handle.records[0].tokens_out == keep
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, projected[0, kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_llava_next_official_split_is_32_a_crop_base_then_the_stitched_raster():
    """The official LLaVA-NeXT run (160 per image on 5 crops: 32 each), layout="official"."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = _inputs(processor, (500, 500))
    with torch.no_grad(), vtoken.patched(model, vtoken.SCOPE(budget=160, scope="split"), layout="official") as handle:
        logits = model(**inputs).logits
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    count = layout.num_crops
    s, x, projected = llava_signals(model, inputs["pixel_values"][0, :count])
    kept = [sorted(reference(x[c], s[c], 160 // count)) for c in range(count)]
    assert [r.kept.tolist() for r in handle.records] == kept
    stitched = []
    for c in range(1, count):
        row, col = divmod(c - 1, layout.cols)
        stitched += [((row * 24 + j // 24) * layout.cols * 24 + col * 24 + j % 24, c, j) for j in kept[c]]
    order = [(0, j) for j in kept[0]] + [(c, j) for _, c, j in sorted(stitched)]
    visual = torch.stack([projected[c, j] for c, j in order])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_llava_next_native_neither_picks_nor_covers_the_unpadded_border():
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = _inputs(processor, (800, 300))
    with torch.no_grad(), vtoken.patched(model, vtoken.SCOPE(budget=24)) as handle:
        model(**inputs)
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    s, x, _ = llava_signals(model, inputs["pixel_values"][0, : layout.num_crops])
    for c, record in enumerate(handle.records):
        valid = mask_outside_unpadded(torch.zeros(576), c, layout) > -math.inf
        keep = min(24, int(valid.sum()))
        assert record.kept.tolist() == sorted(reference(x[c], s[c], keep, valid=valid))


def test_qwen_received_saliency_on_projected_tokens_with_original_positions():
    """saliency="received" (AngelSlim's Qwen form): s = the attention each merged token receives in the last
    full-attention block, x = the merged (projected) tokens; per image."""
    model, processor = TINY_MODELS["tiny-qwen2.5-vl"]()
    inputs = processor(images=[make_image(300, 200, 1)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    (s,) = qwen_received(model, inputs, max(model.model.visual.fullatt_block_indexes))
    with torch.no_grad():
        merged = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    with torch.no_grad(), vtoken.patched(model, vtoken.SCOPE(budget=0.25, saliency="received")) as handle:
        embeds = captured_llm_input(model, inputs)
    keep = vtoken.tokens_to_keep(0.25, len(s))
    kept = sorted(reference(merged, s, keep))
    assert handle.records[0].kept.tolist() == kept
    run = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0]
    torch.testing.assert_close(embeds[0, run : run + keep], merged[kept], rtol=1e-5, atol=1e-6)


QWEN_KEEP_ALL = vtoken.SCOPE(budget=1.0, saliency="received")


@pytest.mark.parametrize("name, method", [("tiny-llava", "scope"), ("tiny-llava-next", "scope"),
                                          ("tiny-qwen2.5-vl", QWEN_KEEP_ALL)])  # fmt: skip
def test_identity_and_a_padded_batch_equals_its_rows(name, method):
    model, processor = TINY_MODELS[name]()
    assert_identity(model, method, _inputs(processor))
    prompts = [build_prompt(processor, q) for q in ("what is it?", "describe it.")]
    images = [make_image(*size, i) for i, size in enumerate([(800, 300), (336, 500)])]
    batched = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(images=[im], text=[p], return_tensors="pt") for im, p in zip(images, prompts, strict=True)]
    saliency = "received" if name.startswith("tiny-qwen") else "cls"
    with torch.no_grad(), vtoken.patched(model, vtoken.SCOPE(budget=12, saliency=saliency)):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-onevision", "tiny-gemma3"])
def test_towers_without_cls_refuse_it_naming_the_variant(name):
    """(FastVLM, which refuses the variant too: tests/test_hiprune.py's refusals, one build of it.)"""
    model, _ = TINY_MODELS[name]()
    with pytest.raises(vtoken.MissingSignalError, match='cls_attention.*saliency="received"'):
        vtoken.patch(model, "scope")
    assert vtoken.handle_of(model) is None
    check(model, vtoken.SCOPE(saliency="received"))


def test_videos_are_refused_when_the_call_starts():
    from conftest import video_inputs

    model, processor = TINY_MODELS["tiny-qwen2.5-vl"]()
    with vtoken.patched(model, vtoken.SCOPE(saliency="received")):
        with pytest.raises(vtoken.InputError, match="scope acts on image inputs"):
            model(**video_inputs(processor))
