"""The functional API, for vision-language pipelines that are not a stock transformers VLM.

    features, signals = vtoken.encode(tower, pixel_values, layer=-2, signals=("cls_attention",))
    kept, index = vtoken.select(vtoken.FasterVLM(budget=0.25), features, grid=(24, 24), signals=signals)
    embeds = my_projector(kept)  # then into your LLM

`encode` runs a timm, open_clip or transformers vision tower (see `vtoken.towers`) up to one block and returns
that block's patch tokens and the score signals asked for; `select` runs an encoder-stage method on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from .errors import InputError, MissingSignalError, VTokenError
from .methods.base import EncoderMethod, Method
from .registry import available_methods, method_class
from .stages.encoder import COMMON_SIGNALS, EncoderStage, SignalSources
from .tokens import TextQuery, VisualTokens
from .towers import tower_of

ACCEPTED_SIGNALS = (
    '"cls_attention" (at `layer`), "cls_attention@L" (at block L, Python-style index) and "keys" (at `layer`)'
)
# what `select` knows without `signals`: the common signals (the encoder stage fills them from the arguments) and
# the grid the features lie on (any size: positions are the caller's)
_GIVEN = frozenset({*COMMON_SIGNALS, "grid", "resized_grid"})


def _on_features_alone(method: Method | type[Method]) -> bool:
    """Whether `method` (an object or a class) selects from the features alone: an encoder-stage-only method that
    merges nothing inside the vision tower."""
    cls = method if isinstance(method, type) else type(method)
    requires = method.requires if isinstance(method.requires, tuple) else ()  # a class's may be a property (HiRED)
    return issubclass(cls, EncoderMethod) and tuple(cls.stages) == ("encoder",) and "tower_merge" not in requires


def _signal_block(name: object, layer: int) -> int:
    """The block index a signal name reads (before normalisation), or a VTokenError naming the accepted names."""
    if name in ("cls_attention", "keys"):
        return layer
    if isinstance(name, str) and name.startswith("cls_attention@"):
        try:
            return int(name.removeprefix("cls_attention@"))
        except ValueError:
            pass
    raise VTokenError(f"unknown signal {name!r}; accepted: {ACCEPTED_SIGNALS}")


def encode(
    tower: torch.nn.Module,
    pixel_values: torch.Tensor,
    layer: int = -2,
    signals: Iterable[str] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Patch features of one block of a vision tower, and score signals for `select`.

    tower: a timm `VisionTransformer` or `Eva`, an open_clip `VisionTransformer` (`model.visual`), or a
        transformers `CLIPVisionModel` / `SiglipVisionModel`.
    pixel_values: [B, 3, H, W], as the tower takes them.
    layer: the block whose output is returned, Python-style: 0 the first, -1 the last, -2 the one before
        (LLaVA's `vision_feature_layer=-2` is the output of `blocks[-2]`).
    signals: names to compute: "cls_attention" = head-mean post-softmax attention of the [CLS] query in block
        `layer`, softmax over all keys (prefix tokens included), read at the patch keys, not renormalised;
        "cls_attention@L" the same in block L; "keys" = block `layer`'s attention keys of the patches as its
        attention uses them (timm: after QK-norm and RoPE), mean over heads, [B, N, d] (VisionZip). The tower
        keeps its fused attention (SDPA / need_weights=False): the rows are computed from what the block
        computes anyway, by hooks removed before returning.

    Returns features [B, N, D] (the block's raw output, no final norm, prefix tokens removed) and a dict of
    [B, N] float32 signals ("keys": [B, N, d]). Blocks after the last one needed do not run.
    """
    view = tower_of(tower)
    block = view.block_index(layer)
    names = list(dict.fromkeys([signals] if isinstance(signals, str) else signals))
    wanted = {}
    for name in names:
        at = _signal_block(name, layer)
        try:
            wanted[name] = view.block_index(at)
        except VTokenError as error:
            depth = len(view.blocks)
            raise VTokenError(
                f"signal {name!r} reads block {at}, which this {view.kind} tower of {depth} "
                f"blocks does not have; accepted: cls_attention@L with L in [{-depth}, {depth - 1}] (Python-style: "
                "0 = the first block, -1 = the last)"
            ) from error
    if pixel_values.dim() != 4:
        raise InputError(f"pixel_values of shape {tuple(pixel_values.shape)}; expected [B, 3, H, W]")
    probes = {name: view.probe(index) for name, index in wanted.items()}
    last = max([block, *wanted.values()])
    hidden = view.capture(pixel_values, block, list(probes.values()), last)
    prefix = view.num_prefix_tokens
    scores = {name: probe.probs().mean(dim=1)[:, prefix:] for name, probe in probes.items()}  # also sets the keys
    for name, probe in probes.items():
        if name == "keys":  # transformers towers' probe gives the patch keys; the others [B, S, H, d]
            keys = getattr(probe, "patch_keys", None)
            scores[name] = keys.float() if keys is not None else probe.keys.float().mean(dim=2)[:, prefix:]
    return hidden[:, prefix:], scores


