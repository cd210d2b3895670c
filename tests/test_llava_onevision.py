"""LLaVA-OneVision: SigLIP (no [CLS]), anyres_max_9 packing incl. downsampling, multi-image, pooled video; the tower
stage's flat layout (ToMe, PixelPrune) against the language model fed every crop's tokens by hand."""

import numpy as np
import pytest
import torch
from conftest import (
    assert_identity,
    feed_language_model,
    make_image,
    video_inputs,
)
from PIL import Image

import vtoken
from vtoken.zoo import build_prompt, tiny_onevision

SIZES = [(384, 384), (800, 300), (1600, 1500), (200, 900), (1000, 700)]


@pytest.fixture(scope="module")
def ov():
    return tiny_onevision()


def _image(processor, size, seed=0):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, "what?")], return_tensors="pt")


def test_identity_for_single_multi_image_and_video(ov):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = ov
    cases = [_image(processor, s, i) for i, s in enumerate(SIZES[:3])]
    cases.append(
        processor(
            images=[make_image(800, 300), make_image(200, 900, 1)],
            text=[build_prompt(processor, "compare.", 2)],
            return_tensors="pt",
        )
    )
    cases.append(video_inputs(processor, 4, "what?"))
    for inputs in cases:
        assert_identity(model, method, inputs, max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 50])
