"""Train vtoken-mini from a seed, the way LLaVA was trained, on procedurally generated data only.

Stage (a): a tiny CLIP (the vision tower + a small text tower) trained contrastively on image/caption pairs, so
the tower's [CLS] attention means something (LLaVA-style training never sends a gradient to the [CLS] row of the
feature layer), plus dense per-patch heads on the feature layer (the object's colour, shape and glyph, the row
and column of its cell, a shape's kind on its centre patch) and a density head (per kind, summing to the count),
so what the questions ask is in the patch tokens the LLM reads.
Four things make that learnable in minutes: a PCA-whitened patch embedding at the start, each head's loss over
only the patches it is about, extra signs in empty cells (more glyphs per image), and the density head (it makes
every token of a shape learn the whole shape). Stage (b): the tower frozen, projector + Llama trained on visual QA
(loss on answer tokens only). Every image's questions (three draws of the five types) are packed as one multi-turn
conversation (as LLaVA's data is), closed by a caption turn.

    python -m vtoken.mini.train --seed 0 --out vtoken/mini/weights

Two threads by default (the whole of a 2-core machine: ~65 min, 11 of them stage (a)); the shipped run's settings
and timings are in vtoken/mini/weights/training.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from . import vqa
from .model import VISION, build_model, build_processor, build_tokenizer, pixel_values

CAPTION_PROMPT = "Describe the image."
TEXT_TOWER = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 5 %."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """[B, max len] right-padded ids."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


# ---- stage (a): contrastive CLIP ----


