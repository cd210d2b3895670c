"""Procedural visual QA: coloured shapes and a lettered sign on a textured background, one-word answers.

Everything is a pure function of (split, index): `scene(split, i)` draws the parameters, `render(scene)` the
pixels, `questions(scene)` one question of every type. No files, no network.

The image is a 3 x 3 grid of named cells ("top left" ... "bottom right"); every object sits inside its own cell,
so a position names at most one object. Small objects cover one to four 16-px patches of the 192-px image, so
the answer to most questions lives in a handful of visual tokens: a method that drops them loses the answer.
The sign sits on a 2 x 2 block of patches (aligned to the 16-px grid), so reading it needs exactly those four
tokens, and a tiny tower need not learn to reassemble glyphs cut at every possible offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 192
CELL = IMAGE_SIZE // 3
SPLITS = {"train": 0, "validation": 1, "test": 2}
QUESTION_TYPES = ("colour", "shape", "count", "presence", "read")

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (30, 165, 55),
    "blue": (35, 75, 225),
    "yellow": (240, 215, 30),
    "purple": (145, 50, 190),
    "orange": (250, 135, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# a row word and a column word (the centre aside): "top" alone would mean the top row's middle cell, a name
# a small model must learn is not "top" of "top left"
POSITIONS = ("top left", "top middle", "top right", "middle left", "centre", "middle right", "bottom left",
             "bottom middle", "bottom right")  # fmt: skip
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six")
SMALL, LARGE = (14, 20), (28, 44)  # object side in pixels: small ~ 1-4 patches, large ~ 4-9 patches

# 5 x 7 bitmap glyphs, drawn scaled on the sign (no font files needed)
_GLYPH_ROWS = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
}
GLYPHS: dict[str, np.ndarray] = {
    char: np.array([[x == "#" for x in row] for row in rows]) for char, rows in _GLYPH_ROWS.items()
}
CHARACTERS = tuple(GLYPHS)


@dataclass(frozen=True)
class Shape:
    """One coloured shape: its kind, colour, side `size` (px) and bounding box's top-left (x, y) in `cell`."""

    kind: str
    colour: str
    size: int
    cell: int
    x: int
    y: int

    @property
    def centre(self) -> tuple[int, int]:
        """Pixel (x, y) inside the shape whatever its kind (a triangle's centroid lies below the box centre)."""
        drop = (2 * self.size) // 3 if self.kind == "triangle" else self.size // 2
        return self.x + self.size // 2, self.y + drop


@dataclass(frozen=True)
class Sign:
    """A white tile with one black glyph scaled by `scale` (glyph 5*scale x 7*scale px), top-left (x, y)."""

    char: str
    cell: int
    x: int
    y: int
    scale: int
    margin: int = 2

    @property
    def box(self) -> tuple[int, int, int, int]:
        return self.x, self.y, self.x + 5 * self.scale + 2 * self.margin, self.y + 7 * self.scale + 2 * self.margin


@dataclass(frozen=True)
class Scene:
    """Drawing parameters of one image: background texture, shapes (one per cell, distinct colours) and a sign."""

    seed: tuple[int, int]
    background: str
    tint: tuple[int, int, int]
    shapes: tuple[Shape, ...]
    sign: Sign


@dataclass(frozen=True)
class Question:
    """One question about a scene: its type, text (LLaVA-style, ends with '?'), one-word answer and `targets`,
    the objects the answer depends on (indices into `scene.shapes`; `len(scene.shapes)` is the sign)."""

    kind: str
    text: str
    answer: str
    targets: tuple[int, ...] = ()


def _rng(split: str, index: int) -> np.random.Generator:
    # independent streams per split: no seed of one split can reproduce a scene of another
    return np.random.default_rng([SPLITS[split], index])


def scene(split: str, index: int) -> Scene:
    """The scene of question set `index` in `split` ('train', 'validation' or 'test')."""
    rng = _rng(split, index)
    n_shapes = int(rng.integers(3, 7))
    cells = rng.permutation(9)[: n_shapes + 1]
    colours = rng.permutation(list(COLOURS))[:n_shapes]
    shapes = []
    for cell, colour in zip(cells[:n_shapes], colours, strict=True):
        low, high = SMALL if rng.random() < 0.5 else LARGE
        size = int(rng.integers(low, high + 1))
        x, y = _place(rng, int(cell), size, size)
        shapes.append(Shape(str(rng.choice(SHAPES)), str(colour), size, int(cell), x, y))
    scale = int(rng.integers(3, 5))
    char = str(rng.choice(CHARACTERS))
    x, y = place_sign(rng, int(cells[-1]), scale)
    tint = tuple(int(v) for v in rng.integers(70, 170, 3))
    background = str(rng.choice(("noise", "stripes", "blotches")))
    return Scene((SPLITS[split], index), background, tint, tuple(shapes), Sign(char, int(cells[-1]), x, y, scale))


