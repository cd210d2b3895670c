"""VisionZip (METHODS-2.md): dominant + contextual tokens against a plain-loop reference written from the spec, a
hand-made crop whose answer is known, the budget form, and the method through `vtoken.patch` on the [CLS]
families, checked against the bare language model fed by hand (LLaVA-1.5, LLaVA-NeXT's official packing)."""

import pytest
import torch
from conftest import (
    assert_identity,
    eager_cls_attention,
    feed_language_model,
    inputs_for,
    make_image,
    video_inputs,
)

import vtoken
from vtoken.tokens import CLS, MERGED, VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt

CLS_FAMILIES = ["tiny-llava-next", "tiny-video-llava", "tiny-llava-next-video", "tiny-internvl", "tiny-perception-lm"]


def reference(scores, keys, features, cls, dominant, contextual, valid=None):
    """One crop straight from METHODS-2.md, in plain Python: (rows [k, Dv] fp32, origin list)."""
    candidates = [j for j in range(len(scores)) if valid is None or bool(valid[j])]
    if dominant + contextual >= len(candidates):
        return features[candidates].float(), candidates
    patches = dominant - 1 if cls is not None else dominant
    ranked = sorted(candidates, key=lambda j: (-float(scores[j]), j))
    picked = sorted(ranked[:patches])
    rest = [j for j in candidates if j not in picked]
    targets = list(range(0, len(rest), max(1, len(rest) // contextual)))[:contextual] if contextual else []
    unit = keys.double() / keys.double().norm(dim=-1, keepdim=True)
    assigned = {t: [] for t in targets}
    for position, j in enumerate(rest):
        if position in targets or not targets:
            continue
        similarities = [float(unit[j] @ unit[rest[t]]) for t in targets]
        assigned[targets[similarities.index(max(similarities))]].append(j)
    merged = [features[rest[t]].double() + (features[assigned[t]].double().mean(0) if assigned[t] else 0)
              for t in targets]  # fmt: skip
    rows = ([cls.double()] if cls is not None else []) + [features[j].double() for j in picked] + merged
    origin = ([CLS] if cls is not None else []) + picked + [MERGED] * len(targets)
    return torch.stack(rows).float(), origin


def test_a_hand_made_crop_whose_answer_is_known():
    """Dominant: [CLS] + patches 1 and 4 (the top two scores). The six others, ascending: 0 2 3 5 6 7; step 3, so
    the targets are patches 0 and 5. Keys: 2 is near 0, 3 and 7 near 5, 6 equally near both (the first target
    takes it). Contextual = target + mean(assignees): 0 + mean(2, 6) = 4 and 5 + mean(3, 7) = 10."""
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.3, 0.8, 0.0, 0.05, 0.15]])
    keys = torch.tensor([[[1, 0], [3, 3], [1, 0.1], [0.2, 1], [3, 3], [0, 1], [1, 1], [0, 2]]])
    features = torch.arange(8.0).view(1, 8, 1)
    tokens = VisualTokens(
        features, (2, 4), {"cls_attention": scores, "keys": keys, "cls_token": torch.tensor([[100.0]])}
    )
    selection = vtoken.VisionZip(dominant=3, contextual=2).select(tokens)
    assert selection.features[0, :, 0].tolist() == [100, 1, 4, 4, 10]
    assert selection.origin[0].tolist() == [CLS, 1, 4, MERGED, MERGED]
    assert selection.unchanged_of(0).tolist() == [1, 4]
    # without a [CLS] token the LLM can take: three dominant patches (1, 4, 3), still D + C tokens
    del tokens.signals["cls_token"]
    selection = vtoken.VisionZip(dominant=3, contextual=2).select(tokens)
    assert selection.origin[0].tolist() == [1, 3, 4, MERGED, MERGED] and selection.features.shape[1] == 5


def test_a_target_without_assignees_stays_as_it_is():
    """Targets 0, 2, 4 of the remaining list (step 2 of six); every other token's key points at target 0."""
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])  # patch 6 is the one dominant patch
    keys = torch.tensor([[[1.0, 0], [1, 0], [0, 1], [1, 0], [0, -1], [1, 0], [1, 1]]])
    features = torch.tensor([[1.0], [2], [3], [4], [5], [6], [7]])[None]
    tokens = VisualTokens(features, (1, 7), {"cls_attention": scores, "keys": keys})
    selection = vtoken.VisionZip(dominant=1, contextual=3).select(tokens)
    # target 0 (feature 1) takes patches 1, 3, 5 (features 2, 4, 6): 1 + 4; targets 2 and 4 keep their own feature
    assert selection.features[0, :, 0].tolist() == [7, 5, 3, 5]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dominant, contextual", [(5, 3), (1, 4), (9, 0), (2, 1)])
