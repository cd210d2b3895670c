import numpy as np
import torch
from conftest import inputs_for

from vtoken.overlay import kept_overlay, model_view


def test_model_view_inverts_the_processor_normalisation(llava, photos):
    processor = llava[1]
    inputs = inputs_for(processor, [photos["astronaut"]], ["a"])
    view = model_view(
        inputs["pixel_values"][0], processor.image_processor.image_mean, processor.image_processor.image_std
    )
    expected = photos["astronaut"].resize((336, 336), resample=3)  # square photo: resize only, no crop
    diff = np.abs(np.asarray(view, dtype=np.int32) - np.asarray(expected, dtype=np.int32))
    assert view.size == (336, 336) and np.median(diff) <= 2


def test_overlay_dims_exactly_the_dropped_patches():
    image = __import__("PIL.Image", fromlist=["Image"]).new("RGB", (40, 20), (200, 100, 40))
    out = np.asarray(kept_overlay(image, torch.tensor([0, 7]), grid=(2, 4), dim=0.5))
    assert (out[:10, :10] == [200, 100, 40]).all()  # patch 0 kept
    assert (out[10:, 30:] == [200, 100, 40]).all()  # patch 7 kept
    assert (out[:10, 10:20] == [100, 50, 20]).all()  # patch 1 dropped
    assert np.asarray(kept_overlay(image, None, (2, 4))).tolist() == np.asarray(image).tolist()


def test_token_picture_dims_dropped_cells_and_tints_each_group():
    from PIL import Image

    from vtoken.overlay import token_picture

    image = Image.new("RGB", (40, 20), (100, 100, 100))
    keep = np.array([True, False, True, True, True, True, True, True])
    out = np.asarray(token_picture(image, (2, 4), keep, dim=0.5))
    assert (out[:10, 10:20] == 50).all() and (out[:10, :10] == 100).all()  # cell 1 dimmed, cell 0 not
    groups = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5, 6, 7])]
    out = np.asarray(token_picture(image, (2, 4), groups=groups), dtype=np.int32)
    inner = {g: tuple(out[y, x]) for g, (y, x) in enumerate([(5, 5), (5, 25), (15, 5)])}  # inside each group
    assert len(set(inner.values())) == 3  # neighbouring groups differ in colour
    assert tuple(out[15, 35]) == inner[2]  # one group, one colour
    assert (out[:, 20] == 255).all(-1)[:9].all()  # a line where groups 0 and 1 meet


def test_mosaic_places_tiles_in_rows():
    from PIL import Image

    from vtoken.overlay import mosaic

    red, blue = Image.new("RGB", (10, 5), "red"), Image.new("RGB", (4, 8), "blue")
    out = mosaic([[red, blue], [blue]], gap=2)
    assert out.size == (16, 8 + 2 + 8)
    pixels = np.asarray(out)
    assert (
        tuple(pixels[0, 0]) == (255, 0, 0)
        and tuple(pixels[0, 12]) == (0, 0, 255)
        and tuple(pixels[10, 0]) == (0, 0, 255)
    )