def place_sign(rng: np.random.Generator, cell: int, scale: int, margin: int = Sign.margin) -> tuple[int, int]:
    """Top-left corner of a sign whose glyph (scale 3 or 4) is centred on a random 2 x 2 block of 16-px patches
    inside `cell`; its tile (glyph + `margin`) stays inside the block."""
    row, col = divmod(cell, 3)
    block_x, block_y = (int(v) for v in rng.integers(0, CELL // 16 - 1, 2))
    glyph_x = col * CELL + 16 * block_x + (32 - 5 * scale) // 2
    glyph_y = row * CELL + 16 * block_y + (32 - 7 * scale) // 2
    return glyph_x - margin, glyph_y - margin


def _place(rng: np.random.Generator, cell: int, width: int, height: int) -> tuple[int, int]:
    """Top-left corner of a width x height box inside `cell`, 2 px clear of its border."""
    row, col = divmod(cell, 3)
    return (col * CELL + int(rng.integers(2, CELL - width - 1)), row * CELL + int(rng.integers(2, CELL - height - 1)))


def _background(scene: Scene) -> np.ndarray:
    """A low-saturation textured background [H, W, 3] uint8, so no texel is mistaken for an object colour."""
    rng = np.random.default_rng([*scene.seed, 7])
    tint = np.array(scene.tint, dtype=np.float32)
    grey = tint.mean()
    base = grey + 0.35 * (tint - grey)  # desaturate the tint
    ramp = np.linspace(-25, 25, IMAGE_SIZE, dtype=np.float32)
    field = ramp[:, None] if rng.random() < 0.5 else ramp[None, :]
    field = np.broadcast_to(field, (IMAGE_SIZE, IMAGE_SIZE)).copy()
    if scene.background == "stripes":
        period, angle = rng.uniform(8, 24), rng.uniform(0, np.pi)
        yy, xx = np.mgrid[:IMAGE_SIZE, :IMAGE_SIZE]
        field += 18 * np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period)
    elif scene.background == "blotches":
        coarse = rng.normal(0, 22, (8, 8)).astype(np.float32)
        field += np.kron(coarse, np.ones((IMAGE_SIZE // 8, IMAGE_SIZE // 8), dtype=np.float32))
    field += rng.normal(0, 12, (IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    return np.clip(base[None, None, :] + field[..., None], 0, 255).astype(np.uint8)


def _draw(draw: ImageDraw.ImageDraw, s: Shape, fill) -> None:
    x0, y0, x1, y1 = s.x, s.y, s.x + s.size - 1, s.y + s.size - 1
    if s.kind == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif s.kind == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    elif s.kind == "triangle":
        draw.polygon([(x0, y1), ((x0 + x1) / 2, y0), (x1, y1)], fill=fill)
    else:  # diamond
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        draw.polygon([(mx, y0), (x1, my), (mx, y1), (x0, my)], fill=fill)


def render(scene: Scene) -> Image.Image:
    """The RGB image (IMAGE_SIZE x IMAGE_SIZE) of `scene`."""
    image = Image.fromarray(_background(scene))
    draw = ImageDraw.Draw(image)
    for s in scene.shapes:
        _draw(draw, s, COLOURS[s.colour])
    pixels = np.asarray(image).copy()
    paint_sign(pixels, scene.sign)
    return Image.fromarray(pixels)


def paint_sign(pixels: np.ndarray, sign: Sign) -> None:
    """Paint `sign` (white tile, black glyph) into `pixels` [H, W, 3] uint8 in place."""
    x0, y0, x1, y1 = sign.box
    pixels[y0:y1, x0:x1] = 245
    glyph = np.kron(GLYPHS[sign.char], np.ones((sign.scale, sign.scale), dtype=bool))
    gx, gy = sign.x + sign.margin, sign.y + sign.margin
    pixels[gy : gy + glyph.shape[0], gx : gx + glyph.shape[1]][glyph] = 15


def object_map(scene: Scene) -> np.ndarray:
    """[H, W] int: 0 on the background, i + 1 on `scene.shapes[i]`, len(shapes) + 1 on the sign."""
    labels = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    draw = ImageDraw.Draw(labels)
    for i, s in enumerate(scene.shapes):
        _draw(draw, s, i + 1)
    box = scene.sign.box
    draw.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=len(scene.shapes) + 1)
    return np.asarray(labels, dtype=np.int64)


def patch_coverage(scene: Scene, patch: int = 16) -> np.ndarray:
    """[objects, (H/patch)^2] share of every patch (raster order, as the vision tower emits them) that each
    object covers; row `len(scene.shapes)` is the sign."""
    labels = object_map(scene)
    return np.stack([patch_share(labels == i + 1, patch) for i in range(len(scene.shapes) + 1)])


def patch_share(mask: np.ndarray, patch: int = 16) -> np.ndarray:
    """[(H/patch)^2] share of every patch (raster order) that the [H, W] bool `mask` covers."""
    side = mask.shape[0] // patch
    return mask.reshape(side, patch, side, patch).mean((1, 3)).ravel()


def questions(scene: Scene, rng: np.random.Generator | None = None) -> list[Question]:
    """One question of every type in QUESTION_TYPES order, drawn from the scene's own seed (or from `rng`:
    training draws several sets per image)."""
    rng = np.random.default_rng([*scene.seed, 11]) if rng is None else rng
    by_cell = {s.cell: i for i, s in enumerate(scene.shapes)}
    i = int(rng.integers(len(scene.shapes)))
    target = scene.shapes[i]
    colour = Question("colour", f"What colour is the shape at the {POSITIONS[target.cell]}?", target.colour, (i,))
    i = int(rng.integers(len(scene.shapes)))
    target = scene.shapes[i]
    shape = Question("shape", f"What shape is the {target.colour} object?", target.kind, (i,))
    present = sorted({s.kind for s in scene.shapes})
    kind = str(rng.choice(present)) if rng.random() < 0.8 else str(rng.choice(SHAPES))
    matches = tuple(i for i, s in enumerate(scene.shapes) if s.kind == kind)
    count = Question("count", f"How many {kind}s are there?", NUMBERS[len(matches)], matches)
    if rng.random() < 0.5:  # yes: a shape named by its true kind
        target = scene.shapes[int(rng.integers(len(scene.shapes)))]
        cell, kind = target.cell, target.kind
    else:  # no: an empty cell (or the sign's), or a shape named by another kind
        cell = int(rng.integers(9))
        others = [k for k in SHAPES if cell not in by_cell or k != scene.shapes[by_cell[cell]].kind]
        kind = str(rng.choice(others))
    answer = "yes" if cell in by_cell and scene.shapes[by_cell[cell]].kind == kind else "no"
    presence = Question("presence", f"Is there a {kind} at the {POSITIONS[cell]}?", answer,
                        (by_cell[cell],) if cell in by_cell else ())  # fmt: skip
    read = Question("read", "What is written on the sign?", scene.sign.char, (len(scene.shapes),))
    return [colour, shape, count, presence, read]


def caption(scene: Scene, extra_signs: tuple[Sign, ...] = ()) -> str:
    """A caption naming every object, its size, colour and cell, in raster order (for contrastive pretraining);
    `extra_signs`: signs painted into empty cells on top of the scene (stage (a) training images)."""
    parts = {s.cell: f"{'small' if s.size <= SMALL[1] else 'large'} {s.colour} {s.kind} {POSITIONS[s.cell]}"
             for s in scene.shapes}  # fmt: skip
    for sign in (scene.sign, *extra_signs):
        parts[sign.cell] = f"sign {sign.char} {POSITIONS[sign.cell]}"
    return " , ".join(parts[c] for c in sorted(parts)) + " ."


def sample(split: str, index: int) -> tuple[Image.Image, list[Question]]:
    """(image, its five questions) of `index` in `split`."""
    s = scene(split, index)
    return render(s), questions(s)


def question_set(split: str, count: int, start: int = 0) -> list[tuple[int, Question]]:
    """`count` (scene index, question) pairs cycling through the question types: scene i asks type i mod 5,
    so a slice of 200 has 40 of each type, on 200 different images."""
    out = []
    for index in range(start, start + count):
        out.append((index, questions(scene(split, index))[index % len(QUESTION_TYPES)]))
    return out


def vocabulary() -> list[str]:
    """Every word a question, answer or caption uses (the tokenizer's vocabulary, special tokens aside)."""
    words = {"USER", "ASSISTANT", ":", "?", ",", ".", "sign", "small", "large", "yes", "no", "Describe", "image"}
    words |= set(COLOURS) | set(SHAPES) | {f"{k}s" for k in SHAPES} | set(NUMBERS) | set(CHARACTERS)
    for position in POSITIONS:
        words |= set(position.split())
    for template in ("What colour is the shape at the", "What shape is the object", "How many are there",
                     "Is there a at the", "What is written on the sign"):  # fmt: skip
        words |= set(template.split())
    return sorted(words)