def test_random_crops_equal_the_reference(seed, dominant, contextual):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 30, generator=g)
    scores[1, 10] = scores[1, 3]  # a tie in the [CLS] scores: the lower index first
    keys, features = torch.randn(3, 30, 6, generator=g), torch.randn(3, 30, 5, generator=g)
    cls = torch.randn(3, 5, generator=g)
    valid = torch.rand(3, 30, generator=g) > 0.3
    valid[0] = True
    for with_cls in (True, False):
        signals = {"cls_attention": scores, "keys": keys} | ({"cls_token": cls} if with_cls else {})
        selection = vtoken.VisionZip(dominant=dominant, contextual=contextual).select(
            VisualTokens(features, (5, 6), signals, valid=valid)
        )
        for c in range(3):
            rows, origin = reference(scores[c], keys[c], features[c], cls[c] if with_cls else None, dominant,
                                     contextual, valid[c])  # fmt: skip
            count = selection.counts_per_crop()[c]
            torch.testing.assert_close(selection.features[c, :count], rows, rtol=1e-5, atol=1e-5)
            assert selection.origin_of(c).tolist() == origin


def test_a_crop_of_at_most_d_plus_c_tokens_passes_unchanged_without_cls():
    features = torch.randn(1, 16, 4)
    signals = {"cls_attention": torch.rand(1, 16), "keys": torch.randn(1, 16, 3), "cls_token": torch.randn(1, 4)}
    selection = vtoken.VisionZip(dominant=10, contextual=6).select(VisualTokens(features, (4, 4), signals))
    assert torch.equal(selection.features, features) and selection.origin[0].tolist() == list(range(16))


def test_budget_form_splits_as_the_official_settings():
    for total, split in [(64, (54, 10)), (128, (108, 20)), (192, (162, 30)), (32, (27, 5)), (1, (1, 0))]:
        assert vtoken.VisionZip(budget=total).split(576) == split
    assert vtoken.VisionZip(budget=0.111).split(576) == (54, 10)  # 0.111 * 576 = 63.9 -> 64
    assert vtoken.VisionZip().split(576) == (54, 10) and vtoken.VisionZip().planned_count(576) == 64
    assert vtoken.VisionZip(dominant=300, contextual=300).planned_count(576) == 576


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(budget=64, dominant=54), "either the budget"),  # one parameter's values: tests/test_contract.py
    ],
)
def test_parameters_are_checked_at_construction(params, match):
    with pytest.raises(vtoken.VTokenError, match=match):
        vtoken.VisionZip(**params)


def _eager_signals(tower, pixel_values):
    """Independent signals of the feature layer (hidden_states[-2]) of a CLIP tower: [CLS] attention (eager
    copy), the layer's keys k_proj(LN1(input)) head-mean, the patch features and the [CLS] feature."""
    scores = eager_cls_attention(tower, pixel_values)
    with torch.no_grad():
        hidden = tower(pixel_values, output_hidden_states=True).hidden_states
        layer = tower.encoder.layers[len(tower.encoder.layers) - 2]
        attention = layer.self_attn
        keys = attention.k_proj(layer.layer_norm1(hidden[-3]))
        keys = keys.view(*keys.shape[:2], attention.num_heads, attention.head_dim).mean(2)[:, 1:]
    return scores, keys, hidden[-2][:, 1:], hidden[-2][:, 0]


