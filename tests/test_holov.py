"""HoloV (METHODS-3-images.md): the chunked allocation against a plain-loop reference written from the spec
(uneven chunks, fewer tokens than chunks, the overflow the official code pads with zero vectors, chunks="auto"),
a hand-made image whose answer is known, the method through `vtoken.patch` on LLaVA-1.5 and LLaVA-NeXT (both
layouts) against eager [CLS] attention and the bare language model fed by hand, the refusals, and the launch
counts of a selection."""

import math

import pytest
import torch
from conftest import (
    eager_cls_attention,
    feed_language_model,
    inputs_for,
    make_image,
    mask_outside_unpadded,
)

import vtoken
from vtoken.launches import count_launches
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def reference(attention, features, keep, chunks, alpha=0.09):
    """One image's candidate sequence (attention [L], projected tokens [L, D]), plain loops straight from the
    spec: the kept positions in the sequence, ascending."""
    length = len(attention)
    if keep >= length:
        return list(range(length))
    if chunks == "auto":
        chunks = max(1, int((1024 / 576) * length / keep))
    base, extra = divmod(length, chunks)
    spans, start = [], 0
    for p in range(chunks):
        size = base + (p < extra)
        if size:  # empty chunks are skipped
            spans.append(list(range(start, start + size)))
        start += size
    scores = []
    for span in spans:
        a = attention[span].float()
        if len(span) == 1:
            scores.append(a[0])
            continue
        x = features[span].float()
        unit = x / (x.norm(dim=-1, keepdim=True) + 1e-6)
        similarity = unit @ unit.T
        similarity.fill_diagonal_(0)
        mean = similarity.sum(1) / (len(span) - 1)
        variance = ((similarity - mean[:, None]) ** 2).sum(1) / (len(span) - 1)  # the zeroed diagonal included
        scaled = a * 1e3
        scale = scaled.abs().mean() / (variance.abs().mean() + 1e-6)
        scores.append((scaled + alpha * scale * variance).mean())
    scores = torch.stack(scores)
    weights = scores / (scores.sum() + 1e-6)
    alloc = torch.floor(weights * keep).long().tolist()
    for p in sorted(range(len(spans)), key=lambda p: (-float(weights[p]), p))[: keep - sum(alloc)]:
        alloc[p] += 1
    kept = []
    for span, count in zip(spans, alloc, strict=True):
        kept += sorted(span, key=lambda j: (-float(attention[j]), j))[:count]
    rest = sorted((j for j in range(length) if j not in kept), key=lambda j: (-float(attention[j]), j))
    return sorted(kept + rest[: keep - len(kept)])  # the overflow: the most attended tokens left


def _tokens(attention, projected, image=None, valid=None):
    crops = attention.shape[0]
    image = torch.arange(crops) if image is None else image
    signals = {"cls_attention": attention, "projected": projected}
    return VisualTokens(projected, (1, attention.shape[1]), signals, image, valid)


def test_a_hand_made_image_whose_answer_is_known():
    """Eight tokens in two chunks of four; chunk 0 holds almost all the attention: with k = 3 it is allotted
    floor(0.9 * 3) = 2 plus the one left over (largest weight), chunk 1 none. Kept: chunk 0's top three."""
    attention = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.02, 0.03, 0.04, 0.01]])
    projected = torch.eye(8)[None]  # orthogonal tokens: similarity variance is the same in both chunks
    kept = vtoken.HoloV(budget=3, chunks=2).select(_tokens(attention, projected)).kept.tolist()
    assert kept == [[0, 1, 2]] == [reference(attention[0], projected[0], 3, 2)]


