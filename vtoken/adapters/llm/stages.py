"""`LanguageModelStages`: the hooks one method's LLM stages put on one model's language model, and the per-call
objects they hand the work to: a `PrefillRun` (`prefill.py`: drops, the KV cut) while a prefill runs, a
`DecodeStep` (`decode.py`) in a decoding step, and a decode-time selection's `Step` (`selection.py`).

Works on the decoder stack every supported family shares in transformers 5.x (`language_model.layers`, each layer
called with `attention_mask`, `position_embeddings` and `position_ids` as keywords, a `DynamicCache` with one
layer cache each): a pre-hook on the LLM starts a prefill or a decoding step; a pre-hook on every layer swaps in
the mask, positions and rotary tables (and, in a selecting step, the gathered cache) of what it runs on; a hook
after each drop layer hands the next layer the shorter hidden states; a hook after the LLM ends the prefill.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from vtoken.errors import VTokenError
from vtoken.methods.base import PrefillMethod

from .. import hf
from ..compiled import eager
from ..conversation import remember_views, views_of
from ..state import PerThread
from .decode import DecodeStep
from .prefill import PrefillRun
from .probe import QueryKeyProbe
from .selection import DecodeTimeSelection, Step


class LanguageModelCall:
    """What one thread's current call keeps for the LLM stages: the prefill running (`PrefillRun`), the decoding
    step (`DecodeStep`), a decode-time selection's step until layer L - 1 (`Step`), the prompt's length, and the
    prompt columns the last layers ran on (for a forward's labels)."""

    def __init__(self) -> None:
        self.prefill: PrefillRun | None = None
        self.decode: DecodeStep | None = None
        self.step: Step | None = None
        self.prompt_length = 0
        self.final_columns: torch.Tensor | None = None


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
        # transformers reads the cache length (and so the next position and mask size) from the first attention
        # layer's cache (layer 0 unless the LLM is hybrid): its cut masks tokens out, and it always holds the whole
        # prompt's length (`PrefillRun.finish`); recurrent layers have no such cache
        self.first_attention = min((i for i in range(len(self.layers)) if i not in self.recurrent), default=0)
        self.cut_layers = [i for i in method.cut_layers(self.drop_layers) if i not in self.recurrent]
        self.renumber = method.positions == "renumber"
        # a one-token decoding step's mask of a layer group is the first step's over its prompt slots, then the
        # LLM's own over the tokens since (`DecodeStep`): where every layer attends to all it caches (no sliding
        # window, no recurrent state)
        self.full_attention = not self.recurrent and all(kind == "full_attention" for kind in self.layer_types)
        self.full_attention &= getattr(self.lm.config, "sliding_window", None) is None
        self._rotary_tables: dict[tuple, tuple] = {}  # (device, dtype) -> (cos, sin); () where there is none
        select_layer = method.select_layer(len(self.layers))  # decode-time selection (None: none)
        self.selection = None if select_layer is None else DecodeTimeSelection(self, select_layer)
        self.probes: dict[int, QueryKeyProbe] = {}
        self.row_probe: QueryKeyProbe | None = None
        self.call_probes: dict[int, QueryKeyProbe] = {}  # mid-layer call points: the layer before each call
        # per call, one per thread (hooks run in the thread that called the model); what each layer's cache holds
        # is left on the cache itself (`remember_views`)
        self._calls = PerThread(LanguageModelCall)

    def rotary_table(self, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([P, d] cos, [P, d] sin) of positions 0..P-1, P >= `length`, in x's dtype on x's device, made by the LLM's
        own rotary module (its row for position p is what it makes for p alone); None for a rotary whose tables are
        not a fixed function of the position (`hf.position_rotary`). Made once and doubled when a longer one is
        asked for, per device and dtype: a decoding step then gathers its rows instead of calling the rotary."""
        rotary = getattr(self.lm, "rotary_emb", None)
        if rotary is None or not hf.position_rotary(rotary):
            return None
        key = (x.device, x.dtype)
        table = self._rotary_tables.get(key)
        if table == ():  # its tables are not [positions, d] rows
            return None
        if table is None or table[0].shape[0] < length:
            size = max(4096, 1 << max(length - 1, 1).bit_length())
            cos, sin = rotary(x, position_ids=torch.arange(size, device=x.device)[None])
            if cos.shape != (1, size, cos.shape[-1]) or sin.shape != cos.shape:
                self._rotary_tables[key] = ()
                return None
            table = self._rotary_tables[key] = cos[0], sin[0]  # one assignment: other threads see old or new
        return table

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deep copy, pickle) makes its own rotary tables."""
        return dict(self.__dict__, _rotary_tables={})

    @property
    def call(self) -> LanguageModelCall:
        """The calling thread's current call."""
        return self._calls.get()

    @property
    def beams(self) -> bool:
        """The calling thread's call is a beam search (a decode-time selection follows the reordered rows)."""
        return self.adapter.calls.state.beams

    def final_columns(self) -> torch.Tensor | None:
        """[B, C] the prompt column of every slot the last decoder layers ran on in this thread's last prefill."""
        return self.call.final_columns

    @property
    def follows_frames(self) -> bool:
        """The method's call points follow the prompt's video frames (the call path notes the call's frames)."""
        return "mid_layer" in self.method.calls

    # ----------------------------------------------------------------- install / remove
    def check_call_points(self) -> None:
        """A method with mid-layer call points needs every layer before the last to split at its residual (a
        pre-norm decoder layer transformers' way, `hf.PRE_NORM_LAYERS`), softmax attention there (the attention
        before a call is read), and no encoder-stage method changing which tokens a video's frames hold."""
        name = self.method.name
        if self.recurrent:
            raise VTokenError(
                f"{name} acts after every LLM layer's attention and reads it; this LLM's layers "
                f"{sorted(self.recurrent)} are linear attention (a recurrent state, not softmax attention), which "
                "it cannot act on (hybrid LLMs such as Qwen3.5 are not supported)"
            )
        for index, layer in enumerate(self.layers[:-1]):
            if not hf.splits_at_residual(layer):
                raise VTokenError(
                    f"{name} acts inside each decoder layer (after its attention, before its MLP), which vtoken "
                    f"does for the pre-norm layers it knows ({', '.join(sorted(hf.PRE_NORM_LAYERS))}); layer {index} "
                    f"is a {type(layer).__name__}"
                )
            if "forward" in layer.__dict__:
                raise VTokenError(
                    f"{name} splits decoder layer {index}'s forward, which already has an instance-level forward "
                    "(a device map's offloading hooks?); load the model on one device to use it"
                )
            QueryKeyProbe.check(getattr(layer, "self_attn", None), f"{type(layer).__name__} {index}")
        videos = [m.name for m in self.adapter.methods if "encoder" in m.stages and "video" in m.modalities]
        if videos:
            raise VTokenError(
                f"{name} merges the tokens at one place of consecutive frames inside the LLM; the encoder-stage "
                f"method {videos[0]} changes which tokens a video's frames hold before it: combine {name} with an "
                "image-only encoder-stage method, or use one of them"
            )

    def check(self) -> None:
        """Refuse a model this method's stages cannot act on (layer types, call points, the layers it reads),
        registering nothing: `vtoken.check` and `applicable_methods` say what `patch` would."""
        unknown = sorted(set(self.layer_types) - {"full_attention", "linear_attention"}) if self.recurrent else []
        if unknown:
            raise VTokenError(f"{self.method.name}: hybrid LLM with layer types {unknown} is not supported")
        if self.follows_frames:
            self.check_call_points()
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

    def install(self, hooks) -> None:
        """Register the hooks through the model's `HookOwner` (it removes them); `check` ran when the adapter was
        made."""
        select = None if self.selection is None else self.selection.layer
        hooks.on_remove(self.remove_probes)
        if select is not None:  # the new token's row, after layer L - 1 ran
            self.row_probe = QueryKeyProbe(self.layers[select - 1].self_attn)
            hooks.after_forward(self.layers[select - 1], self._select_step)
        hooks.before_forward(self.lm, self._before_lm)
        hooks.after_forward(self.lm, self._after_lm)
        for index, layer in enumerate(self.layers):
            hooks.before_forward(layer, functools.partial(self._layer_input, index))
        if self.follows_frames:  # call point c inside layer c - 1, after its attention; its attention read then
            for index, layer in enumerate(self.layers[:-1]):
                self.call_probes[index] = QueryKeyProbe(layer.self_attn)
                hooks.replace_forward(layer, SplitLayer(self, index))
        for index in self.drop_layers:
            scored = self._scored_layer(index)
            if scored is not None:  # the next layer is scored before it runs: replayed, not captured
                self.probes[index] = QueryKeyProbe(self.layers[scored].self_attn, capture=scored == index)
            hooks.after_forward(self.layers[index], functools.partial(self._layer_output, index))

    def _scored_layer(self, drop: int) -> int | None:
        """The layer whose queries/keys the method reads at drop point `drop` (None: none)."""
        scored = dict(zip(self.drop_layers, self.method.scored_layers(len(self.layers)), strict=False))
        return scored.get(drop)

    def remove_probes(self) -> None:
        for probe in [*self.probes.values(), *self.call_probes.values()]:
            probe.remove()
        if self.row_probe is not None:
            self.row_probe.remove()
        self.probes, self.row_probe, self.call_probes = {}, None, {}

    def prefill_columns(self) -> torch.Tensor | None:
        """[B, C] prompt column of every slot of the sequence the decoder layers run on now (-1 = padding slot),
        during a prefill; None outside one. For model code that indexes the prompt after layers (DeepStack)."""
        run = self.call.prefill
        return None if run is None else run.view.column

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
            run = None if visual is None else PrefillRun.start(self, embeds, kwargs, visual, cache)
            if run is not None:
                call.prompt_length = embeds.shape[1]
                call.prefill = run
                for probe in self.probes.values():
                    probe.active = True
            return
        held = views_of(cache)  # what each layer's cache holds, left there by the prefill that filled it
        if held is not None:
            step = call.decode = DecodeStep.start(self, embeds, kwargs, cache, past, *held)
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
        if call.prefill is not None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            overrides, moved = call.prefill.enter_layer(kwargs, hidden if index == 0 else None)
            if moved is not hidden and moved is not None:  # call point 0 changed the LLM's input
                if args:
                    args = (moved, *args[1:])
                else:
                    kwargs = dict(kwargs, hidden_states=moved)
                if overrides is None:
                    return args, kwargs
        elif call.decode is not None:
            overrides = call.decode.overrides(index, kwargs.get("attention_mask"), kwargs.get("position_ids"))
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
    def call_point(self, point: int, hidden: torch.Tensor) -> torch.Tensor:
        """Call point `point` >= 1, inside layer point - 1 after its attention: the hidden states its MLP runs on."""
        run = self.call.prefill
        return hidden if run is None else run.call_point(point, hidden)

    @eager
    def _layer_output(self, index: int, module, args, output):
        """Hook after drop layer `index`: the hidden states of the kept tokens."""
        if self.call.prefill is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = self.call.prefill.drop(index, hidden)
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
        run = call.prefill
        if run is None:
            return
        call.prefill = None
        for probe in self.probes.values():
            probe.active = False
        # the LLM makes its own cache when called with use_cache and none given: take the one it returns
        records, views = run.finish(hf.cache_out(output), call.prompt_length)
        remember_views(run.cache, (views, call.prompt_length))
        self.adapter.add_records(records)
        call.final_columns = run.view.column


class SplitLayer:
    """Decoder layer `index`'s forward on this model instance while a method with mid-layer call points is patched:
    the layer's own attention half, call point index + 1, its own MLP half (`hf.split_attention`, `hf.split_mlp`;
    the halves equal the stock forward, a contract test checks it). A small class, not a closure: a patched model
    deep-copies (the copy's forward is bound to the copy's stages) and pickles."""

    def __init__(self, stages: LanguageModelStages, index: int):
        self.stages = stages
        self.index = index
        layer = stages.layers[index]
        names = list(inspect.signature(type(layer).forward).parameters)[1:]  # after `self`
        self._positional = names[1:]  # the arguments after hidden_states, should a caller pass them by position

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            kwargs = dict(zip(self._positional, args, strict=False), **kwargs)
        layer = self.stages.layers[self.index]
        hidden = hf.split_attention(layer, hidden_states, **kwargs)
        hidden = self.stages.call_point(self.index + 1, hidden)
        return hf.split_mlp(layer, hidden)