@pytest.mark.parametrize("dominant, contextual", [(54, 10), (10, 3), (1, 5)])
def test_llava_equals_the_language_model_fed_by_hand(llava, photos, dominant, contextual):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, vtoken.VisionZip(dominant=dominant, contextual=contextual)) as h:
        logits = model(**inputs).logits
    scores, keys, features, cls = _eager_signals(model.model.vision_tower, inputs["pixel_values"])
    rows, origin = reference(scores[0], keys[0], features[0], cls[0], dominant, contextual)
    (record,) = h.records
    assert record.tokens_out == dominant + contextual and record.kept.tolist() == [o for o in origin if o >= 0]
    with torch.no_grad():
        visual = model.model.multi_modal_projector(rows)
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("size", [(800, 300), (336, 336)])
def test_llava_next_official_layout_is_visionzips_packing(size):
    """Base view [CLS, dominant, contextual]; the sub-images' dominant patches in raster order of the full
    stitched grid; then their [CLS] tokens; then their contextual tokens (VisionZip's LLaVA-NeXT code)."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    image = make_image(*size, 1)
    inputs = processor(images=[image], text=[build_prompt(processor, "what is it?")], return_tensors="pt")
    method = vtoken.VisionZip(dominant=27, contextual=5)
    with torch.no_grad(), vtoken.patched(model, method, layout="official") as handle:
        logits = model(**inputs).logits
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : layout.num_crops]
    scores, keys, features, cls = _eager_signals(model.model.vision_tower, crops)
    outputs = [reference(scores[c], keys[c], features[c], cls[c], 27, 5) for c in range(layout.num_crops)]
    assert [r.tokens_out for r in handle.records] == [32] * layout.num_crops
    with torch.no_grad():
        projected = [model.model.multi_modal_projector(rows) for rows, _ in outputs]
    if layout.num_crops == 1:
        image_embeds = torch.cat([projected[0], model.model.image_newline[None]])
    else:
        grid, where, cls_rows, merged = [], [], [], []
        for c in range(1, layout.num_crops):
            row, col = divmod(c - 1, layout.cols)
            origin = torch.tensor(outputs[c][1])
            patches = origin[origin >= 0]
            where.append((row * 24 + patches // 24) * layout.cols * 24 + col * 24 + patches % 24)
            grid.append(projected[c][origin >= 0])
            cls_rows.append(projected[c][origin == CLS])
            merged.append(projected[c][origin == MERGED])
        grid = torch.cat(grid)[torch.cat(where).argsort()]
        image_embeds = torch.cat([projected[0], grid, *cls_rows, *merged])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image_embeds)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_llava_next_native_layout_counts_valid_tokens_and_keeps_the_identity():
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(800, 300)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    assert_identity(model, vtoken.VisionZip(dominant=600, contextual=0), inputs)
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, vtoken.VisionZip(dominant=20, contextual=4)) as handle:
            model(**inputs)
    finally:
        hook.remove()
    records = handle.records
    assert all(r.tokens_out == min(24, r.tokens_in) and len(r.kept) == min(19, r.tokens_in) for r in records)
    # LLM input: text + per crop (D + C) + one newline per stitched row that keeps a dominant patch
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    rows = {((r.crop - 1) // layout.cols) * 24 + int(k) // 24 for r in records[1:] for k in r.kept}
    run = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert seen[-1] == inputs["input_ids"].shape[1] - run + sum(r.tokens_out for r in records) + len(rows)


def test_video_llava_frames_send_their_cls_once():
    model, processor = TINY_MODELS["tiny-video-llava"]()
    inputs = video_inputs(processor, 4)
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, vtoken.VisionZip(dominant=20, contextual=4)) as handle:
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    run = int((inputs["input_ids"] == model.config.video_token_id).sum())
    assert [r.tokens_out for r in handle.records] == [24] * 4
    assert seen[0] == inputs["input_ids"].shape[1] - run + 4 * 24  # [CLS] + 19 dominant + 4 contextual a frame
    assert_identity(model, vtoken.VisionZip(dominant=300, contextual=0), inputs)


@pytest.mark.parametrize("name", CLS_FAMILIES)
def test_every_cls_family_sends_d_plus_c_per_crop_with_cls_where_the_llm_takes_it(name):
    model, processor = TINY_MODELS[name]()
    inputs = processor(images=[make_image(300, 400)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, vtoken.VisionZip(dominant=5, contextual=3)) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert handle.records and all(r.tokens_out == min(8, r.tokens_in) for r in handle.records)
    sends_cls = name in (
        "tiny-llava-next",
        "tiny-video-llava",
        "tiny-llava-next-video",
    )  # the others' LLM cannot take [CLS]
    assert all(len(r.kept) == (4 if sends_cls else 5) for r in handle.records if r.tokens_in > 8)