def test_the_overflow_is_filled_with_the_most_attended_tokens_left():
    """An attention sink makes one chunk of 3 tokens worth ~all of k = 6: it keeps its 3 (the official code
    would pad the output with 3 zero vectors); the other 3 are the most attended tokens elsewhere."""
    attention = torch.full((1, 12), 0.001)
    attention[0, 0] = 0.98
    attention[0, 7], attention[0, 10], attention[0, 4] = 0.004, 0.003, 0.002
    projected = torch.randn(1, 12, 5, generator=torch.Generator().manual_seed(0))
    kept = vtoken.HoloV(budget=6, chunks=4).select(_tokens(attention, projected)).kept.tolist()
    assert kept == [[0, 1, 2, 4, 7, 10]] == [reference(attention[0], projected[0], 6, 4)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "n, budget, chunks",
    [(576, 64, 16), (576, 128, "auto"), (576, 192, "auto"), (50, 9, 16), (10, 4, 16), (100, 30, 7), (40, 0.5, 3)],
)
def test_random_images_equal_the_reference(seed, n, budget, chunks):
    """Uneven chunks (50 = 16 chunks of 3 or 4), fewer tokens than chunks (10 one-token chunks), a sink."""
    g = torch.Generator().manual_seed(seed)
    attention = torch.rand(3, n, generator=g) ** 4
    attention[1, 3] = 50.0  # a sink: its chunk overflows
    projected = torch.randn(3, n, 6, generator=g)
    selection = vtoken.HoloV(budget=budget, chunks=chunks).select(_tokens(attention, projected))
    keep = vtoken.tokens_to_keep(budget, n)
    for c in range(3):
        assert selection.kept_of(c).tolist() == reference(attention[c], projected[c], keep, chunks)


def test_an_image_of_several_crops_is_one_sequence_in_crop_order():
    """Without a packing order from the adapter, an image's crops follow each other, valid tokens only; the
    image's budget is shared out over them."""
    g = torch.Generator().manual_seed(0)
    attention, projected = torch.rand(3, 30, generator=g), torch.randn(3, 30, 4, generator=g)
    valid = torch.rand(3, 30, generator=g) > 0.3
    image = torch.tensor([0, 0, 1])
    selection = vtoken.HoloV(budget=0.25, chunks=5).select(_tokens(attention, projected, image, valid))
    sequence = [(c, j) for c in (0, 1) for j in range(30) if valid[c, j]]
    picks = reference(torch.stack([attention[c, j] for c, j in sequence]),
                      torch.stack([projected[c, j] for c, j in sequence]),
                      vtoken.tokens_to_keep(0.25, len(sequence)), 5)  # fmt: skip
    for c in (0, 1):
        assert selection.kept_of(c).tolist() == [sequence[p][1] for p in picks if sequence[p][0] == c]
    alone = [j for j in range(30) if valid[2, j]]
    want = reference(attention[2, alone], projected[2, alone], vtoken.tokens_to_keep(0.25, len(alone)), 5)
    assert selection.kept_of(2).tolist() == [alone[p] for p in want]


def test_chunks_auto_is_the_official_qwen_rule():
    method = vtoken.HoloV(chunks="auto")
    assert [method.chunk_count(576, k) for k in (64, 128, 192)] == [16, 8, 5]


def test_keeping_all_is_the_identity_selection():
    attention, projected = torch.rand(2, 20), torch.randn(2, 20, 3)
    assert vtoken.HoloV(budget=1.0).select(_tokens(attention, projected)).kept.tolist() == [list(range(20))] * 2


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(chunks=0), "chunks=0"),
        (dict(chunks=2.5), "chunks=2.5"),
        (dict(chunks="all"), "chunks='all'"),
        (dict(alpha=-1), "alpha=-1"),
        (dict(alpha=math.nan), "alpha=nan"),
        (dict(score="keys"), "score='keys'"),
        (dict(budget=0), "budget=0"),
        (dict(scope="crop"), "scope='crop'"),
    ],
)
def test_parameters_are_checked_at_construction(params, match):
    with pytest.raises(vtoken.VTokenError, match=match):
        vtoken.HoloV(**params)


