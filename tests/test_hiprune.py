"""HiPrune (METHODS-4-images.md): the selection against a plain-loop reference written from the spec's four steps
(the official budgets' anchor counts, the official border's clamping, the in-grid border, ties, the overflow the
official code crashes on, the re-pick defect it keeps fewer than T with, invalid tokens, split budgets), then the
method through `vtoken.patch` on LLaVA-1.5, LLaVA-NeXT (both layouts, "split") and Qwen2.5-VL against eager
attention and the bare language model fed by hand, the received-attention signal on every family against an
eager (or recomputed) reference, padded batches, keep-all identity and the refusals."""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_batch_equals_one_by_one,
    assert_identity,
    captured_llm_input,
    feed_language_model,
    make_image,
    mask_outside_unpadded,
)

import vtoken
from vtoken.methods.base import EncoderMethod
from vtoken.methods.hiprune import anchor_count
from vtoken.tokens import Selection, VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def reference(s, d, keep, width, alpha=0.1, border="official", valid=None):
    """One crop's kept tokens, ascending, by the spec's steps in plain loops: s, d [N] shallow and deep scores,
    `keep` = T (already capped at the valid tokens), `width` = W; invalid tokens are never chosen."""
    n = len(s)
    valid = [True] * n if valid is None else [bool(v) for v in valid]
    usable = [j for j in range(n) if valid[j]]
    if keep >= len(usable):
        return usable
    a = round(alpha * keep / 5)  # Python's round: half to even
    anchors = sorted(usable, key=lambda j: (-float(s[j]), j))[:a]
    buffers = []
    for i in anchors:
        for step in (-1, 1, -width, width):
            j = i + step
            if border == "official":
                j = min(max(j, 0), n - 1)  # clamped: row ends wrap, off the top / bottom lands on 0 / N - 1
            else:
                if not 0 <= j < n or (step == -1 and i % width == 0) or (step == 1 and i % width == width - 1):
                    continue
            if valid[j] and j not in anchors and j not in buffers:
                buffers.append(j)
    by_deep = sorted(buffers, key=lambda j: (-float(d[j]), j))
    if len(anchors) + len(buffers) >= keep:  # the overflow: anchors first, then buffers by d
        return sorted((anchors + by_deep)[:keep])
    rest = sorted((j for j in usable if j not in anchors and j not in buffers), key=lambda j: (-float(d[j]), j))
    return sorted(anchors + buffers + rest[: keep - len(anchors) - len(buffers)])


def official_qwen(s, d, keep, width, alpha=0.1):
    """The official Qwen selection with its defect: anchors and buffers (clamped), then the registers as the top
    T - |A u B| of d after subtracting 1 from the d of A u B, which a token attended more than 1 survives: the
    kept *set* (a re-picked token counts once)."""
    n = len(s)
    a = round(alpha * keep / 5)
    anchors = sorted(range(n), key=lambda j: (-float(s[j]), j))[:a]
    chosen = set(anchors) | {min(max(i + step, 0), n - 1) for i in anchors for step in (-1, 1, -width, width)}
    lowered = [float(d[j]) - (1.0 if j in chosen else 0.0) for j in range(n)]
    registers = sorted(range(n), key=lambda j: (-lowered[j], j))[: keep - len(chosen)]
    return sorted(chosen | set(registers))


def _tokens(s, d, grid, image=None, valid=None, counts=None):
    crops = s.shape[0]
    signals = {"received_attention@object": s, "received_attention": d}
    image = torch.arange(crops) if image is None else image
    return VisualTokens(torch.zeros(crops, s.shape[1], 2), grid, signals, image, valid, valid_counts=counts)


def test_anchor_counts_of_the_official_budgets():
    assert [anchor_count(0.1, t) for t in (192, 128, 64)] == [4, 3, 1]
    assert anchor_count(0.5, 25) == 2  # 2.5: half to even
    assert anchor_count(1.0, 64) == 13