def clip_model(tokenizer, seed: int):
    """A CLIPModel whose vision tower has vtoken-mini's shape and whose text tower reads our word vocabulary."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    text = dict(TEXT_TOWER, vocab_size=len(tokenizer), max_position_embeddings=64,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = dict(VISION, image_size=vqa.IMAGE_SIZE, patch_size=16)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=VISION["projection_dim"]))


PATCH_HEADS = {
    "colour": 1 + len(vqa.COLOURS) + 1,
    "shape": 1 + len(vqa.SHAPES) + 1,
    "char": 1 + len(vqa.CHARACTERS),
    "row": 3,
    "column": 3,
    "centre": 1 + len(vqa.SHAPES),
}
DENSITY_WEIGHT = 5.0  # the density head's share of the dense loss (1: shape 0.98, kind-on-centre 0.82 at 700 steps;
# 5: 0.99, 0.89, and counts read off the density right 0.84 against 0.57)
SIDE = vqa.IMAGE_SIZE // 16  # patches per side
# the row and column of the 3 x 3 cell each patch (raster order) lies in
ROW_OF_PATCH, COLUMN_OF_PATCH = np.array(np.divmod(np.arange(SIDE * SIDE), SIDE)) // (SIDE // 3)


def patch_labels(scene: vqa.Scene) -> dict[str, torch.Tensor]:
    """[144] class per patch for each dense head, and "density": [144, 4] float.

    colour/shape/char name the object covering most of the patch (>= 20 %), else 0: colour 1..6 palette, 7 the
    sign; shape 1..4 kinds, 5 the sign; char 1..16 on the sign. Every patch of an object gets the whole object's
    label, so the tower must spread what an object is over all its patches (its interior alone cannot tell a
    large square from a large circle). row / column: of the named 3 x 3 cell the patch lies in (questions name
    cells by row and column); centre: the kind (1..4) on the patch holding a shape's centre, 0 elsewhere: one
    token per object that says what it is. density: per kind, the share of each shape of that kind on the patch
    divided by the shape's total (each shape sums to 1 over its patches, so a kind's sum over the image is its
    count, whatever the shapes' sizes): the counting signal spread evenly over a shape's tokens."""
    coverage = vqa.patch_coverage(scene)
    owner = np.where(coverage.max(0) >= 0.2, coverage.argmax(0), -1)
    sign = len(scene.shapes)
    colours, kinds = list(vqa.COLOURS), list(vqa.SHAPES)
    labels = {k: np.zeros(coverage.shape[1], dtype=np.int64) for k in PATCH_HEADS}
    for p, o in enumerate(owner):
        if o == sign:
            mark_sign(labels, p, scene.sign)
        elif o >= 0:
            labels["colour"][p] = 1 + colours.index(scene.shapes[o].colour)
            labels["shape"][p] = 1 + kinds.index(scene.shapes[o].kind)
    labels["row"][:], labels["column"][:] = ROW_OF_PATCH, COLUMN_OF_PATCH
    for s in scene.shapes:
        x, y = s.centre
        labels["centre"][(y // 16) * SIDE + x // 16] = 1 + kinds.index(s.kind)
    labels["density"] = np.zeros((coverage.shape[1], len(kinds)), dtype=np.float32)
    for i, s in enumerate(scene.shapes):
        labels["density"][:, kinds.index(s.kind)] += coverage[i] / coverage[i].sum()
    return {k: torch.from_numpy(v) for k, v in labels.items()}


def mark_sign(labels: dict, where, sign: vqa.Sign) -> None:
    """Label the patches `where` (index or mask) as `sign`'s: colour and shape 'sign' (one past the palette and
    the kinds), char its glyph."""
    labels["colour"][where], labels["shape"][where] = len(vqa.COLOURS) + 1, len(vqa.SHAPES) + 1
    labels["char"][where] = 1 + vqa.CHARACTERS.index(sign.char)


def dense_loss(
    heads, patches: torch.Tensor, targets: dict[str, torch.Tensor], density_weight: float = DENSITY_WEIGHT
) -> torch.Tensor:
    """Sum of the heads' cross-entropies, each over the patches its label is about: colour (0 = background) and
    row/column on every patch, shape on objects' patches, char on the sign's, centre on shapes' patches (over
    every patch, the background's label swamps the few patches that name a glyph or a shape, and the tower never
    learns them); plus `density_weight` x the density head's squared error, summed over patches, mean over images
    and kinds. Regressing a density makes every token of a shape know the whole shape's extent and kind: with it
    the per-patch shape head reaches 0.99, without it 0.86 in the same steps."""
    objects = targets["shape"] > 0
    where = {"colour": None, "row": None, "column": None, "shape": objects, "char": targets["char"] > 0,
             "centre": objects & (targets["shape"] <= len(vqa.SHAPES))}  # fmt: skip
    total = density_weight * ((heads["density"](patches) - targets["density"]) ** 2).sum(1).mean()
    for k in PATCH_HEADS:
        logits, labels = heads[k](patches), targets[k]
        if where[k] is not None:
            logits, labels = logits[where[k]], labels[where[k]]
        total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.flatten())
    return total


def dense_accuracy(heads, patches: torch.Tensor, targets: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per head, accuracy on the patches its label is about (an object's, the centre's; all for row/column);
    count: the density head's sum over the patches, rounded, right per image and kind."""
    out = {}
    for k in PATCH_HEADS:
        guess, truth = heads[k](patches).argmax(-1), targets[k]
        where = truth >= 0 if k in ("row", "column") else truth > 0
        out[k] = float((guess[where] == truth[where]).float().mean())
    guess, truth = heads["density"](patches).sum(1).round(), targets["density"].sum(1).round()
    out["count"] = float((guess == truth).float().mean())
    return out


def extra_signs(scene: vqa.Scene, chance: float = 0.7) -> tuple[vqa.Sign, ...]:
    """Signs for the scene's empty cells (each with probability `chance`), drawn as `vqa.scene` draws its sign.
    Stage (a) only: one sign per image gives the glyph head a few patches per image, too few to learn 16
    glyphs in minutes; the QA images keep exactly one sign."""
    rng = np.random.default_rng([*scene.seed, 23])
    taken = {s.cell for s in scene.shapes} | {scene.sign.cell}
    signs = []
    for cell in range(9):
        if cell in taken or rng.random() >= chance:
            continue
        scale = int(rng.integers(3, 5))
        x, y = vqa.place_sign(rng, cell, scale)
        signs.append(vqa.Sign(str(rng.choice(vqa.CHARACTERS)), cell, x, y, scale))
    return tuple(signs)


