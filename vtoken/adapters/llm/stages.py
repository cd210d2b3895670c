"""`LanguageModelStages`: the hooks one method's LLM stages put on one model's language model, and where each
call's work goes (`prefill.py` for drops, `decode.py` for the cut and decoding steps, `selection.py` for a
decode-time selection).

Works on the decoder stack every supported family shares in transformers 5.x (`language_model.layers`, each layer
called with `attention_mask`, `position_embeddings` and `position_ids` as keywords, a `DynamicCache` with one
layer cache each): a pre-hook on the LLM starts a prefill or a decoding step; a pre-hook on every layer swaps in
the mask, positions and rotary tables (and, in a selecting step, the gathered cache) of what it runs on; a hook
after each drop layer hands the next layer the shorter hidden states; a hook after the LLM ends the prefill.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from vtoken.errors import VTokenError
from vtoken.methods.base import PrefillMethod

from .. import hf
from ..compiled import eager
from ..conversation import remember_views, views_of
from . import decode, prefill
from .probe import QueryKeyProbe
from .selection import DecodeTimeSelection


class LanguageModelStages:
    """Prefill drops and the decode-stage cache policy of one method, on one model's language model."""

    def __init__(self, adapter, method: PrefillMethod):
        self.adapter = adapter
        self.method = method
        self.lm = adapter.language_model
        self.layers = self.lm.layers
        self.drop_layers = method.drop_layers(len(self.layers))
        # hybrid LLMs (Qwen3.5): per-layer types, linear-attention layers holding a recurrent state, not keys
        self.layer_types = list(getattr(self.lm.config, "layer_types", None) or [])
        self.recurrent = {i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"}
        # the first attention layer's cache is never cut: transformers reads the cache length (and so the next
        # position and mask size) from it (layer 0 unless the LLM is hybrid); recurrent layers have no such cache
        first = min((i for i in range(len(self.layers)) if i not in self.recurrent), default=0)
        self.cut_layers = [i for i in method.cut_layers(self.drop_layers) if i > first and i not in self.recurrent]
        self.renumber = method.positions == "renumber"
        select_layer = method.select_layer(len(self.layers))  # decode-time selection (None: none)
        self.selection = None if select_layer is None else DecodeTimeSelection(self, select_layer)
        self._hooks: list = []
        self.probes: dict[int, QueryKeyProbe] = {}
        self.row_probe: QueryKeyProbe | None = None
        # per call, in the adapter's per-thread `CallState`: `prefill` (a `PrefillState` while one runs), `decode`
        # (a `DecodeStep` in a decoding step), `step` (a selecting step until layer L - 1), `prompt_length`,
        # `final_columns`. What each layer's cache holds is left on the cache itself (`remember_views`)

    @property
    def call(self):
        """The calling thread's call state (hooks run in the thread that called the model)."""
        return self.adapter._state

    # ----------------------------------------------------------------- install / remove
    def install(self) -> None:
        unknown = sorted(set(self.layer_types) - {"full_attention", "linear_attention"}) if self.recurrent else []
        if unknown:
            raise VTokenError(f"{self.method.name}: hybrid LLM with layer types {unknown} is not supported")
        if "normed" in self.method.reads and not isinstance(getattr(self.lm, "norm", None), nn.Module):
            raise VTokenError(f"{self.method.name}: {type(self.lm).__name__} has no final `norm` to read")
        for index in self.drop_layers:  # every drop layer is checked before anything is registered
            scored = self._scored_layer(index)
            if scored is not None:
                layer = self.layers[scored]
                QueryKeyProbe.check(getattr(layer, "self_attn", None), f"{type(layer).__name__} {scored}")
                if scored != index and not isinstance(getattr(layer, "input_layernorm", None), nn.Module):
                    raise VTokenError(f"{self.method.name}: {type(layer).__name__} {scored} has no input_layernorm")
        select = None if self.selection is None else self.selection.layer
        if select is not None:
            read = self.layers[select - 1]
            QueryKeyProbe.check(getattr(read, "self_attn", None), f"{type(read).__name__} {select - 1}")
        try:
            if select is not None:  # the new token's row, after layer L - 1 ran
                self.row_probe = QueryKeyProbe(self.layers[select - 1].self_attn)
                self._hooks.append(self.layers[select - 1].register_forward_hook(self._select_step))
            self._hooks.append(self.lm.register_forward_pre_hook(self._before_lm, with_kwargs=True))
            self._hooks.append(self.lm.register_forward_hook(self._after_lm))
            for index, layer in enumerate(self.layers):
                hook = functools.partial(self._layer_input, index)
                self._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            for index in self.drop_layers:
                scored = self._scored_layer(index)
                if scored is not None:  # the next layer is scored before it runs: replayed, not captured
                    self.probes[index] = QueryKeyProbe(self.layers[scored].self_attn, capture=scored == index)
                hook = functools.partial(self._layer_output, index)
                self._hooks.append(self.layers[index].register_forward_hook(hook))
        except BaseException:
            self.remove()
            raise

    def _scored_layer(self, drop: int) -> int | None:
        """The layer whose queries/keys the method reads at drop point `drop` (None: none)."""
        scored = dict(zip(self.drop_layers, self.method.scored_layers(len(self.layers)), strict=False))
        return scored.get(drop)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for probe in self.probes.values():
            probe.remove()
        if self.row_probe is not None:
            self.row_probe.remove()
        self._hooks, self.probes, self.row_probe = [], {}, None

    def prefill_columns(self) -> torch.Tensor | None:
        """[B, C] prompt column of every slot of the sequence the decoder layers run on now (-1 = padding slot),
        during a prefill; None outside one. For model code that indexes the prompt after layers (DeepStack)."""
        state = self.call.prefill
        return None if state is None else state.view.column

    def new_call(self, cache: Any) -> list:
        """A `generate` call continuing from `cache` (a decode-time selection starts afresh): its new records."""
        return [] if self.selection is None else self.selection.new_call(cache)

    # ----------------------------------------------------------------- the LLM call
    @eager
    def _before_lm(self, module, args, kwargs) -> None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None and kwargs.get("input_ids") is not None:
            embeds = self.lm.embed_tokens(kwargs["input_ids"])  # its shape, dtype and device are read
        cache = hf.cache_in(kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        call = self.call
        call.prefill, call.decode, call.step = None, None, None
        if self.row_probe is not None:
            self.row_probe.active = False
        if embeds is None:
            return
        if past == 0:
            call.final_columns = None
            remember_views(cache, None)
            visual = self.adapter.visual_mask_for(tuple(embeds.shape[:2]))
            state = None if visual is None else prefill.start(self, embeds, kwargs, visual, cache)
            if state is not None:
                call.prompt_length = embeds.shape[1]
                call.prefill = state
                for probe in self.probes.values():
                    probe.active = True
            return
        held = views_of(cache)  # what each layer's cache holds, left there by the prefill that filled it
        if held is not None:
            step = call.decode = decode.start_step(self, embeds, kwargs, cache, past, *held)
            if self.selection is not None:
                self.selection.start_step(embeds, step.mask, step.positions, cache)

    def mask(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: Any, layer: int):
        """The causal + padding mask of the layers from `layer` on, in their attention implementation's format
        (`mask` None: no padding anywhere, which transformers turns into no mask at all for SDPA/flash); for a
        hybrid LLM a dict by layer type (linear-attention layers take the 2-D padding mask, or None). No sync."""
        attention = next((i for i in range(layer, len(self.layers)) if i not in self.recurrent), layer)
        if mask is None:  # positions only matter to transformers for packed sequences, which this is not
            causal = hf.causal_mask(self.lm.config, hidden, None, cache, None, attention)
        else:
            position_ids = positions if positions.dim() == 2 else positions[0]
            causal = hf.causal_mask(self.lm.config, hidden, mask, cache, position_ids, attention, False)
        if not self.recurrent:
            return causal
        recurrent = hf.recurrent_mask(self.lm.config, hidden, mask, cache)
        return {"linear_attention": recurrent, "full_attention": causal}

    @eager
    def _layer_input(self, index: int, module, args, kwargs):
        """Pre-hook of decoder layer `index`: the mask, positions and rotary tables of the sequence it runs on."""
        call = self.call
        state = call.prefill
        if state is not None:
            if state.rotary is None:  # the first layer sees the prompt's own tables (and the LLM's own cache)
                state.rotary, state.position_ids = kwargs.get("position_embeddings"), kwargs.get("position_ids")
                state.cache = state.cache if state.cache is not None else hf.cache_in(kwargs)
            state.views.append(state.view)
            overrides = state.overrides
        elif call.decode is not None:
            step = call.decode
            overrides = step.selected.get(index) or decode.step_overrides(
                self, step, index, kwargs.get("attention_mask")
            )
        else:
            return None
        if overrides is None:
            return None
        mask = overrides.attention_mask
        kwargs = dict(kwargs, attention_mask=mask[self.layer_types[index]] if isinstance(mask, dict) else mask)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = overrides.position_ids
        if overrides.position_embeddings is not None:
            kwargs["position_embeddings"] = overrides.position_embeddings
        if overrides.cache is not None:
            key = hf.CACHE_KWARG if hf.CACHE_KWARG in kwargs else "past_key_values"
            kwargs[key] = overrides.cache
        return args, kwargs

    @eager
    def _layer_output(self, index: int, module, args, output):
        """Hook after drop layer `index`: the hidden states of the kept tokens."""
        if self.call.prefill is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = prefill.drop(self, index, hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    @eager
    def _select_step(self, module, args, output) -> None:
        """Hook after layer L - 1 in a decoding step: the new token's row decides what later layers read."""
        call = self.call
        step, call.step = call.step, None
        if step is not None:
            self.selection.select(step)

    @eager
    def _after_lm(self, module, args, output) -> None:
        call = self.call
        state = call.prefill
        if state is None:
            return
        call.prefill = None
        for probe in self.probes.values():
            probe.active = False
        # the LLM makes its own cache when called with use_cache and none given: take the one it returns
        cache = hf.cache_out(output)
        state.cache = cache if cache is not None else state.cache
        records = decode.finish(self, state, call.prompt_length)
        self.adapter.add_records(records)
        call.final_columns = state.view.column
