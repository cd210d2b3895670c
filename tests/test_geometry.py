"""vtoken.geometry: each family's geometry as pure functions, against hand-computed layouts, transformers' own
functions and brute-force references (no model built)."""

import random

import pytest
import torch
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

from vtoken.geometry import anyres, llava, qwen, tables
from vtoken.tokens import CLS, MERGED, Selection

PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
SIZES = [(336, 336), (300, 800), (900, 300), (1000, 1000), (20, 50), (427, 640), (1, 1000), (1000, 1)]


# ----------------------------------------------------------------- tables
def test_tables_are_the_host_values_on_the_device():
    assert tables.on_device([3, 0, 7], "cpu").tolist() == [3, 0, 7]
    assert tables.on_device([-1, 2**40], "cpu").tolist() == [-1, 2**40] and tables.on_device([], "cpu").numel() == 0
    assert tables.on_device([3, 0, 7], "meta").shape == (3,)  # the GPU benchmarks' configurations build on meta
    assert tables.repeated([2, 5], [3, 1], "cpu").tolist() == [2, 2, 2, 5]
    assert tables.segment_aranges([2, 0, 3], "cpu").tolist() == [0, 1, 0, 1, 2]
    assert tables.padded_rows([2, 0, 1], 3, "cpu").tolist() == [0, 1, 6]
    stacked = tables.stack_padded([torch.ones(2, 1), torch.full((1, 1), 2.0)])
    assert stacked.squeeze(-1).tolist() == [[1, 1], [2, 0]]


# ----------------------------------------------------------------- LLaVA-1.5
def test_llava_grid_and_feature_layer():
    assert llava.token_grid(336, 14) == (24, 24)
    assert llava.encoder_layer(-2, 24) == 22  # hidden_states[-2] of 24 layers: layer 22's output
    assert llava.encoder_layer(-1, 24) == 23 and llava.encoder_layer(1, 24) == 0
    assert llava.encoder_layer(0, 24) is None and llava.encoder_layer(-25, 24) is None  # the embeddings


def test_pad_border_is_read_from_the_pixels():
    pixels = torch.zeros(1, 3, 8, 8)
    pixels[:, :, 2:6] = torch.rand(3, 4, 8) + 1  # content rows 2..5, uniform border above and below
    valid = llava.outside_pad_border(pixels, 2).view(4, 4)
    assert valid.tolist() == [[False] * 4, [True] * 4, [True] * 4, [False] * 4]


# ----------------------------------------------------------------- anyres
def test_a_hand_computed_anyres_layout():
    """4 x 4 tokens per crop of 4 pixels, an image 10 high and 40 wide: pinpoint (4, 8) fits best (it keeps 16
    pixels' worth and wastes 16), so 1 x 2 sub-images; the 4 x 8 stitched grid holds the 4:1 image in 2 rows of 8
    (scale 0.2: 10 -> 2 rows, padding (4 - 2) // 2 = 1 above and below)."""
    grid = anyres.anyres_grid((10, 40), [[4, 8], [8, 4], [8, 8]], 4, (4, 4))
    assert (grid.rows, grid.cols, grid.num_crops) == (1, 2, 3)
    assert (grid.top, grid.bottom, grid.left, grid.right) == (1, 3, 0, 8)
    assert grid.valid_counts() == [16, 8, 8]
    assert grid.native_length() == 16 + 2 * 8 + 2  # base, the window, a newline after each of its 2 rows
    assert grid.unpadded.tolist() == [list(range(8, 16)), list(range(16, 24))]


@pytest.mark.parametrize("size", SIZES)
def test_anyres_grid_matches_transformers(size):
    grid = anyres.anyres_grid(size, PINPOINTS, 336, (24, 24))
    assert (grid.rows, grid.cols) == tuple(get_anyres_image_grid_shape(list(size), PINPOINTS, 336))
    stitched = torch.arange(grid.rows * 24 * grid.cols * 24).view(1, grid.rows * 24, grid.cols * 24)
    assert torch.equal(grid.unpadded, unpad_image(stitched, list(size))[0])
    valid = anyres.crop_valid([grid], "cpu")
    assert valid.sum(1).tolist() == grid.valid_counts()
    for s in range(grid.rows * grid.cols):  # crop s + 1's valid tokens are those of its block of the window
        r, c = divmod(s, grid.cols)
        block = torch.zeros(grid.rows * 24, grid.cols * 24, dtype=torch.bool)
        block[grid.top : grid.bottom, grid.left : grid.right] = True
        assert torch.equal(valid[s + 1].view(24, 24), block[r * 24 : r * 24 + 24, c * 24 : c * 24 + 24])


