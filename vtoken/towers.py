"""Vision towers from timm, open_clip and transformers behind one small interface, for `vtoken.encode`.

A `Tower` knows where a tower's blocks are, how many prefix tokens ([CLS], registers) precede the patches, and how
to read the [CLS] query's attention row inside one block while the block keeps its fused attention (SDPA): probes
are forward hooks that capture what the block computes anyway (q and k after their norms in timm, the attention
input in open_clip, q_proj/k_proj outputs in transformers) and compute only the one row, in O(S * d) per head.

Supported: timm `VisionTransformer` (class and register tokens) and `Eva` (RoPE on the patch tokens, prefix
tokens unrotated), open_clip `VisionTransformer` (blocks with `nn.MultiheadAttention`), transformers CLIP and
SigLIP vision models.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from vtoken.errors import MissingSignalError, UnsupportedModelError, VTokenError
from vtoken.kernels import attention_column_mean, attention_row_probs

ACCEPTED_TOWERS = (
    "a timm VisionTransformer or Eva, an open_clip VisionTransformer (e.g. `open_clip_model.visual`), or a "
    "transformers CLIP/SigLIP vision model (CLIPVisionModel, SiglipVisionModel)"
)


TRANSFORMERS_TOWERS = ("clip_vision_model", "siglip_vision_model")


class _Captured(Exception):
    """Raised by the block-output hook to stop the tower once the requested block has run."""


class AttentionRowProbe:
    """Base: hooks on one attention module, installed while used as a context manager (and removed on exit,
    also on error), giving the [CLS] query's row afterwards.

    Subclasses fill `self.query` [B, H, d] and `self.keys` [B, S, H, d] from their hooks and set `scale`.
    """

    scale: float

    def __init__(self) -> None:
        self.query: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        self._handles: list = []

    def install(self) -> list[torch.utils.hooks.RemovableHandle]:
        raise NotImplementedError

    def __enter__(self) -> AttentionRowProbe:
        self._handles = self.install()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def probs(self) -> torch.Tensor:
        """[B, H, S] post-softmax attention of the [CLS] query over every key, float32."""
        if self.query is None or self.keys is None:
            raise RuntimeError("the probed attention layer did not run")
        return attention_row_probs(self.query, self.keys, self.scale)


class TimmRowProbe(AttentionRowProbe):
    """timm `Attention`, `AttentionRope`, `EvaAttention`: q and k are read where the module normalises them
    (`q_norm`/`k_norm`, Identity without QK-norm, called on [B, H, S, d] right before SDPA), and RoPE, when the
    block passes one, is applied here as timm does: to the non-prefix tokens only (the [CLS] query stays as is)."""

    def __init__(self, attention: nn.Module, cls_index: int, num_prefix_tokens: int):
        super().__init__()
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(attention, name, None), nn.Module):
                raise UnsupportedModelError(
                    f"{type(attention).__name__} has no {name}; [CLS] attention is read from timm attention modules "
                    "with q_norm/k_norm (Attention, AttentionRope, EvaAttention)"
                )
        self.attention = attention
        self.cls_index = cls_index
        self.num_prefix_tokens = getattr(attention, "num_prefix_tokens", num_prefix_tokens)
        self.scale = float(getattr(attention, "scale", None) or attention.head_dim**-0.5)
        self.rope: torch.Tensor | None = None
        self._raw_keys: torch.Tensor | None = None
        self._masked = False

    def _on_call(self, module, args, kwargs):
        called = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        self.rope = called.get("rope")
        if called.get("attn_mask") is not None or called.get("is_causal"):
            self._masked = True

    def _on_query(self, module, args, output):
        self.query = output[:, :, self.cls_index]  # [B, H, d]

    def _on_keys(self, module, args, output):
        self._raw_keys = output  # [B, Hkv, S, d], rotated in `probs` (only when asked for)

    def install(self):
        self.query = self.keys = self.rope = self._raw_keys = None
        self._masked = False
        return [
            self.attention.register_forward_pre_hook(self._on_call, with_kwargs=True),
            self.attention.q_norm.register_forward_hook(self._on_query),
            self.attention.k_norm.register_forward_hook(self._on_keys),
        ]

    def probs(self) -> torch.Tensor:
        if self._masked:
            raise VTokenError("cls_attention is computed for unmasked attention; this tower ran with an attn_mask")
        keys = self._raw_keys
        if keys is not None and self.keys is None:
            if self.rope is not None:
                from timm.layers import apply_rot_embed_cat

                npt = self.num_prefix_tokens
                half = getattr(self.attention, "rotate_half", False)
                rotated = apply_rot_embed_cat(keys[:, :, npt:], self.rope, half=half)
                keys = torch.cat([keys[:, :, :npt], rotated.type_as(keys)], dim=2)
            groups = self.query.shape[1] // keys.shape[1]  # grouped-query attention: kv head h // groups
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
            self.keys = keys.transpose(1, 2)  # [B, S, H, d]
        return super().probs()


class TimmColumnProbe(TimmRowProbe):
    """The attention every token receives in a timm attention block (`AttentionRope`, `EvaAttention`, ...): the
    post-softmax map's mean over heads and over every query row (prefix tokens included), from q and k read after
    their norms and rotated as timm rotates them; `scores` [B, S] (the column-mean op, no [B, H, S, S] map)."""

    def _on_query(self, module, args, output):
        self._raw_query = output  # [B, H, S, d]

    def install(self):
        self._raw_query = None
        return super().install()

    def _rotated(self, values: torch.Tensor) -> torch.Tensor:
        if self.rope is None:
            return values
        from timm.layers import apply_rot_embed_cat

        npt = self.num_prefix_tokens
        half = getattr(self.attention, "rotate_half", False)
        rotated = apply_rot_embed_cat(values[:, :, npt:], self.rope, half=half)
        return torch.cat([values[:, :, :npt], rotated.type_as(values)], dim=2)

    @property
    def scores(self) -> torch.Tensor:
        if self._masked:
            raise VTokenError("received attention is computed for unmasked attention; this tower ran with an attn_mask")
        if self._raw_query is None or self._raw_keys is None:
            raise RuntimeError("the probed attention layer did not run")
        query, keys = self._rotated(self._raw_query), self._rotated(self._raw_keys)
        groups = query.shape[1] // keys.shape[1]  # grouped-query attention: kv head h // groups
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
        return attention_column_mean(query.transpose(1, 2), keys.transpose(1, 2), self.scale)


class MultiheadRowProbe(AttentionRowProbe):
    """`torch.nn.MultiheadAttention` (open_clip): a pre-hook keeps the attention input; the [CLS] query and the
    keys come from the q and k slices of `in_proj_weight`/`in_proj_bias` (one extra K projection), while the module
    itself runs its fused path (`need_weights=False`)."""

    def __init__(self, attention: nn.MultiheadAttention, cls_index: int):
        super().__init__()
        if getattr(attention, "in_proj_weight", None) is None:
            raise UnsupportedModelError(
                "[CLS] attention needs a MultiheadAttention with one packed in_proj_weight (q|k|v rows); this one "
                "has separate q/k/v projections"
            )
        self.attention = attention
        self.cls_index = cls_index
        self.heads = attention.num_heads
        self.head_dim = attention.embed_dim // attention.num_heads
        self.scale = self.head_dim**-0.5

    def _on_call(self, module, args, kwargs):
        x = args[0] if args else kwargs["query"]
        self._input = x if module.batch_first else x.transpose(0, 1)  # [B, S, D]

    def install(self):
        self.query = self.keys = None
        self._input = None
        return [self.attention.register_forward_pre_hook(self._on_call, with_kwargs=True)]

    def probs(self) -> torch.Tensor:
        if self._input is not None and self.keys is None:
            dim = self.attention.embed_dim
            weight, bias = self.attention.in_proj_weight, self.attention.in_proj_bias
            w_q, w_k = weight[:dim], weight[dim : 2 * dim]
            b_q, b_k = (None, None) if bias is None else (bias[:dim], bias[dim : 2 * dim])
            x = self._input
            batch, seq = x.shape[:2]
            query = nn.functional.linear(x[:, self.cls_index], w_q, b_q)
            keys = nn.functional.linear(x, w_k, b_k)
            self.query = query.view(batch, self.heads, self.head_dim)
            self.keys = keys.view(batch, seq, self.heads, self.head_dim)
        return super().probs()


class Tower:
    """A vision tower seen as: a list of blocks, `num_prefix_tokens` tokens before the patches ([CLS] at
    `cls_index` or none), a way to run it, and a [CLS]-row probe per block."""

    kind: str = ""
    cls_index: int | None = None
    num_prefix_tokens: int = 0

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def run(self, pixel_values: torch.Tensor) -> Any:
        """Run the tower far enough for every hooked block to fire."""
        raise NotImplementedError

    def tokens(self, output: Any) -> torch.Tensor:
        """A block's output as [B, S, D]."""
        return output[0] if isinstance(output, tuple) else output

    def row_probe(self, block: int) -> Any:
        """A context manager hooking block `block`'s attention, whose `probs()` is then [B, H, S]."""
        raise NotImplementedError

    def block_index(self, layer: int) -> int:
        """Python-style block index (0 = first, -1 = last) -> 0-based, or a VTokenError naming the range."""
        depth = len(self.blocks)
        if isinstance(layer, bool) or not isinstance(layer, int) or not -depth <= layer < depth:
            raise VTokenError(
                f"layer={layer!r} is out of range for this {self.kind} tower of {depth} blocks; accepted: an int in "
                f"[{-depth}, {depth - 1}] (0 = the first block's output, -1 = the last, -2 = the one before)"
            )
        return layer % depth

    def probe(self, block: int) -> Any:
        if self.cls_index is None:
            raise MissingSignalError(
                f"cls_attention needs a [CLS] token, and this {self.kind} tower has none ({type(self.module).__name__})"
            )
        return self.row_probe(block)

    def capture(
        self, pixel_values: torch.Tensor, block: int, probes: list[AttentionRowProbe], last: int
    ) -> torch.Tensor:
        """Run the tower with `probes` installed until block `last` (>= `block`) has run: the output of `block`,
        [B, S, D] with the prefix tokens. Later blocks never run; every hook is removed before returning."""
        captured: list[torch.Tensor] = []

        def keep(module, args, output):
            captured.append(self.tokens(output))

        def stop(module, args, output):
            raise _Captured

        with ExitStack() as stack:
            for probe in probes:
                stack.enter_context(probe)
            for index, hook in ((block, keep), (last, stop)):
                stack.callback(self.blocks[index].register_forward_hook(hook).remove)
            try:
                self.run(pixel_values)
            except _Captured:
                pass
        if not captured:
            raise RuntimeError(f"block {block} of the {self.kind} tower did not run")
        return captured[0]


