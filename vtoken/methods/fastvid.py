"""FastVID: dynamic density pruning for fast video LLMs (Shen et al., "FastVID: Dynamic Density Pruning for Fast
Video Large Language Models", NeurIPS 2025; official code LunarShen/FastVID @a40a109, METHODS-3-video.md).

On one video's LLM-input tokens x [F, T, D] (post projector and pooling, no newline), with two per-frame signals,
a_f (how much attention each token draws) and g_f (the frame's global feature):

1. DySeg: s_f = cos(g_f, g_f+1); a segment ends after frame f when s_f is among the c - 1 smallest of the video or
   s_f < tau (and at the last frame).
2. Budgets, `variant="onevision"` (the paper's parallel form, LLaVA-OneVision): keep = int(T * budget) per frame,
   salient S = keep - int(keep * d), context C = keep - S. A segment of L frames has ceil(L / p) anchor frames (its
   last and every p-th before it), each with (C * L) // ceil(L / p) context tokens; other frames none.
   `variant="qwen"` (the official Qwen2.5-VL form, per segment): retain = int(T * budget) * L, context =
   max(int(retain * d), 1), salient = the rest; a segment is cut again where s_f < `ignore`; the salient budget is
   split evenly over those sub-segments (the remainder to the first ones) and the context budget over every p-th
   from the end (the remainder to the last ones, each capped at T // 2); a sub-segment's budgets go to its last
   frame, every other frame keeps nothing.
3. Salient tokens: a frame's top-S by a_f.
4. Context (DTM): DPC-kNN scores (k = 4) of the frame's other tokens; an anchor's top-scored ones are its targets.
   onevision: a frame with exactly C (a one-frame segment) merges its own non-salient tokens into them; an anchor of
   a longer segment merges every non-salient token of its segment (each token once per anchor). qwen: an anchor
   merges every token of its segment that is neither salient nor one of its own targets. Each token goes to its
   most cosine-similar target (the first on ties); a target with n tokens becomes w * x + (1 - w) * their mean,
   w = max(1 / (n + 1), beta).
5. Kept: salient and context tokens, ascending by position per frame (a context token at its target's), each at
   its original position (gaps; the official LLaVA-OneVision code passes `position_ids = keep_indexs`, and Qwen's
   M-RoPE keeps (t, h, w) anyway); decoding continues at the unpruned length.

Signals: onevision reads SigLIP's attention-pooling (MAP) head on the tower features (`siglip_head_attention`:
the probe's head-mean attention pooled like the tokens; `siglip_head_pooled`: its pooled output); qwen reads the
last ViT block (`vit_query_attention`: the frame's mean query against each merged token's mean key, softmax,
head mean) and the frame's mean token. `variant=None` takes the model's official form: qwen on the Qwen-VL
families, onevision on LLaVA-OneVision; `budget`/`tau` None take that form's official values (0.10 / 0.9,
Qwen: 0.27 / 0.84). Families without either signal (CLIP towers: LLaVA-NeXT-Video, Video-LLaVA) are refused.

Differences from the official code (docs/methods-video-mergers.md): every video of every row (the official: the first
video of a batch of one), fewer frames than c (the official's top-k raises: min(c - 1, F - 1) cuts), quotas capped
at the tokens left, fewer than 4 candidates (k = their count), distances, similarities and merges in fp32 (the
official: the model's dtype), seeded noise, ties to the lower index. GPU: frames (and videos of equal length)
batched, a fixed number of ops whatever the segments; one host sync per call sizes the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..budget import Budget
from ..errors import VTokenError
from ..params import Choice, Int, Kept, OrNone, Param, Real, Scope
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod
from .density import density_peak_scores, descending_rank, frame_segments, seeded_noise

VARIANTS = ("onevision", "qwen")
OFFICIAL = {"onevision": {"budget": 0.10, "tau": 0.9}, "qwen": {"budget": 0.27, "tau": 0.84}}
NEIGHBOURS = 4  # the official DPC-kNN's k
# the signals of each form (the adapter of a family that has them provides them)
HEAD_SIGNALS = ("siglip_head_attention", "siglip_head_pooled")
QWEN_SIGNALS = ("vit_query_attention",)


@dataclass
class MergedFrames:
    """What a merge decided for V videos of F frames, T tokens each; `apply` builds the output from any per-token
    features aligned with the tokens (the LLM-input tokens, or Qwen3-VL's DeepStack levels).

    keep: [V, F, T] bool, positions that reach the LLM; targets: [V, F, Q] a frame's context targets (positions,
    padded); target_valid: [V, F, Q]; members: [V, F, Q, F * T] the tokens (flattened over the video) each target
    absorbs, 0/1; weight: [V, F, Q] w of each target; width: the widest frame's output (host-known bound)."""

    keep: torch.Tensor
    targets: torch.Tensor
    target_valid: torch.Tensor
    members: torch.Tensor
    weight: torch.Tensor
    width: int

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [V, F, T, D] -> (rows [V, F, width, D] fp32, positions [V, F, width]): each frame's kept tokens
        ascending by position, context targets replaced by their merge; rows past a frame's count are padding."""
        videos, frames, tokens, dim = x.shape
        x = x.float()
        count = self.members.sum(-1)  # [V, F, Q]
        sums = torch.matmul(self.members.flatten(1, 2), x.reshape(videos, frames * tokens, dim))
        mean = sums.view(videos, frames, -1, dim) / count.clamp(min=1)[..., None]
        at = self.targets[..., None].expand(-1, -1, -1, dim)
        target = x.gather(2, at)
        merged = self.weight[..., None] * target + (1 - self.weight[..., None]) * mean
        merged = torch.where(self.target_valid[..., None], merged, target)  # padding slots write back the same
        out = x.scatter(2, at, merged)
        index = torch.arange(tokens, device=x.device)
        positions = torch.where(self.keep, index, tokens + index).argsort(dim=-1)[..., : self.width]
        return out.gather(2, positions[..., None].expand(-1, -1, -1, dim)), positions


