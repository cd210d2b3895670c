"""How a patched model's calls run, shared by every adapter (mixed into `Adapter`).

- `prepare`: encode every visual input with the encoder-stage method and shrink the prompt to the kept tokens;
- the forward pre-hook (`_pre_forward`) for a plain `model(**inputs)` call, including manual decoding steps after
  a pruned prefill (`_continue_decoding`), and the post-forward hook that applies labels to the kept columns;
- the generate wrapper's body (`_patched_generate`): encode and select first, then the stock `generate` on the
  shorter prompt with the pre-encoded features, the caller's prompt put back in front of the result.
Per-call state lives in the calling thread's `CallState` (see `state.py`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from vtoken.errors import InputError

from . import hf
from .prompt import compress_prompt, gather_columns


class CallPath:
    """The call-time half of `Adapter`: everything that runs inside `model(...)` / `model.generate(...)`."""

    # ----------------------------------------------------------------- the shared encode + shrink step
    def prepare(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Encode every visual input in `kwargs`, shrink the prompt, and return model kwargs for the stock code
        path with whether the prompt changed."""
        kwargs = dict(kwargs)
        if kwargs.get("input_ids") is None:
            raise InputError(
                "a patched model needs `input_ids` (with the image placeholders) next to the images, to know where "
                "visual tokens go; inputs_embeds alone are not supported"
            )
        kwargs = self.before_shrinking(kwargs)
        mm = hf.encoder_outputs(kwargs)
        records, changed, protected_parts = [], False, {}
        method = self.encoder_method
        for modality in self.present(kwargs):
            frames = self.videos_as_image_runs and "video" in method.modalities  # the adapter tells them apart
            if modality.name not in method.modalities and not frames:  # e.g. images given to a video method
                raise InputError(
                    f"{method.name} acts on {' and '.join(method.modalities)} inputs only; this call passes "
                    f"{modality.name}s (`{modality.pixel_key}`): call the model without them, or use another method"
                )
        for modality in self.present(kwargs):
            pixel_values = kwargs.pop(modality.pixel_key)
            encoder_kwargs = {k: kwargs.pop(k) for k in modality.encoder_kwargs if k in kwargs}
            run_lengths = self.plan(modality, pixel_values, **encoder_kwargs)
            if "question" in self.encoder_method.requires:
                self._state.questions = self.item_questions(kwargs, modality, run_lengths)
            shrink = functools.partial(
                compress_prompt,
                kwargs["input_ids"],
                self.placeholder_id(modality),
                run_lengths,
                attention_mask=kwargs.get("attention_mask"),
                position_ids=kwargs.get("position_ids"),
                labels=kwargs.get("labels"),
                pad_token_id=self.pad_token_id,
                positions=self.positions,
            )
            # "How many" before the encoder, "which" after: with contiguous positions only the count matters to
            # the prompt, so for fixed-count methods it is shrunk while the accelerator is still idle.
            placed = method.acts_on == "placed"  # selects among the packed tokens (DivPrune), after `encode`
            planned = [method.planned_count(n) for n in run_lengths] if placed else \
                self.planned_counts(modality, run_lengths)  # fmt: skip
            early = self.positions == "renumber" and None not in planned
            if early:
                compressed = shrink([torch.arange(k) for k in planned])
            encoded = self.encode(modality, pixel_values, **encoder_kwargs)
            if placed:
                encoded = self.select_placed(modality, encoded)
            if early:
                produced = [len(f) for f in encoded.features]
                if produced != planned:
                    raise RuntimeError(f"{self.encoder_method.name} kept {produced} tokens, planned {planned}")
            else:
                compressed = shrink(encoded.keep_offsets)
            records += encoded.records
            if encoded.protected is not None:
                protected_parts[modality] = torch.cat(encoded.protected)
            # a list where items differ in length: `_join_ragged` joins them for the forward
            stack = modality.name in self.stacked_features and len({len(f) for f in encoded.features}) == 1
            features = torch.stack(encoded.features) if stack else encoded.features
            mm[modality.name] = self.encoder_output(encoded, features)
            if compressed.changed:
                changed = True
                kwargs["input_ids"] = compressed.input_ids
                for key in ("attention_mask", "position_ids", "labels"):
                    value = getattr(compressed, key)
                    if value is not None or key in kwargs:
                        kwargs[key] = value
                for key, fill in self.token_columns.items():
                    if kwargs.get(key) is not None:
                        kwargs[key] = gather_columns(kwargs[key], compressed.index, fill)
        self.records = records
        state = self._state
        state.protected = None
        if protected_parts:
            ids = kwargs["input_ids"]
            state.protected = torch.zeros_like(ids, dtype=torch.bool)
            for modality, flags in protected_parts.items():
                state.protected[ids == self.placeholder_id(modality)] = flags.to(ids.device)
        kwargs[hf.ENCODER_OUTPUTS] = mm
        return self.after_shrinking(kwargs), changed

    # ----------------------------------------------------------------- what the LLM stages read
    def _note_visual(self, kwargs: dict[str, Any]) -> None:
        """Remember which tokens of this forward's `input_ids` are visual, for the LLM stages."""
        ids = kwargs.get("input_ids")
        if self._llm_stages is None or ids is None:
            self._state.visual = None
            return
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for modality in self.modalities:
            visual |= ids == self.placeholder_id(modality)
        self._state.visual = visual

    def visual_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """[B, L] visual tokens of the LLM input of this shape (None if the forward's input_ids were not seen)."""
        return self._visual if self._visual is not None and tuple(self._visual.shape) == shape else None

    def protected_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """[B, L] tokens an encoder stage protected (rows repeated for beams / return sequences), or None."""
        protected = self._state.protected
        if protected is None or protected.shape[1] != shape[1] or shape[0] % protected.shape[0]:
            return None
        return protected.repeat_interleave(shape[0] // protected.shape[0], dim=0)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if args:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            kwargs = {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}
        state = self._state
        if state.in_generate:  # generate already works on the shrunk prompt
            self._note_visual(kwargs)
            return None
        state.labels, state.final_columns = None, None
        if self._llm_stages is not None:
            self._refuse_static_cache(None, hf.cache_in(kwargs))
        kwargs = self._forward_kwargs(kwargs)
        if self._llm_stages is not None and kwargs.get("labels") is not None:
            # applied to the kept columns in `_post_forward` (with the Trainer's token count, if given)
            state.labels = kwargs.pop("labels"), kwargs.get("num_items_in_batch")
        self._note_visual(kwargs)
        return (), kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """With an LLM stage, the loss of a forward given labels: the model's own loss function over the sequence
        the last decoder layers ran on (the kept columns; a dropped column takes its label with it)."""
        state = self._state
        given, state.labels = state.labels, None
        if given is None or state.in_generate:
            return None
        labels, num_items = given
        columns = state.final_columns
        if columns is not None:
            labels = gather_columns(labels, columns, -100)
        logits = output["logits"] if isinstance(output, dict) else output[0]
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        loss = self.model.loss_function(
            logits=logits, labels=labels.to(logits.device), vocab_size=logits.shape[-1], **extra
        )
        if isinstance(output, dict):
            return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
        return (loss, *output)

    def _refuse_static_cache(self, implementation: str | None, cache: Any) -> None:
        """LLM stages give each layer's cache its own length: only a DynamicCache can hold that."""
        if implementation in hf.static_cache_implementations() or (
            cache is not None and not isinstance(cache, DynamicCache)
        ):
            got = f"cache_implementation={implementation!r}" if cache is None else type(cache).__name__
            raise InputError(
                f"{self.prefill_method.name} drops tokens inside the LLM, so its layers' caches hold different "
                f"lengths, which needs a DynamicCache (the default); got {got}. A static cache works with "
                "encoder-stage methods only"
            )

    def _forward_kwargs(self, kwargs: dict) -> dict:
        """What the stock forward of a plain `model(...)` call gets: the shrunk prompt and pre-encoded features,
        a decoding step mapped onto the shrunk prompt, or the call unchanged."""
        if not self.present(kwargs):
            continued = self._continue_decoding(kwargs)
            if continued is None:
                self.records, self._state.last_prompt = [], None
            return continued or kwargs
        if self.encoder_method is None:  # LLM stages only: the stock encoder runs
            self.records, self._state.last_prompt, self._state.protected = [], None, None
            return kwargs
        original_len = kwargs["input_ids"].shape[1] if kwargs.get("input_ids") is not None else None
        caller_mask = kwargs.get("attention_mask")
        kwargs, changed = self.prepare(kwargs)
        shrunk = (kwargs["input_ids"].shape[1], kwargs.get("attention_mask"))
        self._state.last_prompt = (original_len, caller_mask, *shrunk) if changed else None
        return kwargs

    def _continue_decoding(self, kwargs: dict) -> dict | None:
        """Map a manual decoding step after a pruned `model(...)` call onto the shrunk prompt.

        The caller's mask covers the original prompt (L columns) plus new tokens, the cache the shrunk prompt
        (L' columns) plus the same new tokens: swap the prompt part of the mask, and let `decode_positions` place
        the new tokens. Returns None when the call is not such a step.
        """
        cache, mask = hf.cache_in(kwargs), kwargs.get("attention_mask")
        last_prompt = self._state.last_prompt
        if last_prompt is None or cache is None or mask is None or mask.dim() != 2:
            return None
        original_len, caller_mask, new_len, prompt_mask = last_prompt
        new_ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        past = cache.get_seq_length()
        if new_ids is None or mask.shape[0] != (caller_mask.shape[0] if caller_mask is not None else mask.shape[0]):
            return None
        if mask.shape[1] != past + new_ids.shape[1] + original_len - new_len:
            return None
        batch = mask.shape[0]
        if prompt_mask is None:
            prompt_mask = torch.ones(batch, new_len, dtype=mask.dtype, device=mask.device)
        caller_mask = caller_mask if caller_mask is not None else torch.ones(batch, original_len, device=mask.device)
        lost = caller_mask.long().sum(1) - prompt_mask.long().sum(1)
        mask = torch.cat([prompt_mask.to(mask.dtype), mask[:, original_len:]], dim=1)
        positions = self.decode_positions(kwargs, mask, lost, past)
        return dict(kwargs, attention_mask=mask, position_ids=positions)

    @torch.no_grad()
    def _patched_generate(self, *args: Any, **kwargs: Any) -> Any:
        if "_generate_signature" not in self.__dict__:
            self._generate_signature = inspect.signature(self.stock_generate)
        bound = self._generate_signature.bind_partial(*args, **kwargs).arguments
        kwargs = {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}
        if isinstance(kwargs.get("inputs"), torch.Tensor) and kwargs.get("input_ids") is None:
            kwargs["input_ids"] = kwargs.pop("inputs")
        if self._llm_stages is not None:
            kwargs = self._llm_generate_kwargs(kwargs)
        state = self._state
        if not self.present(kwargs) or self.encoder_method is None:
            self.records, state.protected = [], None
            state.in_generate = True
            try:
                return self.stock_generate(**kwargs)
            finally:
                state.in_generate = False
        original_ids = kwargs.get("input_ids")
        max_length = self._max_length(kwargs)
        if max_length is not None and original_ids.shape[1] >= max_length:
            raise InputError(  # the stock check, with the caller's lengths (not the shrunk prompt's)
                f"Input length of input_ids is {original_ids.shape[1]}, but `max_length` is set to {max_length}. "
                "This can lead to unexpected behavior. You should consider increasing `max_length` or, better yet, "
                "setting `max_new_tokens`."
            )
        kwargs, changed = self.prepare(kwargs)
        if changed and max_length is not None:  # max_length counts the caller's prompt
            kwargs["max_length"] = max_length - (original_ids.shape[1] - kwargs["input_ids"].shape[1])
        state.in_generate = True
        try:
            out = self.stock_generate(**kwargs)
        finally:
            state.in_generate = False
        return _restore_prompt(out, original_ids, kwargs["input_ids"].shape[1]) if changed else out

    def _max_length(self, kwargs: dict[str, Any]) -> int | None:
        """The `max_length` set for this call (by it, its generation config or the model's), which stock generate
        counts the caller's prompt in; None when `max_new_tokens` is set or none is (20 new tokens by default)."""
        config = kwargs.get("generation_config") or self.model.generation_config
        if kwargs.get("max_new_tokens", config.max_new_tokens) is not None:
            return None
        length = kwargs.get("max_length", config.max_length)
        return length if length is not None else self.model.generation_config.max_length

    def _llm_generate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """generate kwargs with an LLM stage: static caches refused at the start; `use_cache=False` runs with the
        cache. The LLM stages decide once, from the prompt, and the decode stage is defined on the per-layer cache,
        so the cached run is what the call means (re-running the pruned prompt at every step would re-decide)."""
        config = kwargs.get("generation_config") or self.model.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        self._refuse_static_cache(implementation, hf.cache_in(kwargs))
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            kwargs = dict(kwargs, use_cache=True)
        return kwargs


def _restore_prompt(out: Any, original_ids: torch.Tensor, shrunk_length: int) -> Any:
    """Put the caller's own prompt back in front of the generated tokens."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    repeats = sequences.shape[0] // original_ids.shape[0]
    prompt = original_ids.to(sequences.device).repeat_interleave(repeats, dim=0)
    full = torch.cat([prompt, sequences[:, shrunk_length:]], dim=1)
    if isinstance(out, torch.Tensor):
        return full
    out.sequences = full
    return out