class TimmTower(Tower):
    kind = "timm"

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.num_prefix_tokens = int(getattr(module, "num_prefix_tokens", 0))
        self.cls_index = 0 if getattr(module, "cls_token", None) is not None else None

    @property
    def blocks(self) -> nn.ModuleList:
        return self.module.blocks

    def run(self, pixel_values):
        return self.module.forward_features(pixel_values)

    def row_probe(self, block):
        attention = getattr(self.blocks[block], "attn", None)
        if attention is None:
            raise UnsupportedModelError(f"block {block} of this timm tower has no `attn` module to read [CLS] from")
        return TimmRowProbe(attention, self.cls_index, self.num_prefix_tokens)


class OpenClipTower(Tower):
    kind = "open_clip"
    cls_index = 0
    num_prefix_tokens = 1  # open_clip's VisionTransformer always prepends its class embedding

    @property
    def blocks(self) -> nn.ModuleList:
        return self.module.transformer.resblocks

    def run(self, pixel_values):
        return self.module(pixel_values)

    def tokens(self, output):
        batch_first = getattr(self.module.transformer, "batch_first", False)  # older open_clip: always LND
        return output if batch_first else output.transpose(0, 1)

    def row_probe(self, block):
        attention = getattr(self.blocks[block], "attn", None)
        if not isinstance(attention, nn.MultiheadAttention):
            raise UnsupportedModelError(
                f"cls_attention on open_clip reads blocks built on torch.nn.MultiheadAttention; block {block} has "
                f"{type(attention).__name__} (e.g. scaled-cosine or QK-norm attention), which is not supported"
            )
        return MultiheadRowProbe(attention, self.cls_index)


