"""The pieces of vtoken-mini's training recipe (vtoken/mini/train.py), each against an independent reference, and
one end-to-end run of the script at toy length whose output loads as the shipped model does."""

import numpy as np
import pytest
import torch

from vtoken.mini import train, vqa
from vtoken.mini.model import build_processor, build_tokenizer, load, pixel_values


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return build_processor(tokenizer)


def test_whitened_patch_embedding_gives_unit_uncorrelated_outputs(tokenizer, processor):
    tower = train.clip_model(tokenizer, seed=0).vision_model
    pixels = pixel_values([vqa.render(vqa.scene("train", i)) for i in range(40)], processor)
    train.whiten_patch_embedding(tower, pixels)
    with torch.no_grad():
        out = tower.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2).flatten(0, 1)  # [B*144, 128]
    covariance = torch.cov(out.T)
    # the leading components are exact; the randomized PCA's last ones are close
    assert torch.allclose(covariance.diagonal()[:64], torch.ones(64), atol=0.05)
    off = covariance[:64, :64] - torch.diag(covariance.diagonal()[:64])
    assert off.abs().max() < 0.05


@pytest.mark.parametrize("index", range(5))
def test_patch_labels_match_the_drawing(index):
    scene = vqa.scene("train", index)
    labels = train.patch_labels(scene)
    objects = vqa.object_map(scene)  # [192, 192]: 0 background, i + 1 shape i, len(shapes) + 1 the sign
    for patch in range(144):
        row, col = divmod(patch, 12)
        assert (labels["row"][patch], labels["column"][patch]) == (row // 4, col // 4)
        block = objects[row * 16 : (row + 1) * 16, col * 16 : (col + 1) * 16]
        owner = np.bincount(block.ravel(), minlength=len(scene.shapes) + 2)[1:]
        if owner.max() < 0.2 * 256:
            assert labels["colour"][patch] == labels["shape"][patch] == labels["char"][patch] == 0
        elif owner.argmax() == len(scene.shapes):  # the sign
            assert vqa.CHARACTERS[int(labels["char"][patch]) - 1] == scene.sign.char
        else:
            shape = scene.shapes[owner.argmax()]
            assert list(vqa.COLOURS)[int(labels["colour"][patch]) - 1] == shape.colour
            assert vqa.SHAPES[int(labels["shape"][patch]) - 1] == shape.kind
            assert labels["char"][patch] == 0
    centres = torch.nonzero(labels["centre"]).flatten().tolist()
    assert sorted(3 * int(labels["row"][p]) + int(labels["column"][p]) for p in centres) == sorted(
        s.cell for s in scene.shapes
    )
    kind_in_cell = {s.cell: s.kind for s in scene.shapes}
    for p in centres:
        assert objects[(p // 12) * 16 : (p // 12 + 1) * 16, (p % 12) * 16 : (p % 12 + 1) * 16].max() > 0
        cell = 3 * int(labels["row"][p]) + int(labels["column"][p])
        assert vqa.SHAPES[int(labels["centre"][p]) - 1] == kind_in_cell[cell]
    # density: each shape's pixels per patch over its pixel count, summed per kind; a kind sums to its count
    pixels = np.stack(
        [(objects == i + 1).reshape(12, 16, 12, 16).sum((1, 3)).ravel() for i in range(len(scene.shapes))]
    )
    for k, kind in enumerate(vqa.SHAPES):
        mine = [i for i, s in enumerate(scene.shapes) if s.kind == kind]
        expected = sum((pixels[i] / pixels[i].sum() for i in mine), np.zeros(144))
        assert np.allclose(labels["density"][:, k].numpy(), expected, atol=1e-6)
        assert abs(float(labels["density"][:, k].sum()) - len(mine)) < 1e-4


def test_dense_loss_averages_each_head_over_its_own_patches():
    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(8, n) for k, n in train.PATCH_HEADS.items()})
    heads["density"] = torch.nn.Linear(8, len(vqa.SHAPES))
    patches = torch.randn(2, 144, 8)
    labels = [train.patch_labels(vqa.scene("train", i)) for i in range(2)]
    targets = {k: torch.stack([x[k] for x in labels]) for k in [*train.PATCH_HEADS, "density"]}
    errors = []  # the density head: squared error summed over an image's patches, one term per image and kind
    for b in range(2):
        for k in range(len(vqa.SHAPES)):
            errors.append(
                sum((heads["density"](patches[b, p])[k] - targets["density"][b, p, k]) ** 2 for p in range(144))
            )
    expected = train.DENSITY_WEIGHT * torch.stack(errors).mean()
    for k in train.PATCH_HEADS:  # one patch at a time
        losses = []
        for b in range(2):
            for p in range(144):
                shape = int(targets["shape"][b, p])
                is_shape = 0 < shape <= len(vqa.SHAPES)
                keep = {"shape": shape > 0, "char": int(targets["char"][b, p]) > 0,
                        "centre": is_shape}.get(k, True)  # fmt: skip
                if keep:
                    logits = heads[k](patches[b, p])
                    losses.append(-torch.log_softmax(logits, -1)[int(targets[k][b, p])])
        expected += torch.stack(losses).mean()
    assert torch.allclose(train.dense_loss(heads, patches, targets), expected, atol=1e-5)


def test_qa_conversation_supervises_only_answers(tokenizer, processor):
    from vtoken.zoo import build_prompt

    batch = train.qa_batch(tokenizer, processor, [0, 1], np.random.default_rng(0), draws=3)
    scene = vqa.scene("train", 0)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    text = tokenizer.decode([i for i in ids if i != tokenizer.pad_token_id])
    asked = [t.split("ASSISTANT :")[0].replace("<image>", "").strip() for t in text.split("USER :")[1:]]
    assert len(asked) == len(set(asked)) > 5 and asked[-1] == "Describe the image ."
    draws = [q for seed in range(50) for q in vqa.questions(scene, np.random.default_rng(seed))]
    truth = {q.text.replace("?", " ?"): q.answer for q in draws}
    truth |= {q: answer_from_drawing(scene, q) for q in asked if q.startswith(("How many", "Is there"))}
    supervised = [a.strip() for a in tokenizer.decode([t for t in labels if t != -100]).split("</s>")]
    assert supervised[:-2] == [truth[q] for q in asked[:-1]]
    assert supervised[-2] == vqa.caption(scene) and supervised[-1] == ""
    # the first turn is exactly the prompt the processor builds for a single question
    first = processor(images=[vqa.render(scene)], text=[build_prompt(processor, asked[0].replace(" ?", "?"))])
    prompt = list(first["input_ids"][0])
    assert ids[: len(prompt)] == prompt and all(x == -100 for x in labels[: len(prompt)])


def answer_from_drawing(scene: vqa.Scene, text: str) -> str:
    """The answer to a count or presence question's text, read off the scene's shapes."""
    words = text.rstrip(" ?").split()
    if words[0] == "How":  # How many <kind>s are there
        return vqa.NUMBERS[sum(s.kind + "s" == words[2] for s in scene.shapes)]
    kind, cell = words[3], vqa.POSITIONS.index(" ".join(words[6:]))  # Is there a <kind> at the <position>
    return "yes" if any(s.cell == cell and s.kind == kind for s in scene.shapes) else "no"


def test_training_script_runs_end_to_end_and_loads(tmp_path):
    out = tmp_path / "mini"
    train.main(["--out", str(out), "--clip-steps", "2", "--clip-batch", "4", "--steps", "2", "--batch", "2"])
    model, processor = load(out)
    image, questions = vqa.sample("test", 0)
    from vtoken.zoo import build_prompt

    inputs = processor(images=[image], text=[build_prompt(processor, questions[0].text)], return_tensors="pt")
    assert model.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize("index", range(4))
def test_stage_a_images_add_signs_only_in_empty_cells(index):
    scene = vqa.scene("train", index)
    image, labels, caption = train.stage_a_sample(scene)
    signs = train.extra_signs(scene)
    assert {s.cell for s in signs}.isdisjoint({s.cell for s in scene.shapes} | {scene.sign.cell})
    plain, painted = np.asarray(vqa.render(scene)), np.asarray(image)
    boxes = np.zeros(plain.shape[:2], dtype=bool)
    for sign in signs:
        x0, y0, x1, y1 = sign.box
        boxes[y0:y1, x0:x1] = True
        tile = painted[y0:y1, x0:x1]
        assert ((tile == 245) | (tile == 15)).all() and (tile == 15).any()
        assert f"sign {sign.char} {vqa.POSITIONS[sign.cell]}" in caption
        cover = np.zeros_like(boxes)
        cover[y0:y1, x0:x1] = True
        share = cover.reshape(12, 16, 12, 16).mean((1, 3)).ravel()
        for patch in np.nonzero(share >= 0.2)[0]:
            assert vqa.CHARACTERS[int(labels["char"][patch]) - 1] == sign.char
    assert np.array_equal(plain[~boxes], painted[~boxes])
