"""Train vtoken-mini from a seed, the way LLaVA was trained, on procedurally generated data only.

Stage (a): a tiny CLIP (the vision tower + a small text tower) trained contrastively on image/caption pairs, so
the tower's [CLS] attention means something (LLaVA-style training never sends a gradient to the [CLS] row of the
feature layer), plus dense per-patch heads (colour, shape, glyph) on the feature layer. Stage (b): the tower
frozen, projector + Llama trained on visual QA (loss on answer tokens only). Every image's five questions are
packed as one multi-turn conversation (as LLaVA's data is), closed by a caption turn, so one image encoding
teaches about 30 answer tokens.

    python -m vtoken.mini.train --seed 0 --out vtoken/mini/weights

One thread by design (a shared 2-core machine): stage (a) took 11 min and stage (b) 31 min there for the shipped
weights (vtoken/mini/weights/training.json).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

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


PATCH_HEADS = {"colour": 1 + len(vqa.COLOURS) + 1, "shape": 1 + len(vqa.SHAPES) + 1, "char": 1 + len(vqa.CHARACTERS)}


def patch_labels(scene: vqa.Scene) -> dict[str, torch.Tensor]:
    """[144] class per patch for each dense head: the object covering most of the patch (>= 20 %), else 0.
    colour: 1..6 palette, 7 the sign; shape: 1..4 kinds, 5 the sign; char: 1..16 on the sign's patches."""
    coverage = vqa.patch_coverage(scene)
    owner = np.where(coverage.max(0) >= 0.2, coverage.argmax(0), -1)
    sign = len(scene.shapes)
    colours, kinds = list(vqa.COLOURS), list(vqa.SHAPES)
    labels = {k: np.zeros(coverage.shape[1], dtype=np.int64) for k in PATCH_HEADS}
    for p, o in enumerate(owner):
        if o == sign:
            labels["colour"][p], labels["shape"][p] = len(colours) + 1, len(kinds) + 1
            labels["char"][p] = 1 + vqa.CHARACTERS.index(scene.sign.char)
        elif o >= 0:
            labels["colour"][p] = 1 + colours.index(scene.shapes[o].colour)
            labels["shape"][p] = 1 + kinds.index(scene.shapes[o].kind)
    return {k: torch.from_numpy(v) for k, v in labels.items()}


def caption_batch(tokenizer, processor, indices: list[int]) -> dict[str, torch.Tensor]:
    scenes = [vqa.scene("train", i) for i in indices]
    ids = [tokenizer.encode(vqa.caption(s), add_special_tokens=False) + [tokenizer.eos_token_id] for s in scenes]
    input_ids = pad(ids, tokenizer.pad_token_id)
    labels = [patch_labels(s) for s in scenes]
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != tokenizer.pad_token_id).long(),
        "pixel_values": pixel_values([vqa.render(s) for s in scenes], processor),
        "patch_labels": {k: torch.stack([x[k] for x in labels]) for k in PATCH_HEADS},
    }


def train_clip(args, tokenizer, processor) -> dict[str, torch.Tensor]:
    """Stage (a); returns the vision tower's state dict (CLIPVisionModel key names).

    Contrastive loss (image [CLS] vs caption) plus, on the patch tokens of the feature layer, linear heads that
    name the object under each patch (colour, shape, glyph): the dense loss makes objects stand out from the
    textured background in the features the LLM reads, which a few hundred contrastive steps alone do not.
    The heads are dropped; [CLS] gets its meaning from the contrastive loss only (they read patches)."""
    model = clip_model(tokenizer, args.seed).train()
    width = VISION["hidden_size"]
    heads = torch.nn.ModuleDict({k: torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, n))
                                 for k, n in PATCH_HEADS.items()})  # fmt: skip
    params = [*model.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.clip_lr, weight_decay=0.05)
    start = time.time()
    for step in range(args.clip_steps):
        for group in optimizer.param_groups:
            group["lr"] = args.clip_lr * cosine(step, args.clip_steps, args.clip_steps // 20)
        first = 10_000_000 + step * args.clip_batch  # its own range of training scenes
        batch = caption_batch(tokenizer, processor, list(range(first, first + args.clip_batch)))
        targets = batch.pop("patch_labels")
        out = model(**batch, return_loss=True, output_hidden_states=True)
        patches = out.vision_model_output.hidden_states[-2][:, 1:]  # the feature layer LLaVA reads, [B, N, D]
        dense = sum(torch.nn.functional.cross_entropy(heads[k](patches).flatten(0, 1), targets[k].flatten())
                    for k in PATCH_HEADS)  # fmt: skip
        loss = out.loss + dense
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.clip_steps - 1:
            log(
                f"clip step {step}/{args.clip_steps} contrastive {out.loss.item():.3f} dense {dense.item():.3f} "
                f"({time.time() - start:.0f} s)"
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


def qa_batch(tokenizer, processor, indices: list[int], rng: np.random.Generator, split: str = "train"):
    """One conversation per image: its five questions in random order, then a caption turn (LLaVA's stage-1
    "describe the image" data): ~25 more answer tokens that each need the image, which is what gets a model
    trained from scratch off the answer prior; last, so no question can copy its answer from the caption."""
    image_tokens = (vqa.IMAGE_SIZE // 16) ** 2
    images, ids, labels = [], [], []
    for index in indices:
        scene = vqa.scene(split, index)
        image, turns = vqa.render(scene), vqa.questions(scene)
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
    image_tokens = (vqa.IMAGE_SIZE // 16) ** 2
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
        loss = model(**qa_batch(tokenizer, processor, list(range(first, first + args.batch)), rng)).loss
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
    parser.add_argument("--clip-steps", type=int, default=200)
    parser.add_argument("--clip-batch", type=int, default=96)
    parser.add_argument("--clip-lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tower-lr-scale", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
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