def test_the_official_border_clamps_and_wraps():
    """The spec's verified case: anchors 5, 71, 120, 570 on the 24 x 24 grid keep 0 (5 - 24 clamped), 72 (71 + 1
    wraps to the next row), 119 (120 - 1 wraps back) and 575 (570 + 24 clamped); the in-grid border keeps none of
    them as buffers."""
    s = torch.zeros(1, 576)
    s[0, [5, 71, 120, 570]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    d = torch.linspace(1, 0, 576)[None] * 1e-3  # registers: the lowest indices first
    d[0, [0, 72, 119, 575]] = -1.0  # never registers: kept only as buffers
    official = vtoken.HiPrune(budget=192).select(_tokens(s, d, (24, 24))).kept[0].tolist()
    assert {0, 72, 119, 575} <= set(official) and len(official) == 192
    assert official == reference(s[0], d[0], 192, 24)
    grid = vtoken.HiPrune(budget=192, border="grid").select(_tokens(s, d, (24, 24))).kept[0].tolist()
    assert not {0, 72, 119, 575} & set(grid) and {4, 6, 29, 47, 95, 121, 144, 546, 569, 571} <= set(grid)
    assert grid == reference(s[0], d[0], 192, 24, border="grid")


def test_ties_go_to_the_lower_index():
    """Equal shallow scores: the lowest indices are the anchors; equal deep scores: the lowest registers."""
    s, d = torch.ones(1, 100), torch.ones(1, 100)
    kept = vtoken.HiPrune(budget=50, alpha=0.5).select(_tokens(s, d, (10, 10))).kept[0].tolist()
    assert kept == reference(s[0], d[0], 50, 10, alpha=0.5) == list(range(50))  # anchors 0..4, their buffers, rest


def test_the_overflow_keeps_anchors_then_buffers_by_depth():
    """alpha = 1 at T = 64: 13 anchors and their neighbours exceed T (the official top-k of a negative count
    raises); here all 13 anchors, then the buffers of highest d: exactly 64."""
    g = torch.Generator().manual_seed(0)
    s, d = torch.rand(1, 576, generator=g), torch.rand(1, 576, generator=g)
    kept = vtoken.HiPrune(budget=64, alpha=1.0).select(_tokens(s, d, (24, 24))).kept[0].tolist()
    anchors = s[0].argsort(descending=True, stable=True)[:13].tolist()
    assert len(kept) == 64 and set(anchors) <= set(kept)
    assert kept == reference(s[0], d[0], 64, 24, alpha=1.0)


def test_qwen_sinks_keep_exactly_t_where_the_official_keeps_fewer():
    """Qwen's deep scores sum over queries (sinks far above 1): the official's -1 leaves an attended anchor or
    buffer on top, re-picked, and keeps fewer than T; vtoken excludes them outright: exactly T, a superset."""
    g = torch.Generator().manual_seed(1)
    s = torch.rand(1, 117, generator=g)
    d = torch.rand(1, 117, generator=g) * 0.1
    top = s[0].argsort(descending=True, stable=True)[:2].tolist()
    d[0, top] = 40.0  # the anchors are sinks of the deep block too
    d[0, [top[0] - 1, top[0] + 1]] = 30.0  # and so are two of their neighbours
    keep = vtoken.tokens_to_keep(0.223, 117)  # 26: a = round(0.52) = 1 anchor
    kept = vtoken.HiPrune(budget=0.223).select(_tokens(s, d, (9, 13))).kept[0].tolist()
    official = official_qwen(s[0], d[0], keep, 13)
    assert len(kept) == keep == reference(s[0], d[0], keep, 13).__len__() and len(official) < keep
    assert kept == reference(s[0], d[0], keep, 13) and set(official) <= set(kept)


@pytest.mark.parametrize("border", ["official", "grid"])
@pytest.mark.parametrize(
    "grid, budget, alpha",
    [((24, 24), 192, 0.1), ((24, 24), 128, 0.1), ((24, 24), 64, 0.1), ((5, 5), 25, 0.5), ((9, 13), 0.112, 0.1),
     ((7, 3), 0.9, 1.0)],
)  # fmt: skip
def test_random_crops_equal_the_reference(border, grid, budget, alpha):
    """Several crops, scattered invalid tokens (never chosen, neighbours skipped; T capped at the valid ones)."""
    n = grid[0] * grid[1]
    g = torch.Generator().manual_seed(n)
    s, d = torch.rand(3, n, generator=g) ** 3, torch.rand(3, n, generator=g) ** 3
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[1, ::4] = False
    valid[2, n // 2 :] = False
    counts = valid.sum(1).tolist()
    selection = vtoken.HiPrune(budget=budget, alpha=alpha, border=border).select(
        _tokens(s, d, grid, valid=valid, counts=counts)
    )
    for c in range(3):
        keep = vtoken.tokens_to_keep(budget, counts[c])
        want = reference(s[c], d[c], keep, grid[1], alpha, border, valid[c])
        assert selection.kept_of(c).tolist() == want


def test_split_budgets_share_an_image_equally_over_its_crops():
    """scope="split": an image's T over its c crops, floor(T / c) each (the official int(RETENTION / crops)), at
    most a crop's valid tokens; a single-crop image keeps T."""
    g = torch.Generator().manual_seed(2)
    s, d = torch.rand(4, 36, generator=g), torch.rand(4, 36, generator=g)
    valid = torch.ones(4, 36, dtype=torch.bool)
    valid[2, 6:] = False  # crop 2 has 6 valid tokens
    image = torch.tensor([0, 0, 0, 1])
    method = vtoken.HiPrune(budget=40, scope="split")
    selection = method.select(_tokens(s, d, (6, 6), image, valid, [36, 36, 6, 36]))
    assert selection.counts == [13, 13, 6, 36]  # 40 // 3 = 13, capped at 6; image 1: min(40, 36)
    for c, keep in enumerate([13, 13, 6, 36]):
        assert selection.kept_of(c).tolist() == reference(s[c], d[c], keep, 6, valid=valid[c])
    assert vtoken.HiPrune(budget=640, scope="split").count_before_encoding(576, (24, 24), 5) == 128
    assert vtoken.HiPrune(budget=640, scope="split").count_before_encoding(576, (24, 24), 3) == 213
    assert vtoken.HiPrune(budget=640, scope="split").planned_count(576) is None


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(alpha=1.5), "alpha=1.5"),
        (dict(alpha=math.nan), "alpha=nan"),
        (dict(border="wrap"), "border='wrap'; accepted: official, grid"),
        (dict(score="keys"), "score='keys'; accepted: received, cls"),
        (dict(scope="image"), "scope='image'; accepted: crop, split"),
        (dict(object_layer=1.5), "object_layer=1.5"),
        (dict(deep_layer=True), "deep_layer=True"),
        (dict(budget=0), "budget=0"),
    ],
)
def test_parameters_are_checked_at_construction(params, match):
    with pytest.raises(vtoken.VTokenError, match=match):
        vtoken.HiPrune(**params)


