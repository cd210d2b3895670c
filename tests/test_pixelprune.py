"""PixelPrune (METHODS-4-tower.md): its selection against an independent reference written here from the spec text
(units made from the processor's pixel rows by hand, the raster-loop predictor, anchored and sliding), the Triton
kernel against the CPU op under TRITON_INTERPRET=1, the spec's defects (images numbered across the batch,
per-channel de-normalisation), and the towers: keep-all identity on every Qwen-VL tower, the pruned tower equal to
the stock forward fed transformers' own tables restricted to the kept groups, batch = images alone, CLIP/SigLIP
towers on [CLS] and the kept patches; launch counts (no sync beyond the one read of the kept mask)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import vtoken
from vtoken.adapters.tower import KeptPatches, pixel_normalisation, qwen_pruned_tower, qwen_tables, tower_shape
from vtoken.errors import InputError, VTokenError
from vtoken.launches import count_launches
from vtoken.methods.base import TowerShape
from vtoken.methods.pixelprune import PixelPrune, unit_values
from vtoken.question import processor_for, remember_tokenizer
from vtoken.zoo import TINY_MODELS

QWEN = {"tiny-qwen2-vl": "qwen2-vl", "tiny-qwen2.5-vl": "qwen2.5-vl", "tiny-qwen3-vl": "qwen3-vl",
        "tiny-qwen3.5": "qwen3.5"}  # fmt: skip


def document(height: int, width: int, seed: int = 0, cell: int = 16) -> Image.Image:
    """A screen-like image: white page, a grey bar, text-like blocks of random ink on a cell x cell lattice, a
    repeated motif (so that whole groups repeat); exact colours (no resize at a multiple of the group size)."""
    rng = np.random.default_rng(seed)
    page = np.full((height, width, 3), 255, np.uint8)
    page[: cell * 2] = (230, 230, 236)
    for y in range(cell * 3, height - cell, cell):
        for x in range(cell, width - 2 * cell, cell):
            if rng.random() < 0.35:
                page[y : y + cell // 2, x : x + cell] = rng.integers(0, 120, 3)
    motif = rng.integers(0, 255, (cell, cell, 3), dtype=np.uint8)
    page[-cell:, : width // 2] = np.tile(motif, (1, width // 2 // cell + 1, 1))[:, : width // 2]
    return Image.fromarray(page)


@pytest.fixture(scope="module")
def qwen_models():
    return {name: TINY_MODELS[name]() for name in QWEN}


def qwen_inputs(processor, images):
    out = processor.image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]


# ----------------------------------------------------------------- the reference, from the spec text
def ref_units(pixel_values, grids, mean, std, channels, temporal, patch):
    """Per image, [h', w', D] units: group g = pixel rows 4g..4g+3, frame 0 of each, value * std[c] + mean[c]."""
    out, row = [], 0
    for _, h, w in grids:
        groups = []
        for _ in range((h // 2) * (w // 2)):
            rows = pixel_values[row : row + 4].double().view(4, channels, temporal, patch, patch)[:, :, 0]
            for c in range(channels):
                rows[:, c] = rows[:, c] * std[c] + mean[c]
            groups.append(rows.reshape(-1))
            row += 4
        out.append(torch.stack(groups).float().view(h // 2, w // 2, -1))
    return out


def ref_distance(x, y, metric):
    diff = (x.double() - y.double()).abs()
    return {"max": diff.max(), "mae": diff.mean(), "rmse": diff.square().mean().sqrt()}[metric].item()


def ref_predict(units, tau, metric, anchored=True):
    """[h', w'] kept flags by the LOCO-I predictor in raster order (R: the reconstruction; sliding: R = u)."""
    height, width = units.shape[:2]
    recon = units.clone()
    keep = torch.ones(height, width, dtype=torch.bool)

    def sim(x, y):
        return ref_distance(x, y, metric) <= tau

    for r in range(height):
        for c in range(width):
            if r == 0 and c == 0:
                continue
            source = recon if anchored else units
            if r == 0:
                pred = source[0, c - 1]
            elif c == 0:
                pred = source[r - 1, 0]
            else:
                a, b, cc = source[r, c - 1], source[r - 1, c], source[r - 1, c - 1]
                pred = b if sim(cc, a) and not sim(cc, b) else a
            if sim(units[r, c], pred):
                keep[r, c] = False
                recon[r, c] = pred
    return keep.flatten()


# ----------------------------------------------------------------- selection
@pytest.mark.parametrize("threshold, metric, anchored", [(0.0, "max", True), (0.06, "max", True),
                                                         (0.02, "mae", True), (0.05, "rmse", False)])  # fmt: skip
def test_selection_matches_the_reference(qwen_models, threshold, metric, anchored):
    model, processor = qwen_models["tiny-qwen3-vl"]
    images = [document(96, 160, seed=1, cell=32), document(160, 96, seed=2, cell=32), document(64, 64, seed=3)]
    pixels, grids = qwen_inputs(processor, images)
    shape = tower_shape(model, "qwen3-vl")
    method = PixelPrune(threshold=threshold, metric=metric, anchored=anchored)
    selected = method.select_input(pixels, grids, shape)
    vision = model.config.vision_config
    units = ref_units(pixels, grids, shape.mean, shape.std, 3, vision.temporal_patch_size, vision.patch_size)
    want = [ref_predict(u, threshold, metric, anchored) for u in units]
    assert selected.counts == [int(w.sum()) for w in want]
    assert selected.keep.tolist() == torch.cat(want).tolist()
    assert method.count_before_encoding(grids, pixels, shape) == selected.counts
    assert 0 < sum(selected.counts) < sum(u.shape[0] * u.shape[1] for u in units)  # the pages repeat themselves


def test_negative_threshold_keeps_every_unit_and_zero_drops_exact_repeats_only():
    shape = TowerShape("qwen3-vl", merge=2, patch=2, temporal=1, channels=1, mean=(0.0,), std=(1.0,))
    # a 3 x 4 unit grid, each unit 2x2 patches of 2x2 values: one value per unit, repeated
    values = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1], [2, 0, 1, 1]], dtype=torch.float32)
    rows = values.flatten().repeat_interleave(4)[:, None].expand(-1, 4).contiguous()
    assert PixelPrune(threshold=-1.0).select_input(rows, [(1, 6, 8)], shape).counts == [12]
    kept = PixelPrune().select_input(rows, [(1, 6, 8)], shape).keep.view(3, 4)
    assert kept.tolist() == ref_predict(values[..., None], 0.0, "max").view(3, 4).tolist()
    assert kept.tolist() == [[True, False, False, True], [False, False, True, False], [True, True, False, False]]


def test_images_are_numbered_across_the_batch(qwen_models):
    # defect (a) of the official HF patch: a second image reused the first one's grid and kept set
    model, processor = qwen_models["tiny-qwen2-vl"]
    shape = tower_shape(model, "qwen2-vl")
    images = [document(112, 168, seed=4, cell=28), document(56, 112, seed=5, cell=28)]
    pixels, grids = qwen_inputs(processor, images)
    together = PixelPrune(threshold=0.05).select_input(pixels, grids, shape)
    first = 0
    for image, grid in zip(images, grids, strict=True):
        alone_pixels, alone_grids = qwen_inputs(processor, [image])
        alone = PixelPrune(threshold=0.05).select_input(alone_pixels, alone_grids, shape)
        assert alone_grids == [grid]
        count = grid[1] * grid[2] // 4
        assert together.keep[first : first + count].tolist() == alone.keep.tolist()
        first += count
    assert together.counts[1] == int(together.keep[grids[0][1] * grids[0][2] // 4 :].sum())


def test_units_are_de_normalised_per_channel(qwen_models):
    # defect (c): CLIP's mean/std (Qwen2-VL); the official's x * 0.5 + 0.5 is wrong there
    model, processor = qwen_models["tiny-qwen2.5-vl"]
    shape = tower_shape(model, "qwen2.5-vl")
    assert shape.mean != (0.5, 0.5, 0.5) and len(set(shape.std)) == 3
    page = np.full((56, 56, 3), 200, np.uint8)
    page[:, 28:, 2] += 4  # the right column of groups 4/255 brighter in blue: a 4/255 distance
    pixels, grids = qwen_inputs(processor, [Image.fromarray(page)])
    assert grids == [(1, 4, 4)]  # 2 x 2 groups
    values = unit_values(pixels, grids, shape).view(4, 4, 3, 14, 14)  # units, patches, channels
    want = torch.tensor([200, 200, 200]).float() / 255
    torch.testing.assert_close(values[0].mean((0, 2, 3)), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(values[1].mean((0, 2, 3)), want + torch.tensor([0, 0, 4 / 255]), atol=1e-6, rtol=0)
    assert PixelPrune(threshold=5 / 255).select_input(pixels, grids, shape).counts == [1]
    assert PixelPrune(threshold=3 / 255).select_input(pixels, grids, shape).counts == [2]
    official = (pixels.view(4, 4, 3, 2, 14, 14)[:, :, :, 0] * 0.5 + 0.5).flatten(1)
    assert (official[1] - official[0]).abs().max() > 5 / 255  # the official normaliser would keep it


def test_videos_are_refused(qwen_models):
    model, _ = qwen_models["tiny-qwen2-vl"]
    with pytest.raises(InputError, match="videos are not supported"):
        PixelPrune().select_input(torch.zeros(2 * 16, 1176), [(2, 4, 4)], tower_shape(model, "qwen2-vl"))


def test_refusals_and_parameters():
    method = PixelPrune()
    for family in ("qwen3-vl", "qwen3.5", "qwen2-vl", "qwen2.5-vl", "llava-1.5", "llava-next", "llava-onevision"):
        method.check_family(family)
    for family, why in (("internvl", "pixel-shuffles"), ("gemma3", "4x4"), ("fastvlm", "convolutional")):
        with pytest.raises(VTokenError, match=f"pixelprune \\(tower stage\\) is refused on {family}: .*{why}"):
            method.check_family(family)
    for bad in (dict(threshold=float("inf")), dict(metric="l2"), dict(anchored=0)):
        with pytest.raises(VTokenError, match="pixelprune"):
            PixelPrune(**bad)


def test_normalisation_comes_from_the_processor_then_the_checkpoint_then_the_family(tmp_path):
    from transformers import Qwen2VLImageProcessor

    model, processor = TINY_MODELS["tiny-qwen3-vl"]()
    assert processor_for(model) is processor  # vtoken.zoo's builders remember it
    assert pixel_normalisation(model, "qwen3-vl")[:2] == (tuple(processor.image_processor.image_mean),
                                                         tuple(processor.image_processor.image_std))  # fmt: skip
    from vtoken import question

    bare = TINY_MODELS["tiny-qwen3-vl"]()[0]
    question._PROCESSORS.pop(bare)  # as if the user never gave vtoken its processor
    remember_tokenizer(bare, processor.tokenizer)  # a tokenizer alone: no processor kept
    assert processor_for(bare) is None
    Qwen2VLImageProcessor(image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6]).save_pretrained(tmp_path)
    bare.name_or_path = str(tmp_path)
    assert pixel_normalisation(bare, "qwen3-vl")[:2] == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    bare.name_or_path = str(tmp_path / "missing")
    assert pixel_normalisation(bare, "qwen3-vl")[:2] == ((0.5,) * 3, (0.5,) * 3)  # Qwen3-VL's checkpoints
    with pytest.raises(VTokenError, match="remember_tokenizer"):
        pixel_normalisation(bare, "some-family")


CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from vtoken.kernels.pixel_prediction import anchored_prediction_reference, anchored_prediction_triton
    g = torch.Generator().manual_seed(0)
    grids = [(5, 7), (3, 4), (1, 6), (6, 1), (1, 1)]
    sizes = [h * w for h, w in grids]
    units = torch.randint(0, 4, (sum(sizes), 16), generator=g).float() / 8  # distances far from the thresholds
    units[1::2] = units[:-1:2] + torch.randint(0, 2, units[1::2].shape, generator=g).float() / 16
    units = units.to("{device}")
    starts = torch.tensor(np.cumsum([0] + sizes[:-1])).to("{device}")
    heights = torch.tensor([h for h, _ in grids]).to("{device}")
    widths = torch.tensor([w for _, w in grids]).to("{device}")
    for metric, tau in (("max", 0.07), ("mae", 0.03), ("rmse", 0.1)):
        want = anchored_prediction_reference(units, starts, heights, widths, tau, metric)
        got = anchored_prediction_triton(units, starts, heights, widths, tau, metric)
        assert torch.equal(got.cpu(), want.cpu()), (metric, tau)
        assert 0 < int(want.sum()) < len(want)
    print("kernel ok")
    """
)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_anchored_kernel_matches_the_raster_loop(device):
    pytest.importorskip("triton")
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        pytest.skip("no GPU")
    command = [sys.executable, "-c", CHECK.format(device=device)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    assert "kernel ok" in result.stdout, result.stderr[-3000:]


def test_the_op_is_the_reference(qwen_models):
    from vtoken.kernels.pixel_prediction import anchored_prediction

    units = torch.randint(0, 3, (4 * 5, 6), generator=torch.Generator().manual_seed(3)).float() / 4
    got = anchored_prediction(units, torch.tensor([0]), torch.tensor([4]), torch.tensor([5]), 0.3, "mae")
    assert got.tolist() == ref_predict(units.view(4, 5, 6), 0.3, "mae").tolist()


def test_selection_launches_a_fixed_burst_and_reads_the_mask_once(qwen_models):
    model, processor = qwen_models["tiny-qwen3-vl"]
    shape = tower_shape(model, "qwen3-vl")
    bursts = {}
    for images in (1, 3):
        pixels, grids = qwen_inputs(processor, [document(96, 160, seed=s, cell=32) for s in range(images)])
        for method in (PixelPrune(), PixelPrune(threshold=0.05), PixelPrune(threshold=0.05, anchored=False)):
            with count_launches() as launches:
                selected = method.select_input(pixels, grids, shape)
            assert launches.syncs == 1, launches.describe()  # the one read of the kept mask
            bursts.setdefault(repr(method), set()).add(launches.kernels)
            with count_launches() as launches:
                qwen_tables(model.model.visual, grids, selected, "cpu")
            assert launches.kernels == 0 and launches.syncs == 0, launches.describe()
    assert all(len(kernels) == 1 for kernels in bursts.values()), bursts  # the same for 1 and 3 images
    assert max(k for kernels in bursts.values() for k in kernels) <= 40
    assert bursts[repr(PixelPrune(threshold=0.05))] == {3}  # de-normalise (mul, add), the op


# ----------------------------------------------------------------- Qwen-VL towers
@pytest.mark.parametrize("name", list(QWEN))
def test_keep_all_is_the_unpatched_tower(qwen_models, name):
    model, processor = qwen_models[name]
    visual = model.model.visual
    pixels, grids = qwen_inputs(processor, [document(96, 160, seed=1, cell=32), document(64, 128, seed=2)])
    selected = PixelPrune(threshold=-1.0).select_input(pixels, grids, tower_shape(model, QWEN[name]))
    with torch.no_grad():
        want = visual(pixels, grid_thw=torch.tensor(grids))
        got = qwen_pruned_tower(visual, pixels, grids, selected)
    assert torch.equal(got.pooler_output, want.pooler_output)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    for a, b in zip(getattr(want, "deepstack_features", None) or [], getattr(got, "deepstack_features", None) or [],
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def stock_tables(visual, grids, kept_groups, counts):
    """What the stock forward computes from the full grid (transformers' own helpers), restricted here to the kept
    groups: the independent side of `test_pruned_tower_is_the_stock_tower_on_the_kept_groups`."""
    from transformers import vision_utils as vu

    grid_thw = torch.tensor(grids)
    rows = (torch.as_tensor(kept_groups)[:, None] * 4 + torch.arange(4)).flatten()
    out = {"position_ids": vu.get_vision_position_ids(grid_thw, 2)[rows]}
    out["cu_seqlens"] = torch.tensor([0, *np.cumsum([4 * c for c in counts])], dtype=torch.int32)
    if hasattr(visual, "num_grid_per_side"):
        indices, weights = vu.get_vision_interpolation_indices_and_weights(
            grid_thw, visual.num_grid_per_side, "bilinear", True, 2
        )
        out["interp_indices"], out["interp_weights"] = indices[rows], weights[rows]
    if hasattr(visual, "fullatt_block_indexes"):
        order, cumulative = vu.get_vision_window_index(grid_thw, 2, visual.window_size, visual.patch_size)
        bounds = cumulative.tolist()
        rank = {g: i for i, g in enumerate(kept_groups)}
        sequence, lengths = [], []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):  # every window of the full grid
            inside = [rank[g] for g in order[start // 4 : end // 4].tolist() if g in rank]
            sequence += inside
            lengths += [4 * len(inside)] if inside else []
        out["window_index"] = torch.tensor(sequence)
        out["cu_window_seqlens"] = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return out


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_pruned_tower_is_the_stock_tower_on_the_kept_groups(qwen_models, name):
    model, processor = qwen_models[name]
    visual = model.model.visual
    pixels, grids = qwen_inputs(processor, [document(224, 224, seed=6, cell=16), document(96, 160, seed=7)])
    selected = PixelPrune().select_input(pixels, grids, tower_shape(model, QWEN[name]))
    assert 0 < len(selected.kept) < pixels.shape[0] // 4
    kept_groups = selected.kept.tolist()
    rows = (torch.tensor(kept_groups)[:, None] * 4 + torch.arange(4)).flatten()
    with torch.no_grad():
        want = visual(pixels[rows], grid_thw=torch.tensor(grids), **stock_tables(visual, grids, kept_groups,
                                                                                  selected.counts))  # fmt: skip
        got = qwen_pruned_tower(visual, pixels, grids, selected)
    assert got.pooler_output.shape[0] == sum(selected.counts)
    assert torch.equal(got.pooler_output, want.pooler_output)
    for a, b in zip(getattr(want, "deepstack_features", None) or [], getattr(got, "deepstack_features", None) or [],
                    strict=True):  # fmt: skip
        assert a.shape[0] == sum(selected.counts) and torch.equal(a, b)  # DeepStack from the pruned states


def test_images_of_a_batch_equal_each_image_alone(qwen_models):
    model, processor = qwen_models["tiny-qwen2.5-vl"]
    visual, shape = model.model.visual, tower_shape(model, "qwen2.5-vl")
    images = [document(224, 224, seed=8, cell=16), document(112, 168, seed=9, cell=28)]
    pixels, grids = qwen_inputs(processor, images)
    method = PixelPrune(threshold=0.02)
    selected = method.select_input(pixels, grids, shape)
    with torch.no_grad():
        together = qwen_pruned_tower(visual, pixels, grids, selected).pooler_output.split(selected.counts)
        for image, want in zip(images, together, strict=True):
            alone_pixels, alone_grids = qwen_inputs(processor, [image])
            alone = method.select_input(alone_pixels, alone_grids, shape)
            got = qwen_pruned_tower(visual, alone_pixels, alone_grids, alone).pooler_output
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- CLIP / SigLIP towers
def clip_features(tower, pixels, layer, patches=None):
    from vtoken.adapters import hf

    with torch.no_grad():
        if patches is None:
            return hf.hidden_states(tower, [layer], pixels)[0]
        with patches:
            return hf.hidden_states(tower, [layer], pixels)[0]


@pytest.mark.parametrize("name, family", [("tiny-llava", "llava-1.5"), ("tiny-onevision", "llava-onevision")])
def test_clip_and_siglip_towers_run_on_the_kept_patches(name, family):
    model, processor = TINY_MODELS[name]()
    tower = model.model.vision_tower
    shape = tower_shape(model, family)
    size = tower.config.image_size
    side = size // shape.patch
    page = np.array(document(size, size, seed=10, cell=shape.patch * 2).resize((size, size)))
    flat = np.full((size, size, 3), 128, np.uint8)
    pixels = torch.stack([torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in (page, flat)])
    pixels = (pixels - torch.tensor(shape.mean)[:, None, None]) / torch.tensor(shape.std)[:, None, None]
    grids = [(side, side)] * 2
    selected = PixelPrune().select_input(pixels, grids, shape)
    assert selected.counts[1] == 1 and 1 < selected.counts[0] < side * side  # a flat crop keeps its first patch
    p = int(shape.cls)
    layer = shape.feature_block + 1
    everything = PixelPrune(threshold=-1.0).select_input(pixels, grids, shape)
    attention = tower.config._attn_implementation
    with torch.no_grad():
        stock = clip_features(tower, pixels, layer)
        assert torch.equal(clip_features(tower, pixels, layer, KeptPatches(tower.encoder, everything, shape.cls,
                                                                           attention, "cpu")), stock)  # fmt: skip
        patches = KeptPatches(tower.encoder, selected, shape.cls, attention, "cpu")
        got = clip_features(tower, pixels, layer, patches)
        assert got.shape[1] == p + max(selected.counts)
        assert patches.valid.sum(1).tolist() == selected.counts
        seen = {}

        def grab(module, args, kwargs):
            seen["x"] = kwargs["inputs_embeds"]

        hook = tower.encoder.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            tower(pixels)
        finally:
            hook.remove()
        for crop, count in enumerate(selected.counts):  # each crop alone: the encoder on [CLS] + its kept rows
            rows = torch.cat([torch.arange(p), torch.as_tensor(selected.kept_of(crop)) + p])
            embeds = seen["x"][crop : crop + 1, rows]
            layers = tower.encoder.layers[:layer]
            for block in layers:
                embeds = block(embeds, None)
            torch.testing.assert_close(got[crop, : p + count], embeds[0], rtol=1e-5, atol=1e-5)
            assert patches.kept[crop, :count].tolist() == selected.kept_of(crop).tolist()


def test_documents_keep_fewer_groups_than_photos(qwen_models, photos):
    model, processor = qwen_models["tiny-qwen2-vl"]
    shape = tower_shape(model, "qwen2-vl")
    pixels, grids = qwen_inputs(processor, [document(224, 224, seed=11, cell=28), photos["chelsea"]])
    counts = PixelPrune().select_input(pixels, grids, shape).counts
    totals = [g[1] * g[2] // 4 for g in grids]
    assert counts[0] < 0.5 * totals[0] and counts[1] == totals[1]  # a photo has no exact repeats


def test_exports():
    assert vtoken.PixelPrune is PixelPrune and vtoken.ToMe.name == "tome"
    assert issubclass(vtoken.PixelPrune, vtoken.TowerMethod) and vtoken.PixelPrune.acts == "input"
    assert vtoken.ToMe.acts == "layers" and vtoken.ToMe.stages == ("tower",)


def test_records_say_units_and_vit_rows():
    from vtoken.adapters.tower import pixelprune_records
    from vtoken.timing import Stopwatch

    shape = TowerShape("qwen3-vl", merge=2, patch=2, temporal=1, channels=1, mean=(0.0,), std=(1.0,))
    values = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1], [2, 0, 1, 1]], dtype=torch.float32)
    rows = values.flatten().repeat_interleave(4)[:, None].expand(-1, 4).contiguous()
    selected = PixelPrune().select_input(torch.cat([rows, rows[:8]]), [(1, 6, 8), (1, 2, 4)], shape)
    records = pixelprune_records(PixelPrune(), selected, Stopwatch(torch.device("cpu")).start().stop(), 2, [3, 4])
    first, second = records
    assert (first.stage, first.method, first.image, first.tokens_in, first.tokens_out) == ("tower", "pixelprune",
                                                                                          3, 12, 5)  # fmt: skip
    assert first.kept.tolist() == [0, 3, 6, 8, 9] and first.grid == (3, 4)
    assert first.extra == {"patches_in": 48, "patches_out": 20}
    assert (second.image, second.tokens_in, second.tokens_out, second.kept.tolist()) == (4, 2, 1, [0])


def test_kept_patches_add_a_fixed_burst_without_syncs():
    from vtoken.adapters import hf

    model, _ = TINY_MODELS["tiny-llava"]()
    tower = model.model.vision_tower
    shape = tower_shape(model, "llava-1.5")
    extra = set()
    for crops in (1, 3):
        pixels = torch.randn(crops, 3, 336, 336, generator=torch.Generator().manual_seed(crops))
        pixels[:, :, :168] = 0.5  # the upper half flat: crops keep different numbers of patches
        pixels[0, :, 168:] = 0.25
        selected = PixelPrune().select_input(pixels, [(24, 24)] * crops, shape)
        assert crops == 1 or len(set(selected.counts)) > 1
        with torch.no_grad(), count_launches() as launches:
            patches = KeptPatches(tower.encoder, selected, shape.cls, "sdpa", "cpu")
            with patches:
                hf.hidden_states(tower, [-2], pixels)
        with torch.no_grad(), count_launches() as stock:
            hf.hidden_states(tower, [-2], pixels)
        assert launches.syncs == stock.syncs == 0, launches.describe()
        extra.add((crops > 1, launches.kernels - stock.kernels))
    assert all(k <= 12 for _, k in extra), extra  # a gather (and the padding mask when crops differ)
