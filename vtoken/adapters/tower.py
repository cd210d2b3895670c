"""The tower stage on transformers models, model side: what a tower method (`vtoken.methods.base.TowerMethod`)
needs from a vision tower, and applying what it decides.

- `tower_shape(model, family)`: the `TowerShape` a method reads (grid, [CLS], feature block, patch and merge
  sizes, the pixels' normalisation from `pixel_normalisation`).
- ToMe (`acts = "layers"`): `ToMeTower` replaces the forward of every block of one CLIP or SigLIP tower *instance*
  (never the class) with attention -> merge -> MLP; `remove` restores the instance exactly.
- PixelPrune (`acts = "input"`): `qwen_pruned_tower` runs a Qwen-VL tower on the kept merge groups only (pixel
  rows gathered before `patch_embed`, the original rotary / position-embedding taps of the kept patches,
  per-image `cu_seqlens`, Qwen2.5-VL's windows restricted to the kept groups; DeepStack mergers see the pruned
  states); `KeptPatches` runs a CLIP/SigLIP tower on [CLS] and the kept patches (rows dropped after the
  embeddings, each patch keeping its position embedding; crops padded to the longest with a key mask).

Contact with transformers' internals goes through `hf.py`: the keyword arguments through which a Qwen-VL tower's
forward takes precomputed tables (`hf.qwen_vision_forward`), a CLIP / SigLIP block's submodules
(`hf.vision_block_missing`, `hf.key_projection`, `hf.vision_block_attention`), the encoder's `inputs_embeds` /
`attention_mask` arguments (`hf.encoder_embeddings`, `hf.encoder_call`), a checkpoint's image processor
(`hf.local_image_processor`).

`TowerSite` and `TowerPlan` are where the engine meets these: the adapter holds a `TowerSite` (what `patch`
installs) and each call's `TowerPlan` (made before the prompt is shrunk and the tower runs).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from vtoken.errors import InputError, VTokenError
from vtoken.geometry import tower as tables
from vtoken.geometry.llava import encoder_layer
from vtoken.methods.base import TowerShape
from vtoken.methods.pixelprune import Selected, to_device
from vtoken.methods.tome import MergeState, ToMe
from vtoken.question import image_processor_of, processor_for
from vtoken.records import LazyRecords, Record
from vtoken.timing import Stopwatch

from . import hf

OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
# (mean, std) of every family's published checkpoints' image processors: the last fallback. (transformers'
# processor classes default to CLIP's for Qwen3-VL and OneVision, whose checkpoints say 0.5: not used)
FAMILY_NORMALISATION = {
    "llava-1.5": OPENAI_CLIP,
    "llava-next": OPENAI_CLIP,
    "llava-next-video": OPENAI_CLIP,
    "video-llava": OPENAI_CLIP,
    "llava-onevision": HALF,
    "qwen2-vl": OPENAI_CLIP,
    "qwen2.5-vl": OPENAI_CLIP,
    "qwen3-vl": HALF,
    "qwen3.5": HALF,
}
QWEN_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")
# attention implementations that take an additive bias on the logits (ToMe's proportional attention, padding)
BIASED_ATTENTION = ("sdpa", "eager")


# ----------------------------------------------------------------- what a tower method reads of the model
def _per_channel(value: Any, channels: int) -> tuple[float, ...]:
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * channels
    if len(values) != channels:
        raise VTokenError(f"an image normalisation of {len(values)} values for {channels} channels: {value!r}")
    return tuple(values)


def pixel_normalisation(model: nn.Module, family: str, channels: int = 3) -> tuple[tuple[float, ...], ...]:
    """(mean, std, where): the per-channel normalisation `model`'s pixels were made with, from (in this order) the
    processor given to `vtoken.remember_tokenizer` (`vtoken.zoo.load` gives it), the checkpoint's preprocessor
    config (a local directory or the local cache: never the network), or the family's published defaults."""
    processor = image_processor_of(processor_for(model))
    if processor is not None:
        mean, std = processor.image_mean, processor.image_std
        return _per_channel(mean, channels), _per_channel(std, channels), "the remembered processor"
    source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if source:
        loaded = image_processor_of(hf.local_image_processor(source))
        if loaded is not None:
            mean, std = loaded.image_mean, loaded.image_std
            return _per_channel(mean, channels), _per_channel(std, channels), f"{source}'s preprocessor config"
    if family in FAMILY_NORMALISATION:
        mean, std = FAMILY_NORMALISATION[family]
        return mean, std, f"{family}'s published processor defaults"
    raise VTokenError(
        f"the image normalisation (image_mean, image_std) of {type(model).__name__} is unknown: call "
        "vtoken.remember_tokenizer(model, processor) with the processor that makes its pixels"
    )