def test_layers_default_to_the_official_blocks_per_family():
    method = vtoken.HiPrune()
    assert method.requires == ("received_attention@object", "received_attention")  # deep: the feature layer's
    assert method.tower_block("object", "llava-1.5", 24) == 8 == method.tower_block("object", "llava-next", 24)
    assert method.tower_block("object", "qwen2.5-vl", 32) == 15
    assert method.tower_block("object", "llava-onevision", 26) == 12  # depth // 2 - 1
    assert method.tower_block("object", "llava-1.5", 3) == 0  # a tower too shallow for block 8
    assert vtoken.HiPrune(object_layer=3, deep_layer=-1, score="cls").requires == (
        "cls_attention@3",
        "cls_attention@-1",
    )


# --------------------------------------------------------------------------- the signal, on every family
@dataclass
class Recorder(EncoderMethod):
    """Keeps every token and records the signals it was given (a test's window on the adapters)."""

    budget: float = 1.0
    wanted: tuple = ("received_attention@0", "received_attention")
    seen: list = None

    name = "recorder"
    modalities = ("image",)

    @property
    def requires(self):
        return self.wanted

    def select(self, tokens: VisualTokens) -> Selection:
        self.seen.append({k: tokens.signals[k].detach().clone() for k in self.wanted})
        return Selection(kept=torch.arange(tokens.num_tokens).expand(tokens.num_crops, -1))


def recorded(model, inputs, wanted=("received_attention@0", "received_attention")):
    method = Recorder(wanted=wanted, seen=[])
    with torch.no_grad(), vtoken.patched(model, method):
        model(**inputs)
    return method.seen


def received(maps: torch.Tensor) -> torch.Tensor:
    """[B, H, S, S] post-softmax maps -> [B, S]: mean over heads, then over query rows."""
    return maps.float().mean(1).mean(1)


