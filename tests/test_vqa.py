"""The procedural VQA generator: deterministic, splits disjoint, and every answer right by construction, checked
against the drawing parameters and against the rendered pixels themselves."""

import numpy as np
import pytest

from vtoken.mini import vqa

SCENES = [("train", i) for i in range(30)] + [("test", i) for i in range(30)]


def nearest_colour(pixel: np.ndarray) -> str:
    return min(vqa.COLOURS, key=lambda name: np.abs(np.array(vqa.COLOURS[name]) - pixel).sum())


def kind_from_pixels(mask: np.ndarray) -> str:
    """A shape's kind from its filled pixels alone: fill ratio of the bounding box, then where the widest row is."""
    rows = mask.sum(1)
    fill = mask.sum() / mask.size
    if fill > 0.95:
        return "square"
    if fill > 0.7:
        return "circle"
    return "triangle" if rows.argmax() > 0.8 * len(rows) else "diamond"


def test_same_seed_same_scene_and_pixels():
    for split, index in [("train", 0), ("validation", 5), ("test", 199)]:
        a, b = vqa.scene(split, index), vqa.scene(split, index)
        assert a == b and vqa.questions(a) == vqa.questions(b)
        assert np.array_equal(np.asarray(vqa.render(a)), np.asarray(vqa.render(b)))


def test_splits_are_different_scenes():
    for index in range(20):
        scenes = [vqa.scene(split, index) for split in vqa.SPLITS]
        assert len({(s.shapes, s.sign) for s in scenes}) == 3


@pytest.mark.parametrize("split, index", SCENES)
def test_pixels_match_the_drawing_parameters(split, index):
    scene = vqa.scene(split, index)
    image = np.asarray(vqa.render(scene)).astype(int)
    assert image.shape == (vqa.IMAGE_SIZE, vqa.IMAGE_SIZE, 3)
    assert len({s.cell for s in scene.shapes} | {scene.sign.cell}) == len(scene.shapes) + 1  # one object per cell
    assert len({s.colour for s in scene.shapes}) == len(scene.shapes)  # colours name shapes uniquely
    for s in scene.shapes:
        box = image[s.y : s.y + s.size, s.x : s.x + s.size]
        mask = (box == vqa.COLOURS[s.colour]).all(-1)  # the background is grey-ish: never a palette colour
        assert nearest_colour(image[s.centre[1], s.centre[0]]) == s.colour
        assert kind_from_pixels(mask) == s.kind
        row, col = divmod(s.cell, 3)  # the whole box inside its cell
        assert col * vqa.CELL <= s.x and s.x + s.size <= (col + 1) * vqa.CELL
        assert row * vqa.CELL <= s.y and s.y + s.size <= (row + 1) * vqa.CELL
    sign = scene.sign
    x, y = sign.x + sign.margin, sign.y + sign.margin
    glyph = image[y : y + 7 * sign.scale : sign.scale, x : x + 5 * sign.scale : sign.scale].mean(-1) < 128
    assert np.array_equal(glyph, vqa.GLYPHS[sign.char])  # the glyph read back from the pixels
    labels = vqa.object_map(scene)
    for i, s in enumerate(scene.shapes):  # the object map marks exactly the pixels painted in the shape's colour
        assert np.array_equal(labels == i + 1, (image == vqa.COLOURS[s.colour]).all(-1))


@pytest.mark.parametrize("split, index", SCENES)
def test_answers_are_right_by_construction(split, index):
    scene = vqa.scene(split, index)
    at = {s.cell: s for s in scene.shapes}
    by_colour = {s.colour: s for s in scene.shapes}
    asked = vqa.questions(scene)
    assert [q.kind for q in asked] == list(vqa.QUESTION_TYPES)
    more = [q for seed in range(4) for q in vqa.questions(scene, np.random.default_rng(seed))]  # training draws
    for q in asked + more:
        words = q.text.rstrip("?").split()
        position = next((p for p in sorted(vqa.POSITIONS, key=len, reverse=True) if q.text.endswith(f" {p}?")), None)
        if q.kind == "colour":
            expected = at[vqa.POSITIONS.index(position)].colour
        elif q.kind == "shape":
            expected = by_colour[words[4]].kind
        elif q.kind == "count":
            expected = vqa.NUMBERS[sum(s.kind + "s" == words[2] for s in scene.shapes)]
        elif q.kind == "presence":
            shape = at.get(vqa.POSITIONS.index(position))
            expected = "yes" if shape is not None and shape.kind == words[3] else "no"
        else:
            expected = scene.sign.char
        assert q.answer == expected, q
        tokens = set(vqa.vocabulary())
        assert set(q.text.replace("?", " ?").split()) <= tokens and q.answer in tokens


def test_targets_cover_the_patches_the_answer_needs():
    scene = vqa.scene("test", 3)
    coverage = vqa.patch_coverage(scene)
    assert coverage.shape == (len(scene.shapes) + 1, 144)
    assert coverage.sum(0).max() <= 1 and np.isclose(coverage.sum() * 256, (vqa.object_map(scene) > 0).sum())
    for i, s in enumerate(scene.shapes):  # the patch holding the shape's centre is covered by it
        cx, cy = s.centre
        assert coverage[i, (cy // 16) * 12 + cx // 16] > 0
    read = vqa.questions(scene)[-1]
    assert read.targets == (len(scene.shapes),) and coverage[len(scene.shapes)].sum() > 0


def test_question_set_is_balanced():
    pairs = vqa.question_set("test", 200)
    assert len({i for i, _ in pairs}) == 200
    assert {k: sum(q.kind == k for _, q in pairs) for k in vqa.QUESTION_TYPES} == dict.fromkeys(vqa.QUESTION_TYPES, 40)
    yes = [q.answer == "yes" for i in range(300) for q in vqa.questions(vqa.scene("train", i)) if q.kind == "presence"]
    assert 0.35 < np.mean(yes) < 0.65  # no constant-answer shortcut


@pytest.mark.parametrize("split", list(vqa.SPLITS))
def test_sign_covers_one_aligned_2x2_block_of_patches_in_its_cell(split):
    for index in range(60):
        scene = vqa.scene(split, index)
        covered = np.nonzero(vqa.patch_coverage(scene)[-1])[0]
        rows, cols = sorted({int(p) // 12 for p in covered}), sorted({int(p) % 12 for p in covered})
        assert len(covered) == 4 and rows[1] == rows[0] + 1 and cols[1] == cols[0] + 1
        assert {(r // 4) * 3 + c // 4 for r in rows for c in cols} == {scene.sign.cell}