def tower_shape(model: nn.Module, family: str) -> TowerShape:
    """The `TowerShape` of `model`'s image tower (`family`: the adapter's). LLaVA families: the feature block F is
    the tower block whose output `vision_feature_layer` reads (a list of layers is refused: tokens merged inside
    the tower differ from layer to layer)."""
    config = model.config
    vision = config.vision_config
    mean, std, _ = pixel_normalisation(
        model, family, getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
    )
    if family in QWEN_FAMILIES:
        return TowerShape(family, cls=False, feature_block=vision.depth - 1, merge=vision.spatial_merge_size,
                          patch=vision.patch_size, temporal=vision.temporal_patch_size, channels=vision.in_channels,
                          mean=mean, std=std)  # fmt: skip
    layer = getattr(config, "vision_feature_layer", -1)
    if isinstance(layer, (list, tuple)):
        if len(layer) != 1:
            raise VTokenError(
                f"a tower method needs one feature layer; {type(model).__name__} concatenates the tower's layers "
                f"{list(layer)}, whose tokens would differ (vision_feature_layer must be one int)"
            )
        layer = layer[0]
    depth = vision.num_hidden_layers
    block = encoder_layer(layer, depth)
    return TowerShape(family, cls="clip" in vision.model_type, feature_block=-1 if block is None else block, merge=1,
                      patch=vision.patch_size, temporal=1, channels=getattr(vision, "num_channels", 3), mean=mean,
                      std=std)  # fmt: skip


# ----------------------------------------------------------------- ToMe inside CLIP / SigLIP blocks
_CALLS = threading.local()  # per thread: ToMeTower id -> the MergeState of its running (or last) call


class _KeyCatcher:
    """A forward hook on a merging block's `k_proj`: hands its output (the block's keys, [C, T, heads * d]) to the
    block's forward while it runs (no second key projection)."""

    def __init__(self, owner: ToMeTower, block: int) -> None:
        self.owner, self.block = owner, block

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        slots = getattr(_CALLS, "keys", None)
        if slots is not None and slots.get(id(self.owner)) == self.block:
            _CALLS.caught = output


class _MergingBlock:
    """The forward of one tower block under ToMe (set on the block instance; a bound method, so that a patched
    model deep-copies and pickles)."""

    def __init__(self, owner: ToMeTower, block: int) -> None:
        self.owner, self.block = owner, block

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        owner, block = self.owner, self.block
        layer, method = owner.layers[block], owner.method
        if block == 0:  # a new tower call: its merge state starts with block 0's input
            owner.set_state(method.start(hidden_states, owner.tower))
        state = owner.state()
        residual = hidden_states
        normed = hf.vision_block_norm(layer, hidden_states)
        mask = attention_mask
        bias = state.attention_bias(normed.dtype) if state is not None and method.prop_attn else None
        if bias is not None:
            mask = bias if mask is None else mask + bias
        merging = state is not None and block < len(state.schedule) and state.schedule[block] > 0
        if merging:
            _CALLS.keys = {**getattr(_CALLS, "keys", {}), id(owner): block}
            _CALLS.caught = None
        try:
            attended = hf.vision_block_attention(layer, normed, mask, **kwargs)
        finally:
            keys = getattr(_CALLS, "caught", None) if merging else None
            if merging:
                _CALLS.keys.pop(id(owner), None)
                _CALLS.caught = None
        hidden_states = residual + attended
        if state is not None:
            clock = _clocks().get(id(owner))
            watch = clock.start(hidden_states.device) if clock is not None else None
            hidden_states = method.merge_block(hidden_states, keys, owner.heads, block, state)
            if watch is not None:
                watch.stop()
        residual = hidden_states
        hidden_states = hf.vision_block_mlp(layer, hidden_states)
        return residual + hidden_states


