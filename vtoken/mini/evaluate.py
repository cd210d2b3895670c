"""Accuracy of a model on procedural VQA questions, through the model's own processor and `generate` (the path a
user takes), so a patched model is scored exactly as it answers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import vqa


@dataclass
class Result:
    """Per-question outcomes; `kept[i]`: the kept patch indices of question i's image (None: not recorded)."""

    kinds: list[str] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    kept: list[list[int] | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def accuracy(self) -> dict[str, float]:
        """Accuracy per question type and over all ("all")."""
        out = {}
        for kind in (*vqa.QUESTION_TYPES, "all"):
            hits = [c for k, c in zip(self.kinds, self.correct, strict=True) if kind in (k, "all")]
            out[kind] = sum(hits) / max(len(hits), 1)
        return out


@torch.inference_mode()
def evaluate(model, processor, pairs: list[tuple[int, vqa.Question]], split: str = "test", batch: int = 50) -> Result:
    """Greedy answers (up to 3 new tokens) to `pairs` of (scene index in `split`, question), `batch` at a time;
    an answer is right when its first word is the one-word answer (a model shown fewer tokens than it was trained
    on may not stop after the word: that is scored by the word, not by the stop). If the model is patched by
    vtoken, the kept tokens of every image are recorded too."""
    import vtoken

    from ..prompts import build_prompt

    result = Result()
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        images = [vqa.render(vqa.scene(split, index)) for index, _ in chunk]
        prompts = [build_prompt(processor, q.text) for _, q in chunk]
        inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True)
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        texts = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        handle = vtoken.handle_of(model)
        records = {}  # per image (LLaVA-1.5: one crop each): its encoder record, else its last LLM-stage one
        for r in handle.records if handle is not None else []:
            if r.stage == "encoder" or records.get(r.image, r).stage != "encoder":
                records[r.image] = r
        for row, ((_, q), text) in enumerate(zip(chunk, texts, strict=True)):
            result.kinds.append(q.kind)
            word = (text.split() or [""])[0]
            result.answers.append(word)
            result.correct.append(word == q.answer)
            record = records.get(row)
            result.kept.append(None if record is None or record.kept is None else [int(k) for k in record.kept])
            visual = int((inputs["input_ids"][row] == model.config.image_token_id).sum())
            result.tokens.append(record.tokens_out if record is not None else visual)
    return result