def eager_maps(tower, call):
    """Every block's attention maps of an eager copy of a transformers tower (CLIP, SigLIP, InternViT)."""
    import copy

    eager = copy.deepcopy(tower)
    eager.config._attn_implementation = "eager"
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        return call(eager).attentions


def _inputs(processor, size=(300, 400)):
    return processor(images=[make_image(*size)], text=[build_prompt(processor, "what?")], return_tensors="pt")


def test_llava_received_attention_equals_eager_attention():
    """Block L's maps, head mean then query mean ([CLS] row included), the [CLS] column dropped; bare name: the
    feature layer's block (vision_feature_layer -2)."""
    model, processor = TINY_MODELS["tiny-llava"]()
    inputs = _inputs(processor)
    (seen,) = recorded(model, inputs)
    maps = eager_maps(model.model.vision_tower, lambda t: t(inputs["pixel_values"], output_attentions=True))
    torch.testing.assert_close(seen["received_attention@0"], received(maps[0])[:, 1:], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(seen["received_attention"], received(maps[-2])[:, 1:], rtol=1e-5, atol=1e-7)


def test_gemma3_received_attention_is_pooled_like_the_tokens():
    model, processor = TINY_MODELS["tiny-gemma3"]()
    inputs = _inputs(processor)
    (seen,) = recorded(model, inputs)
    maps = eager_maps(
        model.model.vision_tower, lambda t: t(pixel_values=inputs["pixel_values"], output_attentions=True)
    )
    side = model.model.multi_modal_projector.patches_per_image
    pool = model.model.multi_modal_projector.tokens_per_side
    for name, block in (("received_attention@0", 0), ("received_attention", -1)):
        per_patch = received(maps[block]).view(-1, 1, side, side)
        want = F.avg_pool2d(per_patch, side // pool).flatten(1)
        torch.testing.assert_close(seen[name], want, rtol=1e-5, atol=1e-7)


def test_internvl_received_attention_is_each_pixel_shuffle_groups_mean():
    model, processor = TINY_MODELS["tiny-internvl"]()
    inputs = _inputs(processor)
    (seen,) = recorded(model, inputs)
    tower = model.model.vision_tower
    maps = eager_maps(tower, lambda t: t(pixel_values=inputs["pixel_values"], output_attentions=True))
    side = tower.config.image_size[0] // tower.config.patch_size[0]
    layer = model.config.vision_feature_layer % (len(tower.encoder.layer) + 1) - 1
    for name, block in (("received_attention@0", 0), ("received_attention", layer)):
        per_patch = received(maps[block])[:, 1:].reshape(-1, 1, side, side)
        torch.testing.assert_close(seen[name], F.avg_pool2d(per_patch, 2).flatten(1), rtol=1e-5, atol=1e-7)


def test_perception_lm_received_attention_from_timms_own_softmax():
    """timm's unfused path (`fused_attn=False`) passes the post-softmax map through `attn_drop`: recorded there,
    with timm's own RoPE; the [CLS] column dropped, pooled like the tokens."""
    import copy

    model, processor = TINY_MODELS["tiny-perception-lm"]()
    inputs = _inputs(processor)
    (seen,) = recorded(model, inputs)
    timm_model = copy.deepcopy(model.model.vision_tower.timm_model)
    maps = {}
    for b, block in enumerate(timm_model.blocks):
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda m, a, out, b=b: maps.__setitem__(b, out))
    with torch.no_grad():
        timm_model.forward_features(inputs["pixel_values"].flatten(0, 1))
    adapter = vtoken.patch(model, Recorder(seen=[])).adapter
    try:
        for name, block in (("received_attention@0", 0), ("received_attention", len(maps) - 1)):
            want = adapter.pooled_scores(received(maps[block])[:, 1:])
            torch.testing.assert_close(seen[name], want, rtol=1e-5, atol=1e-7)
    finally:
        vtoken.unpatch(model)


def test_onevision_received_attention_follows_the_models_own_packing():
    """Per crop the SigLIP maps' column means, then the model's own stitching, unpadding and downsampling of them
    as one-channel features: the base view's, then the stitched grid's (selected apart)."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = _inputs(processor, (500, 260))
    base, grid = recorded(model, inputs)
    maps = eager_maps(model.model.vision_tower, lambda t: t(inputs["pixel_values"][0], output_attentions=True))
    for name, block in (("received_attention@0", 0), ("received_attention", -1)):
        scores = received(maps[block])[:, :, None]
        packed, _ = model.model.pack_image_features([scores], inputs["image_sizes"], image_newline=None,
                                                    vision_aspect_ratio=model.config.vision_aspect_ratio)  # fmt: skip
        side = model.config.vision_config.image_size // model.config.vision_config.patch_size
        torch.testing.assert_close(base[name][0], packed[0][: side * side, 0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grid[name][0], packed[0][side * side :, 0], rtol=1e-5, atol=1e-7)


def qwen_received(model, inputs, block):
    """Independent Qwen signal: block `block`'s q/k recomputed from its input (float64), the attention every patch
    receives over its whole frame (windows ignored), mean over heads and queries, then each 2 x 2 merge group's
    mean, put in raster order; per image."""
    from test_fastvid import qwen_block_query_keys
    from transformers.vision_utils import get_vision_window_index

    visual = model.model.visual
    q, k = qwen_block_query_keys(model, inputs, visual.blocks[block].attn)
    grid = inputs["image_grid_thw"]
    sizes = grid.prod(-1).tolist()
    groups = []
    for qi, ki in zip(q.split(sizes), k.split(sizes), strict=True):
        probs = (torch.einsum("shd,thd->hst", qi, ki) * qi.shape[-1] ** -0.5).softmax(-1)
        groups.append(probs.mean(0).mean(0).view(-1, 4).mean(1))
    values = torch.cat(groups)
    if hasattr(visual, "fullatt_block_indexes"):  # window order -> raster order
        index, _ = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size, visual.patch_size)
        values = values[index.argsort()]
    return values.split([n // 4 for n in sizes])


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_qwen_received_attention_over_whole_frames_in_raster_order(name):
    """Qwen2.5-VL's block 0 attends within windows: the signal still reads its q/k over the whole frame (as the
    official flash run); two images of different sizes, one record each."""
    model, processor = TINY_MODELS[name]()
    images = [make_image(300, 200, 1), make_image(220, 330, 2)]
    inputs = processor(images=images, text=[build_prompt(processor, "what?", 2)], return_tensors="pt")
    seen = recorded(model, inputs)
    last = len(model.model.visual.blocks) - 1
    for signal, block in (("received_attention@0", 0), ("received_attention", last)):
        for item, want in zip(seen, qwen_received(model, inputs, block), strict=True):
            torch.testing.assert_close(item[signal][0].double(), want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- through vtoken.patch
def llava_scores(model, inputs, object_block, deep_block):
    tower = model.model.vision_tower
    maps = eager_maps(tower, lambda t: t(inputs["pixel_values"], output_attentions=True))
    with torch.no_grad():
        hidden = tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        projected = model.model.multi_modal_projector(hidden)
    return received(maps[object_block])[:, 1:], received(maps[deep_block])[:, 1:], projected


@pytest.mark.parametrize("budget, border", [(192, "official"), (128, "official"), (64, "grid"), (0.112, "official")])
def test_llava_equals_the_reference_and_the_language_model_fed_by_hand(budget, border):
    """The official budgets; the tiny tower (3 blocks) is too shallow for block 8: the object layer is block
    3 // 2 - 1 = 0, the deep one the feature layer's block 1."""
    model, processor = TINY_MODELS["tiny-llava"]()
    inputs = _inputs(processor)
    with torch.no_grad(), vtoken.patched(model, vtoken.HiPrune(budget=budget, border=border)) as handle:
        logits = model(**inputs).logits
    s, d, projected = llava_scores(model, inputs, 0, 1)
    keep = vtoken.tokens_to_keep(budget, 576)
    kept = reference(s[0], d[0], keep, 24, border=border)
    assert handle.records[0].kept.tolist() == kept and handle.records[0].tokens_out == keep
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, projected[0, kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def _next_crops(model, inputs, count):
    crops = inputs["pixel_values"][0, :count]
    tower = model.model.vision_tower
    maps = eager_maps(tower, lambda t: t(crops, output_attentions=True))
    with torch.no_grad():
        projected = model.model.multi_modal_projector(tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:])
    return received(maps[0])[:, 1:], received(maps[1])[:, 1:], projected