def select(
    method: Method,
    features: torch.Tensor,
    grid: tuple[int, int] | None = None,
    signals: dict[str, torch.Tensor] | None = None,
    text: torch.Tensor | list[torch.Tensor] | None = None,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run an encoder-stage method on features [B, N, D] of B images (each an H x W grid in raster order).

    method: random, pool, FasterVLM, HiRED (its single-crop rule: the top int(N * rate) by "cls_attention"),
        MMTok, Fourier-VLM, VisPruner, VisionZip (signals "cls_attention" and "keys"; a [B, D] "cls_token" is sent
        first when given; its rows are merged features), DivPrune (each image's tokens as your LLM receives
        them), or any `EncoderMethod` that needs only these inputs.
    grid: (H, W) with H * W = N; None for a square grid.
    signals: what the method needs (e.g. `encode(..., signals=("cls_attention",))`'s dict), each [B, N].
    text (MMTok): the question's LLM input embeddings: [T, D] for every image, [B, T, D], or a list of B [T_b, D].
    project (MMTok): features [B, N, D] -> [B, N, D'] in the LLM's space (your projector); None if `features`
        already are. MMTok's vision-to-vision similarity uses `features` (or signals["vision_features"]); its
        tau_tv defaults to LLaVA's 0.02.

    Returns (kept, index): kept [B, k, D] the tokens for the LLM, k by the library's budget rule
    (`vtoken.tokens_to_keep`); index [B, k] ascending, for selecting methods the kept token's position in the
    N-token grid, for pooling the patch at each pooled cell's centre (`pool`), and None for methods that hand
    back a new, smaller grid (Fourier-VLM: kept is its h x w grid in raster order) or merged rows (VisionZip).
    """
    if not _on_features_alone(method):
        name = getattr(method, "name", type(method).__name__)
        alone = [n for n in available_methods() if _on_features_alone(c := method_class(n)) and "image" in c.modalities]
        raise VTokenError(
            f"select runs encoder-stage methods that work on features alone ({', '.join(alone)}); {name!r} acts "
            "inside the tower or the LLM: use vtoken.patch on a supported model"
        )
    if "image" not in method.modalities:
        raise VTokenError(
            f"select takes images, one per row of `features`; {method.name} acts on videos (its budgets are shared "
            "out over a video's frames): use vtoken.patch on a supported video model"
        )
    if not isinstance(features, torch.Tensor) or features.dim() != 3:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise InputError(f"features of shape {shape}; expected [B, N, D]")
    batch, n = features.shape[:2]
    if grid is None:
        side = math.isqrt(n)
        if side * side != n:
            raise InputError(f"{n} tokens are not a square grid; pass grid=(H, W) with H * W = {n}")
        grid = (side, side)
    if len(grid) != 2 or grid[0] * grid[1] != n:
        raise InputError(f"grid={tuple(grid)} does not hold the {n} tokens of `features`; expected H * W = {n}")
    signals = dict(signals or {})
    stage = EncoderStage(method)
    needed = [name for name in method.single_crop_requires() if name not in _GIVEN]  # one crop per image
    missing = [name for name in needed if name not in signals]
    if missing:
        raise MissingSignalError(
            f"{method.name} needs the signal(s) {missing}; got {sorted(signals)}. Compute them with "
            f"vtoken.encode(tower, pixel_values, layer=..., signals={tuple(missing)!r})"
        )
    for name in needed:
        per_token = name == "keys"  # [B, N, d]; every other signal [B, N]
        shape = tuple(signals[name].shape)
        if shape[:2] != (batch, n) or len(shape) != 2 + per_token:
            expected = f"[B, N, d] = {[batch, n, 'd']}" if per_token else f"[B, N] = {[batch, n]}"
            raise InputError(f"signals[{name!r}] has shape {shape}; expected {expected}")
    question = _text_query(text, batch) if method.wants("question") else None
    tokens = VisualTokens(features, tuple(grid), signals, torch.arange(batch))
    selection, _ = stage.select(tokens, SignalSources(project, question))
    counts = selection.counts_per_crop()
    if len(set(counts)) > 1:
        raise RuntimeError(f"{method.name} kept different numbers of tokens per image: {counts}")
    k = counts[0] if counts else 0
    if selection.kept is not None:
        index = selection.kept[:, :k]  # rows padded past their count (per-crop top-k) are cut
        return features.gather(1, index.unsqueeze(-1).expand(-1, -1, features.shape[-1])), index
    anchors = selection.anchors[:, :k] if selection.anchors is not None else None
    return selection.features[:, :k], anchors


def _text_query(text: torch.Tensor | list[torch.Tensor] | None, batch: int) -> TextQuery:
    """A `TextQuery` whose embeddings are the given ones (image b's "question" is just its index)."""
    if text is None:
        raise MissingSignalError(
            "mmtok needs the question's LLM input embeddings: select(..., text=embeddings [T, D] or one per image)"
        )
    if isinstance(text, torch.Tensor):
        per_image = list(text) if text.dim() == 3 else [text] * batch
    else:
        per_image = list(text)
    if len(per_image) != batch or any(t.dim() != 2 for t in per_image):
        raise InputError(f"text: expected one [T, D] tensor, or a list of {batch} [T_b, D] tensors (one per image)")

    def embed(query: str) -> torch.Tensor:
        return per_image[int(query.rsplit("image", 1)[-1])]  # the method may prefix the text ("Question: ")

    return TextQuery([f"image{b}" for b in range(batch)], "custom", embed)