# --------------------------------------------------------------------------- through vtoken.patch
@pytest.mark.parametrize("budget, chunks", [(64, 16), (128, "auto"), (192, "auto"), (64, 7)])
def test_llava_equals_eager_reference_and_the_language_model_fed_by_hand(llava, photos, budget, chunks):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, vtoken.HoloV(budget=budget, chunks=chunks)) as handle:
        logits = model(**inputs).logits
    tower = model.model.vision_tower
    scores = eager_cls_attention(tower, inputs["pixel_values"])
    with torch.no_grad():
        hidden = tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        projected = model.model.multi_modal_projector(hidden)
    kept = reference(scores[0], projected[0], budget, chunks)
    assert handle.records[0].kept.tolist() == kept and handle.records[0].tokens_out == budget
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, projected[0, kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def _next_sequence(model, inputs, layout_of):
    """LLaVA-NeXT's candidate sequence, independently: the base view's 576 tokens, then the sub-images' tokens
    that survive unpadding in raster order of the stitched grid, as (crop, index) with eager [CLS] attention and
    projected features."""
    crops = inputs["pixel_values"][0, : layout_of.num_crops]
    tower = model.model.vision_tower
    scores = eager_cls_attention(tower, crops)
    with torch.no_grad():
        projected = model.model.multi_modal_projector(tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:])
    grid = []
    for c in range(1, layout_of.num_crops):
        valid = mask_outside_unpadded(torch.zeros(576), c, layout_of) > -math.inf
        row, col = divmod(c - 1, layout_of.cols)
        grid += [((row * 24 + j // 24) * layout_of.cols * 24 + col * 24 + j % 24, c, j) for j in range(576) if valid[j]]
    sequence = [(0, j) for j in range(576)] + [(c, j) for _, c, j in sorted(grid)]
    attention = torch.stack([scores[c, j] for c, j in sequence])
    features = torch.stack([projected[c, j] for c, j in sequence])
    return sequence, attention, features


@pytest.mark.parametrize("layout", ["official", "native"])
@pytest.mark.parametrize("size, budget", [((800, 300), 64), ((336, 700), 200), ((500, 500), 0.1)])
def test_llava_next_is_one_holov_over_the_base_view_and_the_unpadded_grid(layout, size, budget):
    """Both layouts select among the same candidates (the official code's sequence); the official layout sends
    the kept tokens in sequence order with no newline, the native one adds a newline after every stitched row
    that keeps a token."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(*size)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"][0].clone()), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, vtoken.HoloV(budget=budget), layout=layout) as handle:
            logits = model(**inputs).logits
    finally:
        hook.remove()
    layout_of = handle.adapter.crop_layout(inputs["image_sizes"][0])
    sequence, attention, features = _next_sequence(model, inputs, layout_of)
    keep = vtoken.tokens_to_keep(budget, len(sequence))
    picks = reference(attention, features, keep, 16)
    kept = [(sequence[p][0], sequence[p][1]) for p in picks]
    assert [(r.crop, j) for r in handle.records for j in r.kept.tolist()] == sorted(kept)
    assert sum(r.tokens_out for r in handle.records) == keep
    if layout == "official":
        ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, features[picks])
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    else:  # the kept grid tokens' stitched rows each end with a newline
        rows = {(((c - 1) // layout_of.cols) * 24 + j // 24) for c, j in kept if c > 0}
        run = int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert len(seen[-1]) == inputs["input_ids"].shape[1] - run + keep + len(rows)


@pytest.mark.parametrize("name", ["tiny-video-llava", "tiny-internvl", "tiny-perception-lm", "tiny-llava-next-video"])
def test_every_cls_family_keeps_its_budget_per_image(name):
    model, processor = TINY_MODELS[name]()
    inputs = processor(images=[make_image(300, 400)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, vtoken.HoloV(budget=0.2, chunks=4)) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    total = sum(r.tokens_in for r in handle.records)
    assert sum(r.tokens_out for r in handle.records) == vtoken.tokens_to_keep(0.2, total)


@pytest.mark.parametrize("name", ["tiny-onevision", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3", "tiny-fastvlm"])
def test_models_without_cls_refuse_it_naming_the_opt_in(name):
    model, _ = TINY_MODELS[name]()
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention.*score='received'"):
        vtoken.patch(model, "holov")
    assert vtoken.handle_of(model) is None


def test_received_attention_is_refused_where_the_tower_has_no_attention():
    """Every tower whose blocks' q/k vtoken reads serves `received_attention` (HiPrune's signal); FastVLM's
    FastViTHD exposes no attention maps."""
    model, _ = TINY_MODELS["tiny-fastvlm"]()
    with pytest.raises(vtoken.MissingSignalError, match="received_attention.*FastViTHD"):
        vtoken.patch(model, vtoken.HoloV(score="received"))
    assert vtoken.handle_of(model) is None


def _eager_received(model, inputs, module_name):
    """Independent scores: the vision tower run with eager attention, the attention maps of its last full-attention
    block recorded from the modelling module's own eager function; per patch the mean over its frame's queries of
    the head-mean attention it receives; per merged token the mean over its 2 x 2 patches, un-permuted from the
    window order with the model's own window index (Qwen2.5-VL)."""
    import copy
    import importlib

    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    visual = copy.deepcopy(model.model.visual)
    visual.config._attn_implementation = "eager"
    full = getattr(visual, "fullatt_block_indexes", None)
    target = visual.blocks[max(full) if full else len(visual.blocks) - 1].attn
    maps, original = [], modeling.eager_attention_forward

    def recording(module, *args, **kwargs):
        output, weights = original(module, *args, **kwargs)
        if module is target:
            maps.append(weights[0])  # [H, n, n], one frame
        return output, weights

    grid = inputs["image_grid_thw"]
    modeling.eager_attention_forward = recording
    try:
        with torch.no_grad():
            merged = visual(inputs["pixel_values"], grid_thw=grid).pooler_output
    finally:
        modeling.eager_attention_forward = original
    per_patch = torch.cat([m.mean(0).mean(0) for m in maps])
    per_group = per_patch.view(-1, 4).mean(1)
    if full:  # window order -> raster order
        from transformers.vision_utils import get_vision_window_index

        index, _ = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size, visual.patch_size)
        per_group = per_group[index.argsort()]
    sizes = (grid.prod(-1) // 4).tolist()
    return per_group.split(sizes), merged.split(sizes)


@pytest.mark.parametrize("name, module", [("tiny-qwen2.5-vl", "qwen2_5_vl"), ("tiny-qwen3-vl", "qwen3_vl")])
def test_received_attention_on_qwen_equals_the_eager_reference(name, module):
    """`score="received"` (vtoken's proxy where there is no [CLS]): per image, its merged tokens in raster order
    scored by the attention they receive; budget per image, `chunks="auto"`."""
    model, processor = TINY_MODELS[name]()
    images = [make_image(300, 200, 1), make_image(220, 330, 2)]
    inputs = processor(images=images, text=[build_prompt(processor, "what?", 2)], return_tensors="pt")
    method = vtoken.HoloV(budget=0.3, score="received", chunks="auto")
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    scores, merged = _eager_received(model, inputs, module)
    for record, a, x in zip(handle.records, scores, merged, strict=True):
        keep = vtoken.tokens_to_keep(0.3, len(a))
        assert record.kept.tolist() == reference(a, x, keep, "auto") and record.tokens_out == keep


def test_composes_with_an_llm_stage(llava, photos):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, [vtoken.HoloV(), vtoken.FastV(layer=0, keep=0.5)]) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert handle.records[0].tokens_out == 64
    assert any(r.stage.startswith("prefill.") and r.tokens_in == 64 for r in handle.records)
    with torch.no_grad(), vtoken.patched(model, [vtoken.HoloV(), vtoken.SparsePrefill(min_length=1)]) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert handle.records[0].tokens_out == 64


# --------------------------------------------------------------------------- launch counts
def test_a_selection_launches_a_fixed_burst_and_never_syncs_on_single_crop_images():
    """LLaVA-1.5's shapes: no host sync, the same burst of kernels at budgets 64 and 192 and for 1 or 4 images
    (the chunk layout, pure geometry, is built on the first call and cached)."""
    g = torch.Generator().manual_seed(0)
    counted = {}
    for images in (1, 4):
        tokens = _tokens(torch.rand(images, 576, generator=g), torch.randn(images, 576, 64, generator=g))
        tokens.image_of_crop = list(range(images))
        for budget in (64, 192):
            method = vtoken.HoloV(budget=budget)
            method.select(tokens)  # the chunk layout (geometry), built once
            with count_launches() as launches:
                selection = method.select(tokens)
            assert launches.syncs == 0, launches.describe()
            assert selection.kept.shape == (images, budget)
            counted[images, budget] = launches.kernels
    assert len(set(counted.values())) == 1 and max(counted.values()) <= 50, counted


def test_an_image_of_five_crops_reads_its_per_crop_counts_once():
    g = torch.Generator().manual_seed(0)
    tokens = _tokens(torch.rand(5, 576, generator=g), torch.randn(5, 576, 64, generator=g), torch.zeros(5).long())
    tokens.image_of_crop = [0] * 5
    with count_launches() as launches:
        selection = vtoken.HoloV(budget=160).select(tokens)
    assert launches.syncs == 1 and "tolist" in launches.sync_sites[0], launches.describe()
    assert sum(selection.counts_per_crop()) == 160