def stage_a_sample(scene: vqa.Scene) -> tuple[Image.Image, dict[str, torch.Tensor], str]:
    """(image, patch labels, caption) of a stage (a) image: the scene plus `extra_signs` in its empty cells."""
    signs = extra_signs(scene)
    pixels = np.asarray(vqa.render(scene)).copy()
    labels = patch_labels(scene)
    for sign in signs:
        vqa.paint_sign(pixels, sign)
        box = np.zeros((vqa.IMAGE_SIZE, vqa.IMAGE_SIZE), dtype=bool)
        box[sign.box[1] : sign.box[3], sign.box[0] : sign.box[2]] = True
        mark_sign(labels, torch.from_numpy(vqa.patch_share(box) >= 0.2), sign)
    return Image.fromarray(pixels), labels, vqa.caption(scene, signs)


def caption_batch(tokenizer, processor, indices: list[int]) -> dict[str, torch.Tensor]:
    samples = [stage_a_sample(vqa.scene("train", i)) for i in indices]
    ids = [tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id] for _, _, c in samples]
    input_ids = pad(ids, tokenizer.pad_token_id)
    labels = [x for _, x, _ in samples]
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != tokenizer.pad_token_id).long(),
        "pixel_values": pixel_values([image for image, _, _ in samples], processor),
        "patch_labels": {k: torch.stack([x[k] for x in labels]) for k in [*PATCH_HEADS, "density"]},
    }


@torch.no_grad()
def whiten_patch_embedding(vision_model, pixels: torch.Tensor) -> None:
    """Start the tower's patch embedding (conv, no bias) as PCA whitening of `pixels`' [B, 3, H, W] 16-px patches:
    each of its 128 outputs a principal component at unit variance. From the default small random init, the
    patch signal is swamped by the position embeddings and the tower needs far longer to learn anything beyond
    a patch's mean colour (a shape probe stayed at chance for 300 steps; whitened, it reaches 0.77 in 150)."""
    conv = vision_model.embeddings.patch_embedding
    size, width = conv.kernel_size[0], conv.out_channels
    patches = pixels.unfold(2, size, size).unfold(3, size, size)  # [B, C, h, w, size, size]
    patches = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(0, 2)  # [B*h*w, C*size*size], conv's order
    patches = patches - patches.mean(0)
    _, values, vectors = torch.pca_lowrank(patches, q=width, center=False)
    std = values / (patches.shape[0] - 1) ** 0.5
    conv.weight.copy_((vectors / std).T.reshape_as(conv.weight))


