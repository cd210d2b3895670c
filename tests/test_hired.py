"""HiRED (METHODS.md): budget split by early [CLS] attention of the base view, selection by the final layer."""

import pytest
import torch
from conftest import eager_cls_attention, feed_language_model, inputs_for, make_image, mask_outside_unpadded

import vtoken
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def _image(early_base, final, rows=1, cols=2, valid=None):
    """One anyres image of a 4 x 4 grid: base view + rows x cols sub-images."""
    crops = 1 + rows * cols
    early = torch.zeros(crops, 16)
    early[0] = early_base
    return VisualTokens(
        torch.zeros(crops, 16, 2),
        (4, 4),
        {"cls_attention@0": early, "cls_attention": final},
        torch.zeros(crops, dtype=torch.long),
        valid,
        torch.arange(crops),
        {0: (rows, cols)},
    )


def test_budget_arithmetic_bands_and_tiles():
    # early attention of the base view: all mass on its bottom half (tokens 8..15)
    early = torch.cat([torch.zeros(8), torch.arange(1.0, 9.0)])
    final = torch.rand(3, 16, generator=torch.Generator().manual_seed(0))
    tokens = _image(early, final)
    # total = int(3 * 16 * 0.2) = 9; full = min(int(4.5), 16) = 4; sub = 5; marked = top 8 = tokens 8..15
    bands = vtoken.HiRED(rate=0.2).select(tokens)  # band 0 = tokens 0..7, band 1 = 8..15: counts [0, 8]
    assert bands.counts == [4, 0, 5]
    tiles = vtoken.HiRED(rate=0.2, partition="tiles").select(tokens)  # left/right halves: counts [4, 4]
    assert tiles.counts == [4, 2, 2]  # int(4 / 8 * 5) = 2 each: the remainder is lost
    for selection in (bands, tiles):
        for crop, count in enumerate(selection.counts):
            assert torch.equal(selection.kept_of(crop), final[crop].topk(count).indices.sort().values)


def test_sub_image_budgets_are_clipped_to_valid_tokens():
    early = torch.cat([torch.zeros(8), torch.arange(1.0, 9.0)])
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[2, 12:] = False  # the last sub-image loses its bottom row to unpadding
    selection = vtoken.HiRED(rate=0.5).select(_image(early, torch.rand(3, 16), valid=valid))
    # total = 24; full = 12; sub = 12 -> [0, 12], clipped to the 12 valid tokens of crop 2
    assert selection.counts == [12, 0, 12] and selection.kept_of(2).max() < 12


def test_llava_keeps_top_rate_of_the_final_cls_attention(llava, photos):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what?"])
    with torch.no_grad(), vtoken.patched(model, "hired", rate=0.2) as handle:
        model(**inputs)
    scores = eager_cls_attention(model.model.vision_tower, inputs["pixel_values"])[0]
    assert torch.equal(handle.records[0].kept, scores.topk(int(576 * 0.2)).indices.sort().values)


@pytest.mark.parametrize("partition", ["bands", "tiles"])
@pytest.mark.parametrize("size", [(1000, 1000), (800, 300), (50, 20)])
def test_llava_next_counts_and_kept_sets_follow_the_spec(partition, size):
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(*size)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    method = vtoken.HiRED(rate=0.2, partition=partition)
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        logits = model(**inputs).logits
        layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : layout.num_crops]
    tower = model.model.vision_tower
    early = eager_cls_attention(tower, crops, layer=0)[0]  # base view, layer 0
    final = eager_cls_attention(tower, crops)  # layer of the feature (hidden_states[-2])
    budgets = method.crop_budgets(early, layout.rows, layout.cols, 24, 24)
    for record, budget in zip(handle.records, budgets, strict=True):
        scores = mask_outside_unpadded(final[record.crop], record.crop, layout)
        count = min(budget, int(torch.isfinite(scores).sum()))
        assert record.tokens_out == count
        assert torch.equal(record.kept, scores.topk(count).indices.sort().values)
    assert torch.isfinite(logits).all()


def test_hired_errors():
    with pytest.raises(vtoken.VTokenError, match="rate"):
        vtoken.HiRED(budget=100)
    with pytest.raises(vtoken.VTokenError, match="partition='rows'.*bands, tiles"):
        vtoken.HiRED(partition="rows")
    qwen, _ = TINY_MODELS["tiny-qwen2-vl"]()
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention@0"):
        vtoken.patch(qwen, "hired")
    assert vtoken.handle_of(qwen) is None


@pytest.mark.parametrize("size", [(800, 300), (300, 800)])
def test_llava_next_official_layout_unpads_after_selecting(size):
    """HiRED's own packing: budgets over the padded crops, border picks dropped, base view then the sub-image
    tokens in raster order of the unpadded grid, no newlines; fed to the bare LLM as the reference."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(*size)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    method = vtoken.HiRED(rate=0.9)  # border tokens score low: a high rate makes sub-images pick some
    with torch.no_grad(), vtoken.patched(model, method, layout="official") as handle:
        logits = model(**inputs).logits
        layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : layout.num_crops]
    tower = model.model.vision_tower
    early, final = eager_cls_attention(tower, crops, layer=0)[0], eager_cls_attention(tower, crops)
    budgets = method.crop_budgets(early, layout.rows, layout.cols, 24, 24)
    with torch.no_grad():
        features = tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:]
    base, sub, dropped = None, [], 0
    for crop, budget in enumerate(budgets):
        picks = final[crop].topk(budget).indices.sort().values
        survivors = mask_outside_unpadded(torch.zeros(576), crop, layout)[picks].isfinite()
        dropped += int((~survivors).sum())
        record = handle.records[crop]
        assert record.kept.tolist() == picks[survivors].tolist() and record.tokens_out == int(survivors.sum())
        assert record.selected == (budget if not survivors.all() else None)
        if crop == 0:
            base = features[0, picks]
            continue
        row, col = divmod(crop - 1, layout.cols)
        stitched = (row * 24 + picks // 24) * layout.cols * 24 + col * 24 + picks % 24
        sub += list(zip(stitched[survivors].tolist(), features[crop, picks[survivors]], strict=True))
    assert dropped > 0  # this aspect ratio puts picks in the padded border
    ordered = torch.stack([f for _, f in sorted(sub, key=lambda item: item[0])])
    visual = model.model.multi_modal_projector(torch.cat([base, ordered]))
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert (logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["tiny-video-llava", "tiny-llava-next-video"])
def test_video_frames_use_the_single_crop_variant(name):
    from conftest import video_inputs

    model, processor = TINY_MODELS[name]()
    inputs = video_inputs(processor)
    with torch.no_grad(), vtoken.patched(model, "hired", rate=0.2) as handle:
        model(**inputs)
    assert len(handle.records) == 4
    assert all(r.tokens_out == min(r.tokens_in, int(r.tokens_in * 0.2)) for r in handle.records)