class TransformersTower(Tower):
    kind = "transformers"

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.vision = getattr(module, "vision_model", module)
        has_cls = getattr(self.vision.embeddings, "class_embedding", None) is not None
        self.cls_index = 0 if has_cls else None
        self.num_prefix_tokens = 1 if has_cls else 0

    @property
    def blocks(self) -> nn.ModuleList:
        return self.vision.encoder.layers

    def run(self, pixel_values):
        return self.vision(pixel_values=pixel_values)

    def row_probe(self, block):
        from vtoken.adapters.probes import ClsAttentionProbe  # hooks q_proj / k_proj, as the LLaVA adapters do

        return ClsAttentionProbe(self.blocks[block].self_attn, self.cls_index)


def tower_of(module: Any) -> Tower:
    """The `Tower` view of a supported vision tower, or an `UnsupportedModelError` naming what is accepted.

    timm and open_clip are looked up only when already imported (a tower of theirs cannot exist otherwise), so
    a transformers tower never pays for importing them.
    """
    timm_vit, timm_eva = sys.modules.get("timm.models.vision_transformer"), sys.modules.get("timm.models.eva")
    if timm_vit is not None and isinstance(module, (timm_vit.VisionTransformer, timm_eva.Eva)):
        return TimmTower(module)
    open_clip = sys.modules.get("open_clip.transformer")
    if open_clip is not None:
        if isinstance(module, open_clip.VisionTransformer):
            return OpenClipTower(module)
        if isinstance(getattr(module, "visual", None), open_clip.VisionTransformer):
            raise UnsupportedModelError(
                f"{type(module).__name__} is a whole open_clip model; pass its vision tower: `model.visual`"
            )
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    vision = getattr(module, "vision_model", module)
    if model_type in TRANSFORMERS_TOWERS and hasattr(vision, "embeddings") and hasattr(vision, "encoder"):
        return TransformersTower(module)
    raise UnsupportedModelError(f"unsupported vision tower {type(module).__name__}; accepted: {ACCEPTED_TOWERS}")