def train_clip(args, tokenizer, processor) -> dict[str, torch.Tensor]:
    """Stage (a); returns the vision tower's state dict (CLIPVisionModel key names).

    Contrastive loss (image [CLS] vs caption) plus, on the patch tokens of the feature layer, linear heads that
    name the object under each patch (colour, shape, glyph): the dense loss makes objects stand out from the
    textured background in the features the LLM reads, which a few hundred contrastive steps alone do not.
    The heads are dropped; [CLS] gets its meaning from the contrastive loss only (they read patches)."""
    model = clip_model(tokenizer, args.seed).train()
    images = [vqa.render(vqa.scene("train", 40_000_000 + i)) for i in range(200)]
    whiten_patch_embedding(model.vision_model, pixel_values(images, processor))
    width = VISION["hidden_size"]
    heads = torch.nn.ModuleDict({k: torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, n))
                                 for k, n in PATCH_HEADS.items()})  # fmt: skip
    heads["density"] = torch.nn.Linear(width, len(vqa.SHAPES))  # no norm: a density is a magnitude
    torch.nn.init.zeros_(heads["density"].weight)  # starts at zero density: a random start's error is huge
    torch.nn.init.zeros_(heads["density"].bias)
    params = [*model.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.clip_lr, weight_decay=0.05)
    held_out = caption_batch(tokenizer, processor, list(range(30_000_000, 30_000_064)))
    start = time.time()
    for step in range(args.clip_steps):
        for group in optimizer.param_groups:
            group["lr"] = args.clip_lr * cosine(step, args.clip_steps, args.clip_steps // 20)
        first = 10_000_000 + step * args.clip_batch  # its own range of training scenes
        batch = caption_batch(tokenizer, processor, list(range(first, first + args.clip_batch)))
        targets = batch.pop("patch_labels")
        out = model(**batch, return_loss=True, output_hidden_states=True)
        patches = out.vision_model_output.hidden_states[-2][:, 1:]  # the feature layer LLaVA reads, [B, N, D]
        # the density loss ramps up over the first 30 % of steps: at full weight from step 0 the contrastive loss
        # stayed at chance (ln 32) for 800 of 1000 steps; ramped, it leaves chance within 150
        dense = dense_loss(heads, patches, targets, DENSITY_WEIGHT * min(1.0, step / (0.3 * args.clip_steps)))
        loss = out.loss + dense
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.clip_steps - 1:
            with torch.no_grad():
                model.eval()
                hidden = model.vision_model(held_out["pixel_values"], output_hidden_states=True).hidden_states
                scores = dense_accuracy(heads, hidden[-2][:, 1:], held_out["patch_labels"])
                model.train()
            log(
                f"clip step {step}/{args.clip_steps} contrastive {out.loss.item():.3f} dense {dense.item():.3f} "
                + " ".join(f"{k} {v:.2f}" for k, v in scores.items())
                + f" ({time.time() - start:.0f} s)"
            )
    return model.vision_model.state_dict()


# ---- stage (b): visual QA ----


def conversation(tokenizer, image_tokens: int, turns: list[vqa.Question]) -> tuple[list[int], list[int]]:
    """(ids, labels) of one multi-turn LLaVA conversation about one image; labels are -100 except answers + </s>.
    The first turn tokenizes exactly as the processor's 'USER: <image>\\n{q} ASSISTANT:' prompt does."""
    ids, labels = [], []
    for turn, q in enumerate(turns):
        prompt = ("USER: " + "<image>" * image_tokens + "\n" if turn == 0 else "USER: ") + q.text + " ASSISTANT:"
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(q.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids += prompt_ids + answer_ids
        labels += [-100] * len(prompt_ids) + answer_ids
    return ids, labels


def qa_batch(tokenizer, processor, indices: list[int], rng: np.random.Generator, draws: int = 3):
    """One conversation per image: `draws` question sets of the scene (duplicates dropped, ~12 questions) in
    random order, then a caption turn (LLaVA's stage-1 "describe the image" data): ~25 more answer tokens that
    each need the image; last, so no question can copy its answer from the caption. The 144 visual tokens are
    most of a row's cost, so more questions per image is more signal per second."""
    image_tokens = SIDE * SIDE
    images, ids, labels = [], [], []
    for index in indices:
        scene = vqa.scene("train", index)
        image, turns = vqa.render(scene), vqa.questions(scene)
        for _ in range(draws - 1):
            asked = {t.text for t in turns}
            turns += [q for q in vqa.questions(scene, rng) if q.text not in asked]
        turns = [turns[i] for i in rng.permutation(len(turns))]
        turns.append(vqa.Question("caption", CAPTION_PROMPT, vqa.caption(scene)))
        row_ids, row_labels = conversation(tokenizer, image_tokens, turns)
        images.append(image)
        ids.append(row_ids)
        labels.append(row_labels)
    input_ids = pad(ids, tokenizer.pad_token_id)
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != tokenizer.pad_token_id).long(),
        "labels": pad(labels, -100),
        "pixel_values": pixel_values(images, processor),
    }