class ToMeTower:
    """ToMe in one CLIP or SigLIP tower (its `encoder.layers`): every block's forward replaced on the instance
    (attention, then the method's merge, then the MLP: a hook after the block would not do, the MLP is
    nonlinear), a hook on each merging block's `k_proj` for its keys. Per call and thread, block 0 starts a
    `MergeState`; after the tower ran, `last()` is that call's state (the merges per block, every patch's
    output token, the sizes) for the records. `tower.feature_block` is the last merging block."""

    def __init__(self, method: ToMe, layers: nn.ModuleList, tower: TowerShape, attention: str) -> None:
        for index, layer in enumerate(layers):
            missing = hf.vision_block_missing(layer)
            if missing:
                raise VTokenError(
                    f"tome: block {index} of the tower ({type(layer).__name__}) lacks {missing}; it merges in CLIP "
                    "and SigLIP blocks (layer_norm1, self_attn with k_proj, layer_norm2, mlp)"
                )
        if method.prop_attn and attention not in BIASED_ATTENTION:
            raise VTokenError(
                f"tome: prop_attn=True adds log(size) to the tower's attention logits, which the {attention!r} "
                f"attention cannot take; load the vision tower with attn_implementation 'sdpa' or 'eager', or use "
                "prop_attn=False (LightCompress's variant)"
            )
        if tower.merging_layers < 1 or tower.merging_layers > len(layers):
            raise VTokenError(
                f"tome: the feature layer is the output of block {tower.feature_block} of a {len(layers)}-block "
                "tower; it needs a block to merge in, at or before the feature layer"
            )
        self.method, self.layers, self.tower = method, layers, tower
        self.heads = hf.attention_heads(layers[0])
        self.installed = False

    def install(self) -> None:
        """Replace the blocks' forwards (on these instances) and hook the merging blocks' key projections."""
        taken = [i for i, layer in enumerate(self.layers) if "forward" in layer.__dict__]
        if taken:
            raise VTokenError(f"tome: tower blocks {taken} already have a forward of their own (another patch)")
        for block, layer in enumerate(self.layers):
            layer.forward = _MergingBlock(self, block).forward
            if block < self.tower.merging_layers:
                hf.key_projection(layer).register_forward_hook(_KeyCatcher(self, block))
        self.installed = True

    def remove(self) -> None:
        """Put every block back exactly as it was: its class's forward, no hooks of this object's."""
        for layer in self.layers:
            forward = layer.__dict__.get("forward")
            if forward is not None and getattr(forward, "__self__", None) is not None:
                if getattr(forward.__self__, "owner", None) is self:
                    del layer.__dict__["forward"]
            hooks = hf.forward_hooks(hf.key_projection(layer))  # by identity: handles would not follow a deep copy
            for key in [k for k, hook in hooks.items() if isinstance(hook, _KeyCatcher) and hook.owner is self]:
                del hooks[key]
        _calls().pop(id(self), None)
        self.installed = False

    def set_state(self, state: MergeState) -> None:
        _calls()[id(self)] = state

    def time_merges(self, clock: Intervals | None) -> None:
        """Time this thread's merges (each block's, the attention and MLP left out) into `clock`; None: stop."""
        if clock is None:
            _clocks().pop(id(self), None)
        else:
            _clocks()[id(self)] = clock

    def state(self) -> MergeState | None:
        return _calls().get(id(self))

    def last(self) -> MergeState | None:
        """The merge state of this thread's last tower call: `done` (r' per merging block), `patch_sources()` ([C, N]
        every patch's output token), `sizes` ([C, 1 + N'] or [C, N'] with [CLS]; None when not tracked)."""
        return self.state()


def _calls() -> dict[int, MergeState]:
    if not hasattr(_CALLS, "states"):
        _CALLS.states = {}
    return _CALLS.states


def _clocks() -> dict[int, Intervals]:
    if not hasattr(_CALLS, "clocks"):
        _CALLS.clocks = {}
    return _CALLS.clocks


class Intervals:
    """Several timed intervals on one device read as their total, `seconds` (ToMe's merges, one per block): a
    `Stopwatch` each, so nothing waits for the device until the total is read."""

    def __init__(self) -> None:
        self.watches: list[Stopwatch] = []

    def start(self, device: torch.device) -> Stopwatch:
        watch = Stopwatch(device).start()
        self.watches.append(watch)
        return watch

    @property
    def seconds(self) -> float:
        return sum(watch.seconds for watch in self.watches)