def assign(x: torch.Tensor, targets: torch.Tensor, target_valid: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Each token of a video to its most cosine-similar target of each anchor frame (the first on ties).

    x: [V, F, T, D]; targets: [V, F, Q] positions of each frame's targets; target_valid: [V, F, Q]; pairs: [V, F, T,
    F] bool, token (f, j) merges into anchor frame a's targets. Returns members [V, F(a), Q, F * T] 0/1."""
    videos, frames, tokens, dim = x.shape
    x = x.float()
    unit = x / x.norm(dim=-1, keepdim=True)
    width = targets.shape[-1]
    if width == 0:  # no context tokens (d = 0, or a budget too small for any)
        return torch.zeros(videos, frames, 0, frames * tokens, device=x.device)
    chosen = unit.gather(2, targets[..., None].expand(-1, -1, -1, dim))  # [V, F, Q, D]
    similarity = torch.matmul(
        unit.reshape(videos, frames * tokens, dim), chosen.reshape(videos, -1, dim).transpose(1, 2)
    )
    similarity = similarity.view(videos, frames * tokens, frames, width)
    similarity = similarity.masked_fill(~target_valid[:, None], float("-inf"))
    best = similarity.argmax(dim=-1)  # [V, F * T, F(a)]
    members = torch.zeros(videos, frames, width, frames * tokens, device=x.device)
    flags = pairs.reshape(videos, frames * tokens, frames).transpose(1, 2)[:, :, None].float()
    return members.scatter_(2, best.transpose(1, 2)[:, :, None], flags)