@torch.no_grad()
def validate(model, tokenizer, processor, count: int = 250) -> dict[str, float]:
    """Teacher-forced single-turn accuracy per question type on the first `count` validation questions."""
    model.eval()
    image_tokens = SIDE * SIDE
    pairs = vqa.question_set("validation", count)
    right: dict[str, list[bool]] = {k: [] for k in vqa.QUESTION_TYPES}
    for start in range(0, count, 50):
        chunk = pairs[start : start + 50]
        rows = [conversation(tokenizer, image_tokens, [q]) for _, q in chunk]
        prompts = [r[0][: r[1].index(next(x for x in r[1] if x != -100))] for r in rows]  # ids up to the answer
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # left pad
        images = [vqa.render(vqa.scene("validation", i)) for i, _ in chunk]
        logits = model(
            input_ids=input_ids,
            attention_mask=(input_ids != tokenizer.pad_token_id).long(),
            pixel_values=pixel_values(images, processor),
        ).logits[:, -1]
        for (_, q), guess in zip(chunk, logits.argmax(-1).tolist(), strict=True):
            right[q.kind].append(tokenizer.convert_ids_to_tokens(guess) == q.answer)
    model.train()
    scores = {k: float(np.mean(v)) for k, v in right.items()}
    scores["all"] = float(np.mean([x for v in right.values() for x in v]))
    return scores


def save(model, processor, out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")


@torch.no_grad()
def standardise_projector_input(model, pixels: torch.Tensor) -> None:
    """Fold a per-channel standardisation of the feature layer (mean/std over `pixels`' patch tokens) into the
    projector's first linear layer: the stock projector stays, but starts on O(1) inputs. Without it, the tiny
    tower's features are one large shared direction plus tiny per-patch variation, and the LM never learns to
    look at the image (answers stay at the prior)."""
    hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states
    features = hidden[model.config.vision_feature_layer][:, 1:]  # [B, N, D], [CLS] dropped as in training
    mean, std = features.mean((0, 1)), features.std((0, 1)) + 1e-6
    linear = model.model.multi_modal_projector.linear_1
    linear.weight /= std
    linear.bias -= linear.weight @ mean


def train_vqa(args, tokenizer, processor, tower: dict[str, torch.Tensor]):
    """Stage (b); returns the trained LlavaForConditionalGeneration and the validation history."""
    model = build_model(tokenizer, args.seed)
    model.model.vision_tower.load_state_dict(tower)
    images = [vqa.render(vqa.scene("train", 20_000_000 + i)) for i in range(64)]
    standardise_projector_input(model, pixel_values(images, processor))
    model.train()
    tower_params = list(model.model.vision_tower.parameters())
    tower_ids = {id(p) for p in tower_params}
    rest = [p for p in model.parameters() if id(p) not in tower_ids]
    groups = [{"params": rest, "scale": 1.0}]
    if args.tower_lr_scale > 0:
        groups.append({"params": tower_params, "scale": args.tower_lr_scale})
    else:  # frozen: no backward through the tower, and its [CLS] attention stays exactly stage (a)'s
        model.model.vision_tower.requires_grad_(False)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    history, start = [], time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * group["scale"] * cosine(step, args.steps, args.steps // 20)
        first = step * args.batch
        loss = model(**qa_batch(tokenizer, processor, list(range(first, first + args.batch)), rng, args.draws)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0:
            log(f"vqa step {step}/{args.steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)")
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            scores = validate(model, tokenizer, processor)
            history.append({"step": step + 1, "seconds": round(time.time() - start), **scores})
            log("validation " + " ".join(f"{k} {v:.3f}" for k, v in scores.items()))
            save(model, processor, args.out, {"partial": True, "validation": history})  # inspectable mid-run
    return model.eval(), history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clip-steps", type=int, default=1000)
    parser.add_argument("--clip-batch", type=int, default=32)
    parser.add_argument("--clip-lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draws", type=int, default=3, help="question sets per training image")
    parser.add_argument("--tower-lr-scale", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stage-a", type=Path, default=None, help="stage (a) tower file: saved, or reused if present")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    began = time.time()
    if args.stage_a is not None and args.stage_a.exists():  # resume from a saved stage (a) of the same seed
        from safetensors.torch import load_file

        tower = load_file(args.stage_a)
    else:
        tower = train_clip(args, tokenizer, processor)
        if args.stage_a is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tower.items()}, args.stage_a)
    clip_seconds = time.time() - began
    model, history = train_vqa(args, tokenizer, processor, tower)
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "clip_seconds": round(clip_seconds),
        "total_seconds": round(time.time() - began),
        "validation": history,
    }
    save(model, processor, args.out, record)
    log(f"saved to {args.out} after {record['total_seconds']} s")


if __name__ == "__main__":
    main()
