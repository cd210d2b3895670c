"""The question a prompt asks, read from the tokenized prompt the user already passed (for text-guided methods).

`question_from_prompt("USER: <image>\\nwhat is in the image? ASSISTANT:")` -> "what is in the image?": the last
user turn, without image/video placeholders, chat-template role markers and special tokens. Prompts without role
markers are taken whole.

Reading the prompt needs the model's tokenizer: `vtoken.zoo.load` remembers the one it loads with the model;
otherwise it is loaded from the model's own checkpoint (`model.name_or_path`), as users load the processor.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from .errors import VTokenError

# chat-template turn markers: (regex, role it opens; None = it closes a turn)
TURN_MARKERS: tuple[tuple[str, str | None], ...] = (
    (r"<\|im_start\|>\s*user\s*", "user"),  # ChatML: Qwen2/2.5-VL, LLaVA-OneVision
    (r"<\|im_start\|>\s*\w+\s*", "other"),
    (r"<\|im_end\|>", None),
    (r"<\|start_header_id\|>\s*user\s*<\|end_header_id\|>\s*", "user"),  # Llama-3 (llava-next llama3)
    (r"<\|start_header_id\|>\s*\w+\s*<\|end_header_id\|>\s*", "other"),
    (r"<\|eot_id\|>", None),
    (r"<start_of_turn>\s*user\s*", "user"),  # Gemma
    (r"<start_of_turn>\s*\w+\s*", "other"),
    (r"<end_of_turn>", None),
    (r"\[INST\]", "user"),  # Mistral (llava-v1.6-mistral)
    (r"\[/INST\]", "other"),
    (r"<\|user\|>", "user"),  # Phi-3
    (r"<\|assistant\|>|<\|system\|>", "other"),
    (r"<\|end\|>", None),
    (r"(?:^|(?<=\s)|(?<=>))(?:USER|Human)\s*:", "user"),  # Vicuna (llava-1.5, llava-v1.6-vicuna)
    (r"(?:^|(?<=\s)|(?<=>))(?:ASSISTANT|Assistant|SYSTEM|System)\s*:", "other"),
)
_TURNS = re.compile("|".join(f"({pattern})" for pattern, _ in TURN_MARKERS))
_SPECIAL = re.compile(r"<\|[^|>]*\|>|</?s>|<image>|<video>|<pad>|<unk>|<bos>|<eos>")


def question_from_prompt(text: str, special_tokens: tuple[str, ...] = ()) -> str:
    """The last user turn of a decoded prompt, without role markers, placeholders and special tokens."""
    segments: list[tuple[str | None, str]] = []  # (role, text) of every stretch between markers
    role, start = None, 0
    for match in _TURNS.finditer(text):
        segments.append((role, text[start : match.start()]))
        role = TURN_MARKERS[match.lastindex - 1][1]
        start = match.end()
    segments.append((role, text[start:]))
    users = [part for role, part in segments if role == "user"]
    question = users[-1] if users else "".join(part for _, part in segments)
    for token in sorted(special_tokens, key=len, reverse=True):
        question = question.replace(token, " ")
    return " ".join(_SPECIAL.sub(" ", question).split())


def prompt_questions(input_ids: Any, attention_mask: Any, tokenizer: Any) -> list[str]:
    """The question of every row of a tokenized batch [B, L] (padding skipped): tensors (read to the host in one
    read: the tokenizer needs the words) or the nested lists such a read gives."""
    special = tuple(getattr(tokenizer, "all_special_tokens", ()))
    added = tuple(getattr(tokenizer, "added_tokens_decoder", {}).values())
    special += tuple(str(t) for t in added if getattr(t, "special", False))
    if isinstance(input_ids, torch.Tensor):
        if attention_mask is None:
            input_ids = input_ids.tolist()
        else:
            both = torch.cat([input_ids, attention_mask.to(input_ids)]).tolist()
            input_ids, attention_mask = both[: len(both) // 2], both[len(both) // 2 :]
    elif isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask.tolist()
    questions = []
    for row, ids in enumerate(input_ids):
        if attention_mask is not None:
            ids = [i for i, keep in zip(ids, attention_mask[row], strict=True) if keep]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        questions.append(question_from_prompt(text, special))
    return questions


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_tokenizer(model: torch.nn.Module, tokenizer: Any) -> None:
    """Tell vtoken which tokenizer reads `model`'s prompts (`vtoken.zoo.load` does this for you). Given the model's
    processor, vtoken keeps it too: methods that read pixel values (PixelPrune) take the image normalisation
    (`image_mean`, `image_std`) the pixels were made with from its image processor."""
    _TOKENIZERS[model] = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer, or the tokenizer
    if image_processor_of(tokenizer) is not None:
        _PROCESSORS[model] = tokenizer


def image_processor_of(processor: Any) -> Any | None:
    """The image processor of a processor (its `image_processor`), the object itself if it is one (it has
    `image_mean` and `image_std`), else None (a tokenizer)."""
    for candidate in (getattr(processor, "image_processor", None), processor):
        if candidate is not None and hasattr(candidate, "image_mean") and hasattr(candidate, "image_std"):
            return candidate
    return None


def processor_for(model: torch.nn.Module) -> Any | None:
    """The processor `remember_tokenizer` kept for `model` (None: it was given a tokenizer only, or never called)."""
    return _PROCESSORS.get(model)


def tokenizer_for(model: torch.nn.Module, method: str) -> Any:
    """The tokenizer of `model`: remembered, or loaded from the checkpoint it came from; a clear error if neither."""
    if model in _TOKENIZERS:
        return _TOKENIZERS[model]
    source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if source:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as error:  # noqa: BLE001 - any loading failure means the same to the user
            reason = f"loading it from {source!r} failed: {type(error).__name__}: {error}"
        else:
            _TOKENIZERS[model] = tokenizer
            return tokenizer
    else:
        reason = "the model records no checkpoint to load it from"
    raise VTokenError(
        f"method {method!r} embeds the prompt's question and needs the model's tokenizer; {reason}. "
        "Call vtoken.remember_tokenizer(model, processor) first, or load the model with vtoken.zoo.load"
    )