def test_exact_budget_per_crop_and_equivalence_with_stock_packing(ov, budget):
    model, processor = ov
    for i, size in enumerate(SIZES):
        inputs = _image(processor, size, i)
        with torch.no_grad(), vtoken.patched(model, "random", budget=budget) as handle:
            logits = model(**inputs).logits
        base, grid = handle.records
        assert (base.crop, base.tokens_in, grid.crop) == (0, 729, 1)
        for r in handle.records:
            assert r.tokens_out == vtoken.tokens_to_keep(budget, r.tokens_in) and len(r.kept) == r.tokens_out
        rows, cols = grid.grid
        assert grid.tokens_in == rows * cols
        with torch.no_grad():  # the stock packing: 729 base tokens, then rows of `cols` tokens + a newline each
            packed = model.model.get_image_features(
                inputs["pixel_values"], inputs["image_sizes"], batch_num_images=inputs["batch_num_images"]
            ).pooler_output[0]
        assert len(packed) == 729 + rows * (cols + 1)
        keep = [int(j) for j in base.kept]
        kept_rows = {}
        for t in grid.kept.tolist():
            kept_rows.setdefault(t // cols, []).append(t % cols)
        for row in sorted(kept_rows):
            start = 729 + row * (cols + 1)
            keep += [start + c for c in sorted(kept_rows[row])] + [start + cols]
        image = packed[torch.tensor(keep)]
        ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, size


@pytest.mark.parametrize("frames", [1, 4, 32])
def test_video_per_frame_budget_with_one_trailing_newline(ov, frames):
    model, processor = ov
    inputs = video_inputs(processor, frames, "what?")
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert [(r.modality, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        ("video", f, 196, 49) for f in range(frames)
    ]
    with torch.no_grad():
        stock = model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output[0]  # [F*196 + 1, D]
        frames_tokens = stock[:-1].view(frames, 196, -1)
        video = torch.cat([*(frames_tokens[f, r.kept] for f, r in enumerate(handle.records)), stock[-1:]])
        ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, video)
    assert (logits - ref).abs().max() <= 1e-5 and out.shape[1] == inputs["input_ids"].shape[1] + 2


# ----------------------------------------------------------------- the tower stage: images in the flat layout
def _page(width: int, height: int) -> Image.Image:
    """White paper with dark bars and a noisy stamp: PixelPrune drops the flat patches and keeps the rest."""
    pixels = np.full((height, width, 3), 255, dtype=np.uint8)
    for row in range(20, height - 20, 40):
        pixels[row : row + 9, 20 : width - 30] = 20
    pixels[10:60, width - 80 : width - 20] = np.random.default_rng(0).integers(0, 256, (50, 60, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _feed_runs(model, input_ids, token_id, visuals):
    """Reference logits: the bare language model on `input_ids[0]` with its k-th run of `token_id` placeholders
    replaced by exactly `visuals[k]` [n_k, D], contiguous positions (the flat layout: no newline)."""
    ids = input_ids[0].tolist()
    new_ids, runs, i = [], 0, 0
    while i < len(ids):
        if ids[i] != token_id:
            new_ids.append(ids[i])
            i += 1
            continue
        while i < len(ids) and ids[i] == token_id:
            i += 1
        new_ids += [token_id] * len(visuals[runs])
        runs += 1
    assert runs == len(visuals)
    new_ids = torch.tensor(new_ids)[None]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(new_ids)
        embeds[new_ids == token_id] = torch.cat(visuals)
        return model.lm_head(model.model.language_model(inputs_embeds=embeds).last_hidden_state)


def _crops(inputs) -> tuple[torch.Tensor, list[int]]:
    """Every image's crops [C, 3, H, W] as the model runs its tower on them, and crops per image: anyres (base view,
    then the grid crops) where `batch_num_images` says its prompt holds one image, else the base view alone."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    anyres = [n == 1 for n in inputs["batch_num_images"].tolist() for _ in range(n)]
    pinpoints = [[384, 384], [384, 768], [768, 384], [768, 768], [384, 1152], [1152, 384], [1152, 1152], [1536, 1536]]
    counts = [image_size_to_num_patches(size, pinpoints, 384) if patch else 1
              for size, patch in zip(inputs["image_sizes"].tolist(), anyres, strict=True)]  # fmt: skip
    return torch.cat([p[:n] for p, n in zip(inputs["pixel_values"], counts, strict=True)]), counts


def _flat_inputs(processor):
    one = _image(processor, (800, 300))  # anyres: base view + 3 grid crops
    two = processor(images=[make_image(800, 300), make_image(200, 900, 1)],
                    text=[build_prompt(processor, "compare.", 2)], return_tensors="pt")  # fmt: skip
    return [one, two]


@pytest.mark.parametrize("method", [vtoken.ToMe(r=0), vtoken.PixelPrune(threshold=-1.0)], ids=["tome", "pixelprune"])
def test_tower_methods_keeping_everything_are_the_llm_fed_every_crop_flat(ov, method):
    """Keep-all identity in the flat layout: the unpatched tower's projected tokens of every crop, base view then
    the grid crops, concatenated per image (no unpadding, downsampling or newline), renumbered."""
    model, processor = ov
    assert model.config.image_grid_pinpoints[0] == [384, 384] and model.config.vision_config.image_size == 384
    for inputs in _flat_inputs(processor):
        crops, counts = _crops(inputs)
        with torch.no_grad():
            hidden = model.model.vision_tower(crops, output_hidden_states=True).hidden_states[-1]
            visual = model.model.multi_modal_projector(hidden)  # [C, 729, D]
            ref = _feed_runs(model, inputs["input_ids"], model.config.image_token_id,
                             [v.flatten(0, 1) for v in visual.split(counts)])  # fmt: skip
            with vtoken.patched(model, method, layout="official") as handle:
                logits = model(**inputs).logits
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
        records = list(handle.records)
        assert [(r.stage, r.image, r.crop, r.tokens_in, r.tokens_out) for r in records] == [
            ("tower", image, crop, 729, 729) for image, n in enumerate(counts) for crop in range(n)
        ]


def test_tome_on_siglip_is_the_llm_fed_the_merged_crops_flat(ov):
    """ToMe (p = 0) merges in every SigLIP block up to the feature layer; the LLM gets every crop's merged tokens,
    crop after crop, renumbered; the prompt is shrunk to the count before the tower runs; one record per crop."""
    import copy

    from vtoken.adapters import hf
    from vtoken.adapters.tower import ToMeTower, tower_shape

    model, processor = ov
    method = vtoken.ToMe(r=40)
    shape = tower_shape(model, "llava-onevision")
    assert (shape.cls, shape.feature_block) == (False, 2)
    tower = copy.deepcopy(model.model.vision_tower)  # the merging tower on its own (tests/test_tome.py checks it)
    merging = ToMeTower(method, tower.encoder.layers, shape, hf.attention_implementation(tower))
    merging.install()
    (planned,) = method.count_before_encoding([(27, 27)], tower=shape)
    assert planned == 729 - 120
    for inputs in _flat_inputs(processor):
        crops, counts = _crops(inputs)
        with torch.no_grad():
            (states,) = hf.hidden_states(tower, [-1], crops)
            visual = model.model.multi_modal_projector(states)
            ref = _feed_runs(model, inputs["input_ids"], model.config.image_token_id,
                             [v.flatten(0, 1) for v in visual.split(counts)])  # fmt: skip
            with vtoken.patched(model, method, layout="official") as handle:
                logits = model(**inputs).logits
        assert visual.shape[1] == planned and logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
        records = list(handle.records)
        assert [(r.image, r.crop, r.tokens_in, r.tokens_out, r.kept) for r in records] == [
            (image, crop, 729, planned, None) for image, n in enumerate(counts) for crop in range(n)
        ]
        sources = merging.last().patch_sources()
        for index, record in enumerate(records):
            assert record.extra["r"] == merging.last().done == [40, 40, 40]
            assert torch.equal(record.extra["sources"], sources[index])


def test_pixelprune_on_siglip_is_the_llm_fed_every_crops_kept_patches_flat(ov):
    """PixelPrune drops the predicted patches of every crop after the embeddings (each keeping its position
    embedding, no [CLS]); the reference runs each crop's kept rows through the encoder alone (no padding)."""
    from vtoken.adapters.tower import tower_shape

    model, processor = ov
    inputs = processor(images=[_page(800, 300)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    crops, counts = _crops(inputs)
    tower = model.model.vision_tower
    selected = vtoken.PixelPrune().select_input(crops, [(27, 27)] * len(crops), tower_shape(model, "llava-onevision"))
    assert 0 < min(selected.counts) and max(selected.counts) <= 729 and sum(selected.counts) < 729 * len(crops)
    with torch.no_grad():
        embeds = tower.embeddings(crops)  # [C, 729, Dv]: patch embeddings + position embeddings
        rows = []
        for crop in range(len(crops)):
            kept = torch.from_numpy(selected.kept_of(crop))
            hidden = tower.encoder(inputs_embeds=embeds[crop, kept][None]).last_hidden_state[0]
            rows.append(model.model.multi_modal_projector(hidden))
        ref = _feed_runs(model, inputs["input_ids"], model.config.image_token_id, [torch.cat(rows)])
        with vtoken.patched(model, "pixelprune", layout="official") as handle:
            logits = model(**inputs).logits
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    records = list(handle.records)
    assert counts == [len(crops)] and len(crops) > 1
    assert [(r.crop, r.tokens_in, r.tokens_out) for r in records] == [
        (c, 729, n) for c, n in enumerate(selected.counts)
    ]
    for crop, record in enumerate(records):
        assert torch.equal(record.kept.cpu(), torch.from_numpy(selected.kept_of(crop)))
        assert record.extra == {"patches_in": 729, "patches_out": selected.counts[crop]}


def test_tower_methods_are_refused_where_the_flat_layout_does_not_hold(ov):
    """The native layout (stitched, unpadded, downsampled after the tower), the flat layout without a tower
    method, a method selecting among the packed tokens, the "default" feature strategy (SigLIP has no [CLS]) and
    videos (pooled 2x2 after the tower): each refused naming why, the model left unpatched."""
    model, processor = ov
    for method in ("tome", "pixelprune"):
        with pytest.raises(vtoken.VTokenError, match="native layout stitches, unpads and bilinearly downsamples"):
            vtoken.patch(model, method)
    with pytest.raises(vtoken.VTokenError, match="flat layout of the tower methods"):
        vtoken.patch(model, "random", layout="official")
    with pytest.raises(vtoken.VTokenError, match="divprune selects among the tokens as the model packs them"):
        vtoken.patch(model, ["tome", "divprune"], layout="official")
    strategy, model.config.vision_feature_select_strategy = model.config.vision_feature_select_strategy, "default"
    try:
        with pytest.raises(vtoken.VTokenError, match="SigLIP has no \\[CLS\\]"):
            vtoken.patch(model, "tome", layout="official")
    finally:
        model.config.vision_feature_select_strategy = strategy
    assert vtoken.handle_of(model) is None
    image = _image(processor, (384, 384))
    with torch.no_grad(), vtoken.patched(model, "tome", layout="official"):
        with pytest.raises(vtoken.InputError, match="SigLIP has no \\[CLS\\]"):
            model(**image, vision_feature_select_strategy="default")
        with pytest.raises(vtoken.InputError, match="tome acts in the vision tower on image inputs only.*pooled 2x2"):
            model(**video_inputs(processor, 2, "what?"))
    methods = [vtoken.ToMe(r=16), vtoken.make_method("random", budget=0.5)]
    with torch.no_grad(), vtoken.patched(model, methods, layout="official") as handle:
        model(**image)  # an encoder method after the tower: its budget over each crop's merged tokens
    crops = _crops(image)[1][0]
    assert [(r.stage, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        *(("tower", c, 729, 729 - 3 * 16) for c in range(crops)),
        *(("encoder", c, 681, 341) for c in range(crops)),
    ]


def test_the_flat_tower_stage_adds_no_sync_beyond_pixelprunes_one_read(ov):
    """Invariant 10 (counted on CPU): ToMe's merges add no host sync and the same burst whatever r (shapes from the
    host); PixelPrune at most its one read of the kept mask, before the tower."""
    from vtoken.launches import count_launches

    model, processor = ov
    inputs = _image(processor, (800, 300))

    def added(method) -> tuple[int, int]:
        with torch.no_grad():
            model(**inputs)
            with count_launches(sites=False) as plain:
                model(**inputs)
            with vtoken.patched(model, method, layout="official"):
                model(**inputs)
                with count_launches() as patched:
                    model(**inputs)
        return patched.kernels - plain.kernels, patched.syncs - plain.syncs

    merging = [added(vtoken.ToMe(r=r)) for r in (3, 6)]
    # (fewer than the unpatched model's: its stitching reads the image sizes back, the flat layout reads none)
    assert all(syncs <= 0 for _, syncs in merging) and merging[0] == merging[1]
    assert added(vtoken.PixelPrune())[1] <= merging[0][1] + 1