def onevision_merge(
    x: torch.Tensor, attention: torch.Tensor, unit: torch.Tensor, keep: int, noise: torch.Tensor, method: FastVID
) -> MergedFrames:
    """The parallel (LLaVA-OneVision) form on V videos of F frames: x [V, F, T, D], attention [V, F, T], unit [V, F, G]
    the frames' unit global features, keep = tokens per frame, noise [F, T]."""
    videos, frames, tokens, _ = x.shape
    device = x.device
    salient = keep - int(keep * method.d)
    context = keep - salient
    rest = tokens - salient
    _, start, end = frame_segments(unit, method.c - 1, method.resolved("tau"))
    index = torch.arange(frames, device=device)
    length = end - start + 1
    anchor = (end - index) % method.p == 0
    quota = torch.where(anchor, (context * length) // ((length + method.p - 1) // method.p), 0)
    own = (quota == context) & (quota > 0)  # one-frame segments (and p = 1): its own tokens only
    whole = quota > context  # an anchor of a longer segment: its segment's tokens
    quota = quota.clamp(max=rest)
    # salient: a frame's top-S by attention; the rest (R_f) ascending
    salient_flag = descending_rank(attention.float()) < salient
    positions = torch.arange(tokens, device=device)
    others = (positions + tokens * salient_flag).argsort(dim=-1)[..., :rest]  # [V, F, R] ascending
    candidates = x.gather(2, others[..., None].expand(-1, -1, -1, x.shape[-1]))
    if rest:
        score, _ = density_peak_scores(candidates.flatten(0, 1), None, min(NEIGHBOURS, rest),
                                       noise[None].expand(videos, -1, -1).gather(2, others).flatten(0, 1))  # fmt: skip
    else:  # every token salient (d = 0 at a budget of 1): nothing left to merge
        score = candidates.new_zeros(videos * frames, 0)
    width = min(context * method.p, rest)  # a quota is at most C * p: (C * L) // ceil(L / p) <= C * p
    picked = score.view(videos, frames, rest).argsort(dim=-1, descending=True, stable=True)[..., :width]
    targets = others.gather(2, picked)  # positions, in descending score (the official top-k order)
    target_valid = torch.arange(width, device=device) < quota[..., None]
    # token (f, j) of R_f merges into anchor a's targets: a's own frame, or a's segment
    same = (index[:, None] == index[None, :])[None] & own[:, None, :]
    segment = (start[:, :, None] == start[:, None, :]) & whole[:, None, :]
    pairs = (same | segment)[:, :, None, :] & ~salient_flag[..., None]  # [V, F, T, F(a)]
    members = assign(x, targets, target_valid, pairs)
    count = members.sum(-1)
    weight = (1 / (count + 1)).clamp(min=method.beta)
    kept = salient_flag.scatter(2, targets, target_valid)
    return MergedFrames(kept, targets, target_valid, members, weight, salient + width)


def qwen_merge(
    x: torch.Tensor, attention: torch.Tensor, retain: int, noise: torch.Tensor, method: FastVID
) -> MergedFrames:
    """The official Qwen2.5-VL form on V videos of F temporal patches: budgets per segment and sub-segment."""
    videos, frames, tokens, _ = x.shape
    device = x.device
    mean = x.float().mean(dim=2)
    unit = mean / mean.norm(dim=-1, keepdim=True)
    similarity, start, end = frame_segments(unit, method.c - 1, method.resolved("tau"))
    index = torch.arange(frames, device=device).expand(videos, -1)
    length = end - start + 1
    seg_retain = retain * length
    seg_context = (seg_retain.double() * method.d).floor().long().clamp(min=1)
    seg_salient = (seg_retain - seg_context).clamp(min=0)
    # sub-segments: cut again inside a segment where s_f < ignore; their last frames take the budgets
    inner = torch.cat([similarity < method.ignore, torch.zeros(videos, 1, dtype=torch.bool, device=device)], dim=1)
    sub_end = inner | (index == end)
    sub_id = sub_end.long().cumsum(1) - sub_end.long()
    first = sub_id.gather(1, start)
    place, parts = sub_id - first, sub_id.gather(1, end) - first + 1
    salient = seg_salient // parts + (place < seg_salient % parts).long()
    from_end = parts - 1 - place
    shares = (parts + method.p - 1) // method.p
    context = seg_context // shares + (from_end // method.p < seg_context % shares).long()
    context = torch.where(from_end % method.p == 0, context.clamp(max=tokens // 2), 0)
    salient = torch.where(context > 0, torch.minimum(salient, tokens - context), salient.clamp(max=tokens))
    single = length == 1
    salient = torch.where(single, seg_salient, salient)
    context = torch.where(single, seg_context.clamp(max=tokens), context)
    salient = torch.where(sub_end, salient, 0)
    context = torch.where(sub_end, context, 0)
    # salient by attention; targets by DPC-kNN among the frame's other tokens
    salient_flag = descending_rank(attention.float()) < salient[..., None]
    remaining = (~salient_flag).flatten(0, 1)
    left = remaining.sum(-1)
    score, _ = density_peak_scores(x.flatten(0, 1), remaining, left.clamp(max=NEIGHBOURS),
                                   noise[None].expand(videos, -1, -1).flatten(0, 1), NEIGHBOURS)  # fmt: skip
    target_flag = (descending_rank(score).view(videos, frames, tokens) < context[..., None]) & ~salient_flag
    width = min(tokens, max(tokens // 2, max(int(retain * method.d), 1)))
    positions = torch.arange(tokens, device=device)
    targets = (positions + tokens * ~target_flag).argsort(dim=-1)[..., :width]  # ascending (the official order)
    target_valid = torch.arange(width, device=device) < context[..., None]
    same_segment = (start[:, :, None] == start[:, None, :])[:, :, None, :]  # [V, F, 1, F(a)]
    own_target = target_flag.transpose(1, 2)[:, None] & (index[0][:, None] == index[0][None, :])[None, :, None, :]
    pairs = same_segment & ~salient_flag[..., None] & ~own_target & (context > 0)[:, None, None, :]
    members = assign(x, targets, target_valid, pairs)
    weight = (1 / (members.sum(-1) + 1)).clamp(min=method.beta)
    return MergedFrames(salient_flag | target_flag, targets, target_valid, members, weight, tokens)


@dataclass(frozen=True)
class PoolingHead(Param):
    """SigLIP's attention-pooling head: None (the tower's own), a checkpoint id or directory, or a module."""

    def check(self, method: Any, name: str, value: Any) -> Any:
        if value is None or isinstance(value, (str, torch.nn.Module)) or hasattr(value, "__fspath__"):
            return value
        raise VTokenError(
            f"{method.name}: {name}={value!r} ({type(value).__name__}); expected a SigLIP checkpoint id or path "
            "(e.g. 'google/siglip-so400m-patch14-384') or a module with `post_layernorm` and `head` (a "
            "SiglipVisionModel)"
        )

    def text(self) -> str:
        return "None (the tower's own), a SigLIP checkpoint id or path, or a module with post_layernorm and head"


@dataclass
class FastVID(EncoderMethod):
    """`budget`: the retention ratio (None: the form's official value, 0.10 onevision / 0.27 qwen), or tokens per
    frame; `c`: segments at least (DySeg); `tau`: the cut threshold (None: 0.9 / 0.84); `d`: the share of context
    tokens; `p`: anchor spacing; `beta`: a merged target's least own weight; `seed`: the densities' noise;
    `variant`: "onevision" | "qwen" | None (the model's official form); `head`: SigLIP's attention-pooling head
    for the onevision form, a SigLIP checkpoint id or path (e.g. "google/siglip-so400m-patch14-384") or a module
    holding `post_layernorm` and `head` (None: the tower's own, which Hugging Face LLaVA-OneVision checkpoints lack);
    `ignore`: the qwen form's sub-segment threshold."""

    budget: Budget | None = None
    c: int = 8
    tau: float | None = None
    d: float = 0.4
    p: int = 4
    beta: float = 0.6
    seed: int = 0
    variant: str | None = None
    head: Any = None
    ignore: float = 0.95
    scope: str = "image"

    name = "fastvid"
    modalities = ("video",)
    encoder_positions = "original"  # official (LLaVA-OneVision): position_ids = keep_indexs, with gaps
    scopes = ("image",)  # budgets are shared out over each video's segments
    merges = True
    params = {
        "budget": OrNone(Kept(hint="None: the form's official value")),
        "scope": Scope(),
        "c": Int(1, hint="the least number of segments"),
        "tau": OrNone(Real("[-1, 1]", hint="a cosine similarity")),
        "d": Real("[0, 1]", hint="the share of context tokens"),
        "p": Int(1, hint="anchor frames every p frames"),
        "beta": Real("[0, 1]", hint="a merged token's least own weight"),
        "seed": Int(0, hint="the densities' noise"),
        "variant": OrNone(Choice(VARIANTS)),
        "head": PoolingHead(),
        "ignore": Real("[-1, 1]", hint="a cosine similarity"),
    }
    controls = ("budget", "c", "d", "p")
    signals_note = (
        "FastVID scores frames with SigLIP's attention-pooling head (LLaVA-OneVision) or the last ViT block's "
        "attention (Qwen-VL); CLIP towers have neither"
    )

    @property
    def requires(self) -> tuple[str, ...]:
        """The signals of the chosen form; without a variant, either form's (the family's own is used)."""
        if self.variant == "onevision":
            return ("projected", *HEAD_SIGNALS)
        if self.variant == "qwen":
            return ("projected", *QWEN_SIGNALS)
        return ("projected", "|".join((HEAD_SIGNALS[0], QWEN_SIGNALS[0])))

    def resolved(self, name: str, variant: str | None = None) -> Any:
        """`budget` or `tau` as set, else the official value of the form that runs."""
        value = getattr(self, name)
        return OFFICIAL[variant or self.variant or "onevision"][name] if value is None else value

    def planned_count(self, n: int) -> int | None:
        return None  # context quotas follow the segments

    def select(self, tokens: VisualTokens) -> Selection:
        """tokens: every frame of the call's videos ([C, T, D] frames, `image_index` = the video, frames in order);
        one host sync sizes the output."""
        if tokens.valid is not None:
            raise VTokenError("fastvid takes whole video frames; these crops have tokens that never reach the LLM")
        variant = self.variant or ("onevision" if HEAD_SIGNALS[0] in tokens.signals else "qwen")
        projected = tokens.signals["projected"]
        per_frame = tokens.num_tokens
        budget = self.resolved("budget", variant)
        keep = int(per_frame * budget) if isinstance(budget, float) else min(budget, per_frame)
        signals = HEAD_SIGNALS if variant == "onevision" else QWEN_SIGNALS
        missing = [name for name in signals if name not in tokens.signals]
        if missing:
            raise VTokenError(f"fastvid (variant {variant!r}) needs the signal(s) {missing}; this model gives "
                              f"{sorted(tokens.signals)}")  # fmt: skip

        def merge(group: slice, videos: int, frames: int) -> MergedFrames:
            x = projected[group].reshape(videos, frames, per_frame, -1)
            noise = seeded_noise(self.seed, frames, per_frame, projected.device)
            if variant == "qwen":
                attention = tokens.signals["vit_query_attention"][group].reshape(videos, frames, per_frame)
                return qwen_merge(x, attention, keep, noise, self)
            attention = tokens.signals["siglip_head_attention"][group].reshape(videos, frames, per_frame)
            pooled = tokens.signals["siglip_head_pooled"][group].float().reshape(videos, frames, -1)
            unit = pooled / pooled.norm(dim=-1, keepdim=True)
            return onevision_merge(x, attention, unit, keep, noise, self)

        return video_selection(tokens, projected, merge)


def video_selection(
    tokens: VisualTokens, projected: torch.Tensor, merge: Callable[[slice, int, int], MergedFrames]
) -> Selection:
    """Run `merge` on each run of equally long videos (consecutive in the crops; one run on LLaVA-OneVision, one
    video per call on Qwen) and pack the frames' outputs as one `Selection`: features, positions as anchors (a
    merged token stands at its target's place, `at_anchors`), counts (the one host sync), and `mix`, the same merge
    on other features aligned with the tokens."""
    if tokens.image_of_crop is not None or tokens.image_index is not None:
        videos = tokens.host_image_index()  # the adapter's host list (without it, one read of `image_index`)
    else:
        videos = [0] * tokens.num_crops
    lengths = [sum(1 for _ in run) for run in _runs(videos)]
    groups, first = [], 0
    for frames in lengths:  # consecutive videos of equal length are one batch
        if groups and groups[-1][2] == frames:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1, frames)
        else:
            groups.append((first, 1, frames))
        first += frames
    plans = [(slice(start, start + count * frames), count, frames, merge(slice(start, start + count * frames),
                                                                          count, frames))
             for start, count, frames in groups]  # fmt: skip
    width = max(plan.width for *_, plan in plans)

    def build(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, places = [], []
        for group, count, frames, plan in plans:
            x = features[group].reshape(count, frames, tokens.num_tokens, -1)
            out, positions = plan.apply(x)
            past = torch.arange(positions.shape[-1], device=positions.device) >= plan.keep.sum(-1, keepdim=True)
            positions = positions.masked_fill(past, tokens.num_tokens)  # padding rows: past the grid
            pad = width - out.shape[2]
            rows.append(torch.nn.functional.pad(out, (0, 0, 0, pad)).flatten(0, 1))
            places.append(torch.nn.functional.pad(positions, (0, pad), value=tokens.num_tokens).flatten(0, 1))
        return torch.cat(rows).to(features.dtype), torch.cat(places)

    features, positions = build(projected)
    # a merge whose outputs fall in groups (PruneVid: a window's static tokens, a frame's dynamic ones) says how
    # many each holds: read with the counts, in the one sync
    grouped = all(hasattr(plan, "kinds") for *_, plan in plans)
    reads = [plan.keep.sum(-1).flatten() for *_, plan in plans]
    reads += [plan.kinds.flatten() for *_, plan in plans] if grouped else []
    values = torch.cat(reads).tolist()  # the one sync
    crops = tokens.num_crops
    counts, sizes = values[:crops], (values[crops:] if grouped else None)

    def mix(other: torch.Tensor) -> torch.Tensor:
        return build(other)[0]

    groups = None
    if grouped:  # crop c's rows: group 2c (the static group of the window it starts) or 2c + 1 (its dynamic one)
        kind = torch.cat([nn_pad(plan.group_rows(), width).flatten(0, 1) for *_, plan in plans])
        crop = torch.arange(crops, device=kind.device)[:, None]
        groups = torch.where(positions < tokens.num_tokens, 2 * crop + kind, -1)
    return Selection(features=features, counts=counts, anchors=positions, at_anchors=True, mix=mix, groups=groups,
                     group_sizes=sizes)  # fmt: skip


def nn_pad(rows: torch.Tensor, width: int) -> torch.Tensor:
    """rows [..., n] padded on the last axis to `width` with 0."""
    return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]))


def _runs(values: list[int]):
    """Consecutive runs of equal values, as lists."""
    run: list[int] = []
    for value in values:
        if run and run[-1] != value:
            yield run
            run = []
        run.append(value)
    if run:
        yield run
