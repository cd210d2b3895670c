"""LLaVA-NeXT (anyres) invariants on the tiny offline model, native layout."""

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_identity,
    eager_cls_attention,
    feed_language_model,
    make_image,
    mask_outside_unpadded,
)

import vtoken
from vtoken.zoo import build_prompt, tiny_llava_next

METHODS = ["fastervlm", "random"]  # selection methods; pool has its own tests below
SIZES = [(336, 336), (800, 300), (300, 900), (1000, 1000), (50, 20), (640, 427)]


@pytest.fixture(scope="module")
def next_model():
    return tiny_llava_next()


def _inputs(processor, sizes, questions=None):
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    questions = questions or ["what is in the image?"] * len(images)
    return processor(
        images=images, text=[build_prompt(processor, q) for q in questions], return_tensors="pt", padding=True
    )


def test_identity_at_full_budget_for_every_size(next_model):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = next_model
    for size in SIZES:
        assert_identity(model, method, _inputs(processor, [size]))


def _reference_sequence(model, inputs, records):
    """Independent reference for one image: HF's own packing applied to token ids tells which packed position
    holds which (crop, token); keep the kept tokens and the newline of every row that still has one."""
    inner = model.model
    with torch.no_grad():
        full = inner.get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
        ).pooler_output[0]  # [L, D], stock packing with newlines
    num_crops = len(records)
    ids = torch.arange(num_crops * 576, dtype=torch.float32).view(num_crops, 576, 1)
    packed_ids, _ = inner.pack_image_features(
        [ids], inputs["image_sizes"], "default", image_newline=torch.tensor([-1.0])
    )
    packed_ids = packed_ids[0].squeeze(1).long()
    kept_ids = set()
    for r in records:
        kept_ids.update((r.crop * 576 + r.kept).tolist())
    keep = torch.tensor([int(i) in kept_ids for i in packed_ids])
    # a newline stays iff the row it closes (back to the previous newline) kept a token
    row_has_token = False
    for pos, token in enumerate(packed_ids.tolist()):
        if token == -1:
            keep[pos] = row_has_token
            row_has_token = False
        else:
            row_has_token = row_has_token or bool(keep[pos])
    return full[keep], int((packed_ids == -1)[keep].sum())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("size", [(800, 300), (1000, 1000), (50, 20)])