@pytest.mark.parametrize("size, budget", [((800, 300), 640), ((336, 700), 160), ((500, 500), 0.25)])
def test_llava_next_official_split_packs_base_then_the_stitched_raster(size, budget):
    """The official LLaVA-NeXT run: scope="split", layout="official": every crop keeps floor(T / c) of all its
    tokens; the LLM gets the base view's kept tokens, then the grid crops' in the stitched raster, no newline."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = _inputs(processor, size)
    method = vtoken.HiPrune(budget=budget, scope="split")
    with torch.no_grad(), vtoken.patched(model, method, layout="official") as handle:
        logits = model(**inputs).logits
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    count = layout.num_crops
    s, d, projected = _next_crops(model, inputs, count)
    share = vtoken.tokens_to_keep(budget, 576 * count) // count
    kept = [reference(s[c], d[c], share, 24) for c in range(count)]
    assert [r.kept.tolist() for r in handle.records] == kept
    order = [(0, j) for j in kept[0]]
    stitched = []
    for c in range(1, count):
        row, col = divmod(c - 1, layout.cols)
        stitched += [((row * 24 + j // 24) * layout.cols * 24 + col * 24 + j % 24, c, j) for j in kept[c]]
    order += [(c, j) for _, c, j in sorted(stitched)]
    visual = torch.stack([projected[c, j] for c, j in order])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_llava_next_native_never_picks_the_unpadded_border():
    """Native layout: the padded border's tokens are invalid (never anchors, buffers or registers; T capped at a
    crop's valid tokens), and the model's own packing (newlines after rows that keep tokens) follows."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = _inputs(processor, (800, 300))
    with torch.no_grad(), vtoken.patched(model, vtoken.HiPrune(budget=0.3)) as handle:
        model(**inputs)
    layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    s, d, _ = _next_crops(model, inputs, layout.num_crops)
    for c, record in enumerate(handle.records):
        valid = mask_outside_unpadded(torch.zeros(576), c, layout) > -math.inf
        keep = vtoken.tokens_to_keep(0.3, int(valid.sum()))
        assert record.tokens_in == int(valid.sum())
        assert record.kept.tolist() == reference(s[c], d[c], keep, 24, valid=valid)