def test_onevision_grid_downsamples_large_windows():
    side = 27
    small = anyres.onevision_grid((384, 384), [[384, 384], [384, 768], [768, 768]], 384, side, 9)
    assert small == (27, 27)  # one sub-image: nothing to downsample
    big = anyres.onevision_grid((2304, 2304), [[384 * i, 384 * i] for i in range(1, 7)], 384, side, 1)
    assert big == (int(162 // (162 / 27)), int(162 // (162 / 27)))  # 6 x 6 crops' tokens down to one crop's worth


def _reference_pack(grids, places, counts, embeds, newline, native, origin=None, drop=None, base_newline=False):
    """Image by image with Python lists: base rows as they are, then the sub-images' grid rows in stitched raster
    order (a newline after every row that keeps one, native), then [CLS] rows, then merged rows."""
    out, row, crop = [], 0, 0
    for grid in grids:
        height, width = grid.side
        rows = []  # (crop index, slot, row) of this image
        for c in range(grid.num_crops):
            for slot in range(counts[crop]):
                rows.append((c, slot, row))
                row += 1
            crop += 1
        first = crop - grid.num_crops
        base = [r for c, _, r in rows if c == 0]
        grid_rows, cls, merged = [], [], []
        for c, slot, r in rows:
            if c == 0:
                continue
            index = (origin if origin is not None else places)[first + c, slot].item()
            if drop is not None and drop[first + c, slot]:
                continue
            if index == CLS:
                cls.append((c, r))
            elif index == MERGED:
                merged.append((c, slot, r))
            else:
                sr, sc = divmod(c - 1, grid.cols)
                y, x = divmod(index, width)
                grid_rows.append(((sr * height + y) * grid.cols * width + sc * width + x, r))
        grid_rows.sort()
        image = [embeds[r] for r in base]
        for i, (key, r) in enumerate(grid_rows):
            image.append(embeds[r])
            last = i + 1 == len(grid_rows) or grid_rows[i + 1][0] // (grid.cols * width) != key // (grid.cols * width)
            if native and last:
                image.append(newline)
        image += [embeds[r] for _, r in sorted(cls)] + [embeds[r] for _, _, r in sorted(merged)]
        if grid.num_crops == 1 and (native or base_newline):
            image.append(newline)
        out.append(torch.stack(image))
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_a_brute_force_reference(seed, native):
    rng = random.Random(seed)
    sizes = [(rng.randint(4, 40), rng.randint(4, 40)) for _ in range(rng.randint(1, 3))]
    grids = [anyres.anyres_grid(s, [[4, 8], [8, 4], [8, 8]], 4, (4, 4)) for s in sizes]
    if seed == 3:
        grids.append(anyres.AnyresGrid(0, 0, (4, 4), 0, 0, 0, 0))  # a base-only image
    valid = anyres.crop_valid(grids, "cpu")
    counts, kept = [], []
    for c in range(len(valid)):
        choices = valid[c].nonzero().squeeze(1).tolist() if native else list(range(16))
        picked = sorted(rng.sample(choices, rng.randint(0, len(choices))))
        counts.append(len(picked))
        kept.append(picked + [16] * (16 - len(picked)))
    places = torch.tensor(kept)
    embeds = torch.randn(sum(counts), 3)
    newline = torch.full((3,), -1.0)
    packed = anyres.pack(grids, places, counts, embeds, newline, native=native, base_newline=seed == 3)
    expected = _reference_pack(grids, places, counts, embeds, newline, native, base_newline=seed == 3)
    assert packed.lengths == [len(e) for e in expected]
    for got, want in zip(packed.per_image(), expected, strict=True):
        assert torch.equal(got, want)


def test_pack_places_cls_and_merged_rows_after_the_grid_and_drops_what_a_layout_drops():
    grids = [anyres.anyres_grid((10, 40), [[4, 8], [8, 4], [8, 8]], 4, (4, 4))]  # base + 2 sub-images
    origin = torch.tensor([[3, CLS, MERGED], [5, CLS, MERGED], [MERGED, 1, CLS]])
    embeds = torch.arange(9.0)[:, None]
    newline = torch.tensor([-1.0])
    for native in (True, False):
        packed = anyres.pack(grids, origin.clamp(min=0), [3, 3, 3], embeds, newline, native, origin=origin)
        want = _reference_pack(grids, None, [3, 3, 3], embeds, newline, native, origin=origin)
        assert torch.equal(packed.features, want[0])
    # base rows as they are (incl. its [CLS] and merged rows); grid rows in raster order of the stitched grid: crop
    # 2's token 1 (stitched index 5) before crop 1's token 5 (index 9); then the [CLS] rows of crops 1 and 2, then
    # their merged rows
    packed = anyres.pack(grids, origin.clamp(min=0), [3, 3, 3], embeds, newline, False, origin=origin)
    assert packed.features.squeeze(1).tolist() == [0, 1, 2, 7, 3, 4, 8, 5, 6]
    drop = torch.tensor([[False] * 3, [True, False, False], [False] * 3])
    kept = torch.tensor([[0, 1, 2], [1, 2, 3], [4, 5, 6]])
    packed = anyres.pack(grids, kept, [3, 3, 3], embeds, newline, False, drop=drop)
    assert packed.reached == [3, 2, 3] and packed.lengths == [8]
    assert torch.equal(packed.features, _reference_pack(grids, kept, [3, 3, 3], embeds, newline, False, drop=drop)[0])


def test_pack_of_every_valid_token_needs_no_read():
    from vtoken.launches import count_launches

    grid = anyres.anyres_grid((10, 40), [[4, 8], [8, 4], [8, 8]], 4, (4, 4))
    valid = anyres.crop_valid([grid], "cpu")
    counts = valid.sum(1).tolist()
    kept = torch.stack([torch.arange(16).masked_fill(~v, 16).sort().values for v in valid])
    embeds = torch.randn(sum(counts), 2)
    with count_launches() as counted:
        packed = anyres.pack([grid], kept, counts, embeds, torch.zeros(2), native=True, whole=True)
    assert counted.syncs == 0 and packed.lengths == [grid.native_length()]
    assert torch.equal(packed.features, anyres.pack([grid], kept, counts, embeds, torch.zeros(2), native=True).features)


# ----------------------------------------------------------------- Qwen
def test_qwen_grids_counts_and_offsets():
    assert qwen.token_grid((2, 12, 16), 2) == (6, 8) and qwen.item_tokens((2, 12, 16), 2) == 96
    assert qwen.resized_grid_thw(2, (3, 4), 2) == (2, 6, 8)
    offsets = torch.tensor([[0, 5, 9], [1, 2, 48]])  # frame 1 keeps 2 (padded with 48)
    assert qwen.run_offsets(offsets, [3, 2], 48).tolist() == [0, 5, 9, 49, 50]
    assert qwen.run_offsets(offsets[:, :2], None, 48).tolist() == [0, 5, 49, 50]


def test_kept_rows_are_gathered_crop_after_crop():
    from vtoken.geometry.kept import flat_kept, output_places

    features = torch.arange(24.0).view(2, 4, 3)
    selection = Selection(kept=torch.tensor([[0, 3], [2, 4]]), counts=[2, 1])
    assert flat_kept(selection, features)[:, 0].tolist() == [0, 9, 18]
    merged = Selection(features=torch.ones(2, 2, 3), anchors=torch.tensor([[1, 2], [0, 3]]))
    assert output_places(merged).tolist() == [[1, 2], [0, 3]] and flat_kept(merged, features).shape == (4, 3)


@pytest.mark.parametrize("grids", [[(1, 16, 24)], [(2, 12, 8), (1, 20, 20)], [(1, 32, 32), (3, 4, 6)]])
def test_qwen25_window_order_matches_transformers(grids):
    from transformers.vision_utils import get_vision_window_index

    expected, _ = get_vision_window_index(torch.tensor(grids), 2, 112, 14)
    assert torch.equal(qwen.window_index(grids, 2, 112, 14, "cpu"), expected)