# ----------------------------------------------------------------- PixelPrune on Qwen-VL towers
def qwen_tables(visual: nn.Module, grids: list[tuple[int, int, int]], selected: Selected,
                device: torch.device | str) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments that make a Qwen-VL tower's forward (5.19-5.24: `vision_utils.get_vision_*` take
    precomputed tables from its kwargs) run on the kept groups' rows: rotary positions, per-image `cu_seqlens`,
    Qwen3-VL's position-embedding taps, Qwen2.5-VL's windows. Host tables, copied without a sync."""
    merge = visual.spatial_merge_size
    kept = selected.kept
    cumulative, longest = tables.cu_seqlens(selected.counts, merge)
    out: dict[str, Any] = {
        "position_ids": to_device(tables.rotary_positions(kept, grids, merge), device),
        "cu_seqlens": to_device(cumulative, device),
        "max_seqlen": longest,
    }
    if hf.has_learned_position_embedding(visual):  # Qwen3-VL, Qwen3.5: a learned, interpolated position embedding
        indices, weights = tables.interpolation(kept, grids, merge, visual.num_grid_per_side)
        out["interp_indices"] = to_device(indices, device)
        out["interp_weights"] = to_device(weights, device)
    if hf.has_window_attention(visual):  # Qwen2.5-VL's windows
        order, windows, widest = tables.windows(kept, grids, merge, visual.window_size, visual.patch_size)
        out.update(window_index=to_device(order, device), cu_window_seqlens=to_device(windows, device),
                   max_window_seqlen=widest)  # fmt: skip
    return out


def qwen_pruned_tower(
    visual: nn.Module, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]], selected: Selected, **kwargs: Any
) -> Any:
    """Run a Qwen-VL tower (`model.model.visual`) on the kept groups of `selected` only: pixel_values [S, D] as the
    processor made them for images of `grids` ((1, h, w) patches each, host ints). Returns the tower's output:
    `pooler_output` [sum of kept, D'] every image's kept groups' merged features, image after image, ascending;
    `last_hidden_state` [4 * kept, d] (Qwen2.5-VL: in window order); Qwen3-VL's `deepstack_features`, per level
    [sum of kept, D'] (computed from the pruned states)."""
    if pixel_values.dim() != 2:
        raise InputError(f"pixel_values of shape {tuple(pixel_values.shape)}; a Qwen-VL tower takes [patches, values]")
    device = pixel_values.device
    rows = to_device(tables.kept_rows(selected.kept, visual.spatial_merge_size), device)
    pixels = pixel_values[rows].type(visual.dtype)
    grid_thw = to_device(np.asarray(grids, dtype=np.int64).reshape(-1, 3), device)
    return hf.qwen_vision_forward(visual, pixels, grid_thw, **qwen_tables(visual, grids, selected, device), **kwargs)


# ----------------------------------------------------------------- PixelPrune on CLIP / SigLIP towers
class KeptPatches:
    """While active (a context manager, for the calling thread only), a CLIP or SigLIP tower's encoder gets, per
    crop, [CLS] (CLIP) and its kept patches' rows of the embeddings (each patch with its own position embedding),
    padded to the longest crop; later blocks see a key mask for the padding (SDPA / eager). After the tower ran,
    the feature layer's states [C, p + K, D] hold [CLS] then the kept patches in ascending order; `valid` [C, K]
    says which are real and `kept` [C, K] which patch each is (padded with N)."""

    def __init__(self, encoder: nn.Module, selected: Selected, cls: bool, attention: str, device: torch.device | str):
        self.encoder, self.cls = encoder, cls
        counts, grids = selected.counts, selected.grids
        self.width = max(counts, default=0)
        patches = grids[0][0] * grids[0][1] if grids else 0
        kept = np.full((len(counts), self.width), patches, dtype=np.int64)
        crop = np.repeat(np.arange(len(counts)), counts)  # every kept unit's crop (crops alike: patches units each)
        slot = np.arange(len(selected.kept)) - np.repeat(np.cumsum([0, *counts[:-1]]), counts)
        kept[crop, slot] = selected.kept - crop * patches
        self.kept = to_device(kept, device)
        self.valid = self.kept < patches
        p = int(cls)
        index = np.concatenate([np.zeros((len(counts), p), dtype=np.int64), np.minimum(kept, patches - 1) + p], 1)
        self.index = to_device(index, device)
        self.ragged = len(set(counts)) > 1
        if self.ragged and attention not in BIASED_ATTENTION:
            raise VTokenError(
                f"pixelprune: crops keep different numbers of patches, padded with a key mask, which the "
                f"{attention!r} attention of this tower cannot take; load the vision tower with 'sdpa' or 'eager'"
            )
        self._hook = None
        self._thread = None

    def _gather(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if threading.get_ident() != self._thread:
            return None
        embeds, args, kwargs = hf.encoder_embeddings(args, kwargs)
        rows = embeds.gather(1, self.index[:, :, None].expand(-1, -1, embeds.shape[-1]))
        mask = None
        if self.ragged:
            keys = torch.cat([torch.ones_like(self.valid[:, : int(self.cls)]), self.valid], dim=1)
            blocked = torch.zeros(keys.shape, dtype=embeds.dtype, device=embeds.device)
            blocked = blocked.masked_fill(~keys, torch.finfo(embeds.dtype).min)[:, None, None, :]
            mask = blocked.expand(-1, 1, keys.shape[1], -1)
        return hf.encoder_call(args, kwargs, rows, mask)

    def __enter__(self) -> KeptPatches:
        self._thread = threading.get_ident()
        self._hook = self.encoder.register_forward_pre_hook(self._gather, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# ----------------------------------------------------------------- records
def pixelprune_records(
    method: Any, selected: Selected, timer: Stopwatch, merge: int, images: list[int] | None = None,
    device: torch.device | str = "cpu", crops: list[int] | None = None,
) -> LazyRecords:  # fmt: skip
    """PixelPrune's records, one per image (or crop) of `selected`, built when read: stage "tower", tokens_in/out
    the LLM-level tokens (units), `kept` its ascending kept units (on `device`), grid the unit grid, extra
    `patches_in`/`patches_out` (ViT rows: merge^2 per unit). images / crops: each entry's image index in the call
    (default 0, 1, ...) and crop index within it (default: 0 per Qwen image, the entry's index per LLaVA crop);
    every entry takes an equal share of the selection's time."""
    images = list(range(len(selected.counts))) if images is None else images
    if crops is None:
        crops = [0 if merge > 1 else entry for entry in range(len(selected.counts))]

    def build() -> list[Record]:
        share = 1.0 / max(len(selected.counts), 1)
        out = []
        for entry, (count, grid) in enumerate(zip(selected.counts, selected.grids, strict=True)):
            units = grid[0] * grid[1]
            extra = {"patches_in": units * merge * merge, "patches_out": count * merge * merge}
            kept = to_device(selected.kept_of(entry), device)
            out.append(Record("tower", method.name, images[entry], crops[entry], units, count, kept,
                              tuple(grid), timer, share, extra=extra))  # fmt: skip
        return out

    return LazyRecords(build)


def tome_records(
    method: Any, state: MergeState, timer: Stopwatch, grid: tuple[int, int], images: list[int], crops: list[int]
) -> LazyRecords:
    """ToMe's records, one per crop of the tower call (`images`/`crops`: each crop's image and crop index), built
    when read: stage "tower", tokens_in the crop's patches, tokens_out what leaves the feature layer ([CLS]
    excluded), `kept` None (merged), extra `r` (merges per block 0..F) and `sources` ([N] every patch's output
    token)."""

    def build() -> list[Record]:
        sources = state.patch_sources()
        patches = grid[0] * grid[1]
        out_tokens = patches - sum(state.done)
        share = 1.0 / max(len(images), 1)
        return [
            Record(
                "tower",
                method.name,
                image,
                crop,
                patches,
                out_tokens,
                None,
                tuple(grid),
                timer,
                share,
                extra={"r": list(state.done), "sources": sources[index]},
            )  # fmt: skip
            for index, (image, crop) in enumerate(zip(images, crops, strict=True))
        ]

    return LazyRecords(build)


# ----------------------------------------------------------------- the tower stage on one patched model
def on_grid(values: torch.Tensor, kept: torch.Tensor, tokens: int) -> torch.Tensor:
    """values [C, K, ...] of every crop's kept slots (`KeptPatches`' layout) at their places on the crop's grid:
    [C, tokens, ...], zeros at the dropped ones (`kept` [C, K]: each slot's token, padded with `tokens`)."""
    crops, slots = kept.shape
    out = values.new_zeros(crops, tokens + 1, *values.shape[2:])
    index = kept.view(crops, slots, *[1] * (values.dim() - 2)).expand(crops, slots, *values.shape[2:])
    return out.scatter(1, index, values)[:, :tokens]


class TowerPlan:
    """One call's tower stage for one modality, decided before the tower runs (`TowerSite.plan_crops` /
    `plan_groups`), then filled while it runs.

    counts: tokens leaving the tower per entry (a crop on the LLaVA families, an image on Qwen), host ints.
    images / crops: each entry's image (within the modality) and crop index. grid: the (H, W) token grid of every
    crop (LLaVA families) or None (Qwen: `selected.grids`). selected: an input method's kept units (`Selected`;
    None for a method acting in the layers). timer: the selection's time (input), the merges' inside the tower's
    blocks (layers: `Intervals`).
    patches: while a CLIP/SigLIP tower runs on kept patches, its `KeptPatches`; merges: ToMe's `MergeState` of
    the call, once the tower ran. device: the pixels' device.
    """

    def __init__(self, site: TowerSite, counts: list[int], images: list[int], crops: list[int],
                 grid: tuple[int, int] | None, selected: Selected | None, timer: Stopwatch | Intervals,
                 device: torch.device) -> None:  # fmt: skip
        self.site, self.counts, self.images, self.crops = site, list(counts), list(images), list(crops)
        self.grid, self.selected, self.timer, self.device = grid, selected, timer, device
        self.patches: KeptPatches | None = None
        self.merges: MergeState | None = None
        self._kept: torch.Tensor | None = None

    @property
    def keeps_grid(self) -> bool:
        return self.site.stage.keeps_grid

    def item_counts(self, per_entry: list[int] | None = None) -> list[int]:
        """Tokens leaving the tower per image (its entries' counts summed), host ints; `per_entry`: other counts of
        the entries to sum per image instead (an encoder method's planned count of every crop)."""
        out = [0] * (max(self.images, default=-1) + 1)
        for image, count in zip(self.images, self.counts if per_entry is None else per_entry, strict=True):
            out[image] += count
        return out

    # ----------------------------------------------------------------- a CLIP / SigLIP tower (LLaVA families)
    def running(self, encoder: nn.Module, attention: str) -> Any:
        """The context the tower runs in: the kept patches' rows (input) or a timer whose end takes the merge
        state of this thread's call (layers)."""
        return _Running(self, encoder, attention)

    def key_valid(self) -> torch.Tensor | None:
        """[C, p + K] the real keys of the tower's padded crops (PixelPrune), for probes reading [CLS] rows."""
        if self.patches is None or not self.patches.ragged:
            return None
        valid = self.patches.valid
        return torch.cat([torch.ones_like(valid[:, : int(self.patches.cls)]), valid], dim=1)

    def crop_tokens(self, features: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]:
        """What the encoder stage gets of every crop from the tower's output features [C, K, D] (patch tokens,
        [CLS] dropped): (features, grid, valid). Input methods: the crop's full grid [C, H * W, D], the dropped
        patches zero and invalid. Layers: the N' merged tokens as a 1 x N' row, all valid."""
        if self.patches is None:
            return features, (1, features.shape[1]), None
        tokens = self.grid[0] * self.grid[1]
        return on_grid(features, self.patches.kept, tokens), self.grid, self.grid_valid()

    def grid_valid(self) -> torch.Tensor:
        """[C, H * W] bool: the patches the tower kept, per crop."""
        kept = self.patches.kept
        mask = torch.zeros(kept.shape[0], self.grid[0] * self.grid[1] + 1, dtype=torch.bool, device=kept.device)
        return mask.scatter(1, kept, True)[:, :-1]

    def signal_on_grid(self, value: Any) -> Any:
        """A per-token signal [C, K, ...] of the kept slots (or a callable giving one) put on the crops' grid."""
        if self.patches is None:
            return value
        tokens, kept = self.grid[0] * self.grid[1], self.patches.kept
        if callable(value):
            return lambda: on_grid(value(), kept, tokens)
        return on_grid(value, kept, tokens)

    # ----------------------------------------------------------------- a Qwen-VL tower
    def kept_groups(self) -> torch.Tensor:
        """[K] the kept units' indices over all units of the call, on the pixels' device (copied once)."""
        if self._kept is None:
            self._kept = to_device(self.selected.kept, self.device)
        return self._kept

    def groups_on_grid(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [K, D] of the kept groups, image after image -> [U, D] every group of the call, zeros at the
        dropped ones (raster order per image, images one after another)."""
        units = len(self.selected.keep)
        return rows.new_zeros(units, rows.shape[-1]).index_copy(0, self.kept_groups().to(rows.device), rows)

    def offsets(self, device: torch.device | str) -> list[torch.Tensor]:
        """Per image, the ascending offsets of its kept groups within its placeholder run (copied without a sync)."""
        return [to_device(self.selected.kept_of(i), device) for i in range(len(self.counts))]

    # ----------------------------------------------------------------- records
    def records(self) -> LazyRecords:
        """The tower records of this plan (built when read; ToMe's once the tower ran)."""
        stage = self.site.stage
        if self.selected is not None:
            return pixelprune_records(stage.method, self.selected, self.timer, stage.shape.merge, self.images,
                                      self.device, self.crops)  # fmt: skip
        return LazyRecords(
            lambda: (
                list(tome_records(stage.method, self.merges, self.timer, self.grid, self.images, self.crops))
                if self.merges is not None
                else []
            )
        )


class _Running:
    """`TowerPlan.running`: the context around one CLIP / SigLIP tower call."""

    def __init__(self, plan: TowerPlan, encoder: nn.Module, attention: str) -> None:
        self.plan, self.encoder, self.attention = plan, encoder, attention
        self._inner = None

    def __enter__(self) -> TowerPlan:
        plan = self.plan
        if plan.selected is not None:
            stage = plan.site.stage
            self._inner = KeptPatches(self.encoder, plan.selected, stage.shape.cls, self.attention, plan.device)
            plan.patches = self._inner.__enter__()
        else:
            plan.timer = Intervals()
            plan.site.merging.time_merges(plan.timer)
        return plan

    def __exit__(self, *exc: Any) -> None:
        plan = self.plan
        if self._inner is not None:
            self._inner.__exit__(*exc)
            return
        plan.site.merging.time_merges(None)
        plan.merges = plan.site.merging.last()


class TowerSite:
    """Where the tower stage meets one transformers model (the adapter holds it beside its `TowerStage`): what
    `patch` installs for the method (ToMe's merging blocks, through the adapter's hook owner) and, per call, the
    plan made before the tower runs (`plan_crops`, `plan_groups`)."""

    def __init__(self, stage: Any, tower: nn.Module | None = None) -> None:
        """stage: the `vtoken.stages.tower.TowerStage`; tower: the CLIP / SigLIP tower a method acting in the
        layers merges in (checked here, installed by `install`)."""
        self.stage = stage
        self.tower = tower
        self.attention = hf.attention_implementation(tower) if tower is not None else "sdpa"
        self.merging: ToMeTower | None = None
        if stage.acts == "layers":
            self.merging = ToMeTower(stage.method, tower.encoder.layers, stage.shape, self.attention)

    def install(self, hooks: Any) -> None:
        """Install what the method needs on the model, each undo kept by `hooks` (the adapter's `HookOwner`)."""
        if self.merging is not None:
            self.merging.install()
            hooks.on_remove(self.merging.remove)

    def plan_crops(self, crops: torch.Tensor, grid: tuple[int, int], images: list[int],
                   crop_index: list[int]) -> TowerPlan:  # fmt: skip
        """The plan of a CLIP / SigLIP tower call on crops [C, 3, H, W] of (H, W)-patch `grid` each."""
        device = crops.device
        if self.stage.acts == "input":
            selected, timer = self.stage.select(crops, [grid] * crops.shape[0])
            return TowerPlan(self, selected.counts, images, crop_index, grid, selected, timer, device)
        counts = self.stage.counts([grid] * crops.shape[0])
        return TowerPlan(self, counts, images, crop_index, grid, None, Intervals(), device)

    def plan_groups(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerPlan:
        """The plan of a Qwen-VL tower call on `pixel_values` [S, D] of images of (1, h, w) patches each."""
        selected, timer = self.stage.select(pixel_values, grids)
        images = list(range(len(grids)))
        return TowerPlan(self, selected.counts, images, [0] * len(grids), None, selected, timer, pixel_values.device)