def test_pruned_run_equals_language_model_fed_by_hand(next_model, method, size):
    model, processor = next_model
    inputs = _inputs(processor, [size])
    with torch.no_grad(), vtoken.patched(model, method, budget=0.1) as handle:
        logits = model(**inputs).logits
    image_embeds, newlines = _reference_sequence(model, inputs, handle.records)
    assert len(image_embeds) == sum(r.tokens_out for r in handle.records) + newlines
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image_embeds)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [0.5, 0.25, 0.05, 30])
def test_exact_budget_per_crop_for_every_size(next_model, method, budget):
    model, processor = next_model
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
            for size in SIZES:
                inputs = _inputs(processor, [size])
                model(**inputs)
                records = handle.records
                assert records[0].crop == 0 and records[0].tokens_in == 576
                for r in records:
                    assert r.tokens_out == vtoken.tokens_to_keep(budget, r.tokens_in)
                    assert len(r.kept) == r.tokens_out and torch.equal(r.kept, r.kept.sort().values)
                # newline count: distinct stitched rows among kept sub-image tokens (independently computed)
                adapter = handle.adapter
                layout = adapter.crop_layout(inputs["image_sizes"][0])
                rows = set()
                for r in records[1:]:
                    crop_row = (r.crop - 1) // layout.cols
                    rows.update((crop_row * 24 + r.kept // 24).tolist())
                kept_visual = sum(r.tokens_out for r in records)
                run = int((inputs["input_ids"] == model.config.image_token_id).sum())
                assert seen[-1] == inputs["input_ids"].shape[1] - run + kept_visual + len(rows), size
    finally:
        hook.remove()


def test_fastervlm_keeps_topk_of_eager_cls_attention_among_valid_tokens(next_model):
    model, processor = next_model
    inputs = _inputs(processor, [(800, 300)])
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.25) as handle:
        model(**inputs)
    crops = inputs["pixel_values"][0, : len(handle.records)]
    scores = eager_cls_attention(model.model.vision_tower, crops)
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    for r in handle.records:
        s = mask_outside_unpadded(scores[r.crop], r.crop, layout)
        assert torch.equal(r.kept, s.topk(r.tokens_out).indices.sort().values)


def test_pool_native_layout_pools_every_crop_and_keeps_its_rows(next_model):
    """1000 x 1000: four fully valid sub-crops; 144 per crop = 12 x 12 adaptive pooling, i.e. the 48 x 48 stitched
    grid pooled to 24 x 24 with a newline after each of its rows; the base view pooled to 12 x 12."""
    model, processor = next_model
    inputs = _inputs(processor, [(1000, 1000)])
    with torch.no_grad(), vtoken.patched(model, "pool", budget=144) as handle:
        logits = model(**inputs).logits
    assert [(r.tokens_in, r.tokens_out, r.kept) for r in handle.records] == [(576, 144, None)] * 5
    with torch.no_grad():
        hidden = model.model.vision_tower(inputs["pixel_values"][0], output_hidden_states=True).hidden_states[-2]
        grids = hidden[:, 1:].reshape(5, 24, 24, -1).permute(0, 3, 1, 2)
        pooled = model.model.multi_modal_projector(F.adaptive_avg_pool2d(grids, 12).permute(0, 2, 3, 1))  # [5,12,12,D]
        stitched = torch.cat([torch.cat([pooled[1], pooled[2]], dim=1), torch.cat([pooled[3], pooled[4]], dim=1)])
        newline = model.model.image_newline.expand(24, 1, -1)
        rows = torch.cat([stitched, newline], dim=1).flatten(0, 1)
        image = torch.cat([pooled[0].flatten(0, 1), rows])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_pool_native_budget_counts_valid_tokens(next_model):
    model, processor = next_model
    with torch.no_grad(), vtoken.patched(model, "pool", budget=0.25) as handle:
        for size in SIZES:
            model(**_inputs(processor, [size]))
            assert all(r.tokens_out == vtoken.tokens_to_keep(0.25, r.tokens_in) for r in handle.records)


def test_missing_image_sizes_is_named(next_model):
    model, processor = next_model
    inputs = _inputs(processor, [(336, 336)])
    del inputs["image_sizes"]
    with vtoken.patched(model, "random", budget=0.5), pytest.raises(vtoken.InputError, match="image_sizes"):
        model(**inputs)


@pytest.mark.parametrize("method", ["fastervlm", "random", "pool"])
@pytest.mark.parametrize("size, budget", [((50, 20), 1.0), ((50, 20), 144), ((1000, 1000), 144), ((800, 300), 36)])
def test_official_layout_equals_hand_built_sequence(next_model, method, size, budget):
    """layout="official": every crop keeps k of all 576 tokens; base first, then sub-image tokens in raster order
    of the full stitched grid; no unpadding, no newline. (50 x 20 at full budget is longer than the processor's
    placeholder run: the run grows.)"""
    model, processor = next_model
    inputs = _inputs(processor, [size])
    with torch.no_grad(), vtoken.patched(model, method, budget=budget, layout="official") as handle:
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    k = vtoken.tokens_to_keep(budget, 576)
    assert all((r.tokens_in, r.tokens_out) == (576, k) for r in handle.records)
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : layout.num_crops]
    with torch.no_grad():
        hidden = model.model.vision_tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:]
        side = int(k**0.5)
        if method == "pool":  # k = side^2: adaptive pooling; cells ordered by their place in the stitched grid
            pooled = F.adaptive_avg_pool2d(hidden.view(-1, 24, 24, hidden.shape[-1]).permute(0, 3, 1, 2), side)
            chosen = pooled.flatten(2).transpose(1, 2)
            step = 24 // side
            where = torch.tensor([(i * step) * 24 + j * step for i in range(side) for j in range(side)])
            where = where.expand(layout.num_crops, -1)
        else:
            chosen = torch.stack([hidden[r.crop, r.kept] for r in handle.records])
            where = torch.stack([r.kept for r in handle.records])
        embeds_per_crop = model.model.multi_modal_projector(chosen)
        keys, subs = [], []
        for c in range(1, layout.num_crops):
            row, col = divmod(c - 1, layout.cols)
            keys.append((row * 24 + where[c] // 24) * layout.cols * 24 + col * 24 + where[c] % 24)
            subs.append(embeds_per_crop[c])
        order = torch.cat(keys).argsort()
        image = torch.cat([embeds_per_crop[0], torch.cat(subs)[order]])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    assert torch.equal(generated[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])


def test_layouts_are_checked(next_model, llava):
    with pytest.raises(vtoken.VTokenError, match="layout='nope'.*native, official"):
        vtoken.patch(next_model[0], "random", budget=0.5, layout="nope")
    with pytest.raises(vtoken.VTokenError, match="layout='official'.*it has: native"):
        vtoken.patch(llava[0], "random", budget=0.5, layout="official")
    assert vtoken.handle_of(next_model[0]) is None and vtoken.handle_of(llava[0]) is None