def test_qwen25_official_budgets_with_original_positions():
    """Qwen2.5-VL, the official r = 0.334 / 0.223 / 0.112 per image: kept merged tokens equal the reference on the
    recomputed signals; the LLM gets exactly them (checked on its input embeddings) and T tokens."""
    model, processor = TINY_MODELS["tiny-qwen2.5-vl"]()
    inputs = processor(images=[make_image(300, 200, 1)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    (s,), (d,) = qwen_received(model, inputs, 0), qwen_received(model, inputs, 1)
    t, h, w = inputs["image_grid_thw"][0].tolist()
    with torch.no_grad():
        merged = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    for budget in (0.334, 0.223, 0.112):
        with torch.no_grad(), vtoken.patched(model, vtoken.HiPrune(budget=budget)) as handle:
            embeds = captured_llm_input(model, inputs)
        keep = vtoken.tokens_to_keep(budget, len(s))
        kept = reference(s, d, keep, w // 2)
        assert handle.records[0].kept.tolist() == kept and handle.records[0].tokens_out == keep
        run = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0]
        torch.testing.assert_close(embeds[0, run : run + keep], merged[kept], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl", "tiny-internvl"])
def test_identity_and_a_padded_batch_equals_its_rows(name):
    model, processor = TINY_MODELS[name]()
    assert_identity(model, "hiprune", _inputs(processor))
    prompts = [build_prompt(processor, q) for q in ("what is it?", "describe it.")]
    images = [make_image(*size, i) for i, size in enumerate([(800, 300), (336, 500)])]
    batched = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(images=[im], text=[p], return_tensors="pt") for im, p in zip(images, prompts, strict=True)]
    with torch.no_grad(), vtoken.patched(model, vtoken.HiPrune(budget=0.2, scope="split")):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)


def test_refusals():
    """FastVLM: HiPrune, and SCOPE in both forms ([CLS] named with its variant, then the variant itself)."""
    model, processor = TINY_MODELS["tiny-fastvlm"]()
    with pytest.raises(vtoken.MissingSignalError, match=r"received_attention.*received_attention@L.*FastViTHD"):
        vtoken.patch(model, "hiprune")
    with pytest.raises(vtoken.MissingSignalError, match='cls_attention.*saliency="received"'):
        vtoken.patch(model, "scope")
    with pytest.raises(vtoken.MissingSignalError, match="received_attention.*FastViTHD"):
        vtoken.patch(model, vtoken.SCOPE(saliency="received"))
    assert vtoken.handle_of(model) is None
    model, _ = TINY_MODELS["tiny-qwen2.5-vl"]()
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention.*score='received'"):
        vtoken.patch(model, vtoken.HiPrune(score="cls"))
    with pytest.raises(vtoken.MissingSignalError, match="received_attention@7"):
        vtoken.patch(model, vtoken.HiPrune(object_layer=7))  # the tiny tower has 2 blocks
    model, _ = TINY_MODELS["tiny-onevision"]()
    with pytest.raises(vtoken.VTokenError, match="scope='split'.*base view and its stitched grid apart"):
        vtoken.patch(model, vtoken.HiPrune(scope="split"))
    assert vtoken.handle_of(model) is None


def test_videos_are_refused_when_the_call_starts():
    from conftest import video_inputs

    model, processor = TINY_MODELS["tiny-qwen2.5-vl"]()
    with vtoken.patched(model, "hiprune"), pytest.raises(vtoken.InputError, match="hiprune acts on image inputs"):
        model(**video_inputs(processor))


# --------------------------------------------------------------------------- the tools
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2.5-vl", "tiny-onevision"])
def test_applicable_methods_and_the_variants_the_tools_pick(name):
    """HiPrune applies (its object layer resolved on the tower); SCOPE's [CLS] saliency where there is a [CLS], its
    received variant where the tower serves it (what the demo and `vtoken eval` start from). (FastVLM refuses both:
    `test_refusals`.)"""
    from vtoken.applicability import applicable_methods, fitting_params

    model, _ = TINY_MODELS[name]()
    verdicts = applicable_methods(model)
    assert verdicts["hiprune"] is None and verdicts["scope"] is None, (verdicts["hiprune"], verdicts["scope"])
    assert fitting_params(model, "hiprune") == {"object_layer": 0}  # a 2-3 block tower: depth // 2 - 1
    assert fitting_params(model, "scope") == ({} if name == "tiny-llava" else {"saliency": "received"})


def test_the_cli_eval_and_demo_take_them_by_name(capsys):
    from vtoken.cli import main, method_params
    from vtoken.demo import controls
    from vtoken.eval.options import build_methods
    from vtoken.eval.sweep import settings

    assert main(["run", "--method", "hiprune", "--budget", "36"]) == 0
    assert "hiprune" in capsys.readouterr().out
    hiprune, fastv = build_methods("hiprune+fastv", {"budget": 64, "border": "grid", "keep": 0.5}, [])
    assert (hiprune.budget, hiprune.border, fastv.keep) == (64, "grid", 0.5)
    (scope,) = build_methods("scope", {"budget": 160, "scope": "split", "saliency": "received"}, [])
    assert (scope.budget, scope.scope, scope.saliency) == (160, "split", "received")
    points = settings(["hiprune", "scope"], [64, 0.25], {})
    assert [(p.method, p.budget) for p in points][1:] == [(m, b) for m in ("hiprune", "scope") for b in (64, 0.25)]
    assert method_params("scope", None, ["saliency=received", "alpha=0.5"]) == {
        "scope.budget": 0.25, "saliency": "received", "alpha": 0.5,
    }  # fmt: skip
    specs = {(c.method, c.param): c.kind for c in controls.control_specs()}
    assert specs[("hiprune", "border")] == "choice" and specs[("hiprune", "scope")] == "choice"
    assert specs[("scope", "saliency")] == "choice" and specs[("scope", "alpha")] == "float"
    model, _ = TINY_MODELS["tiny-qwen2.5-vl"]()
    assert controls.default_params(model, "scope")["saliency"] == "received"


def test_internvl_videos_are_refused_too():
    """InternVL's videos arrive as runs of image tiles ("FrameN:" labels tell them apart): an image-only method
    refuses them when the call starts, as on the families with a video input."""
    from conftest import video_inputs

    model, processor = TINY_MODELS["tiny-internvl"]()
    with vtoken.patched(model, vtoken.HiPrune()), pytest.raises(vtoken.InputError, match="hiprune takes images only"):
        model(**video_inputs(processor))
