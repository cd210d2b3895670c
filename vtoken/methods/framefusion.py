"""FrameFusion: combining similarity and importance for video token reduction on large vision language models (Fu et
al., ICCV 2025; official code thu-nics/FrameFusion @fbec1d2, MIT; METHODS-4-video.md).

Inside the LLM's prefill, on the video tokens ("candidates"; each has a slot, its index inside its frame, and its
video), with L = the LLM's depth (`num_layers`):

- Call points: call 0 before layer 0's attention (the LLM's input), call c >= 1 after layer c - 1's attention
  (residual added), before its MLP.
- Ratio: P(s_1..s_n) = 0 if need > 1 else 1 - need, need = (L * cost - sum_{i=1..n} f_i) / ((L - n) f_n), f_i =
  prod_{m <= i} (1 - s_m): the sparsity every remaining layer needs for the mean visual fraction over L layers to
  be `cost` (`pruning_ratio`).
- Merge call (while merging): u = P(list). In patch order (candidates sorted by video, slot, sequence position),
  sim_i = cos(h_o(i-1), h_o(i)) of the current hidden states when both share video and slot, else -2; flags = sim
  >= `threshold`; r = #flags / N. If r < u: r joins the list, and merging ends (the prune is due) once r <
  `ratio_floor`; else the int(u N) largest sims are the flags and merging and pruning end. Every flagged token
  joins its chain head (the nearest unflagged token before it: frame-to-frame chains), which becomes the plain
  mean of itself and its members (current states); the members leave; the head keeps its (earliest) position.
- Merging stops at call L - 1 (after layer L - 2's attention: the ratio has no layer left to spread over after
  it), with no prune.
- Prune (once, after the attention of the layer that follows the call that ended merging): score = the layer's
  causal softmax attention (post-rotary), mean over heads and the last `rows` prompt tokens, over the current
  candidates; the round(N (1 - P(list))) best stay (half to even; ties: the lower index), in sequence order.
- Caches hold what each layer's attention saw; positions stay the original ones; decoding continues at the
  unpruned length.

vtoken's LLM engine runs the call points (`calls = ("mid_layer",)`: call 0 on the LLM's input, call c inside layer
c - 1, whose forward it splits at the residual); the method's algorithms are pure tensor functions here
(`patch_order`, `chain_similarity`, `top_similar`, `chain_merge`, `prune_keep`, `pruning_ratio`), and
`FrameFusion.start` / `FrameFusion.step` drive one prefill's calls on what the engine hands over (`MidLayerTokens`:
the candidates in patch order, compacted after every call, the attention rows when a prune is due).

Differences from the official code (docs/differences.md): L = the LLM's depth (the official hard-codes 28:
`num_layers=28` reproduces it); merging stops at the last layer (the official divides by zero at n = L); batches of
any size, every video of every row (the official: batch 1, one video); candidates are the video tokens only
(the official prunes a contiguous span, InternVL's frame text included); the top-k branch never flags a chain's
first token (which would merge it across slots); similarities, sums and means in fp32 (the official: the hidden
dtype, "numerical instability" per its comment); the prune reads any attention implementation (the official
needs SDPA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import VTokenError
from ..geometry.tables import on_device
from ..params import Int, Kept, OrNone, Real
from ..tokens import LayerTokens, MidLayerStep, MidLayerTokens
from .base import PrefillMethod

PHASES = ("merge", "prune", "done")


def pruning_ratio(sparsities: Sequence[float], layers: int, cost: float) -> float:
    """P(list): the sparsity every remaining layer needs so that the visual tokens' mean fraction over `layers`
    layers is `cost`, after merge calls that removed the fractions `sparsities` (n of them, n < layers); 1 once the
    merges alone kept more than the cost (data decides it, mid-prefill: the official code raises there)."""
    n = len(sparsities)
    if n >= layers:
        raise VTokenError(f"framefusion: {n} merge calls for an LLM of {layers} layers; at most {layers - 1}")
    fraction, spent = 1.0, 0.0
    for s in sparsities:
        fraction *= 1 - s
        spent += fraction
    left = layers * cost - spent
    if left < 0:  # the merges alone kept more than the cost (the official raises): no layer left keeps any
        return 1.0
    need = left / ((layers - n) * fraction)
    return 0.0 if need > 1 else 1 - need


def patch_order(slots: torch.Tensor, videos: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The patch order, once per prefill: slots, videos [B, C] (-1: not a candidate) of the current sequence.
    Returns (order [B, P] the sequence index of each candidate sorted by (video, slot, sequence index), -1 past a
    row's count; chain [B, P] its chain (video and slot as one key), -1 past the count). P = max(counts)."""
    batch, length = slots.shape
    width = max(max(counts, default=0), 1)
    span = int(length) + 1
    chain = torch.where(slots >= 0, videos * span + slots, span * span)  # non-candidates last
    order = (chain * span + torch.arange(length, device=slots.device)).argsort(dim=-1)[:, :width]
    valid = torch.arange(width, device=slots.device) < on_device(counts, slots.device)[:, None]
    return order.masked_fill(~valid, -1), chain.gather(1, order).masked_fill(~valid, -1)


def chain_similarity(hidden: torch.Tensor, order: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """[B, P] fp32: cosine of each candidate's hidden state [B, C, D] with its predecessor in patch order when both
    are in one chain (video and slot), else -2 (a chain's first token, padding)."""
    states = hidden.float().gather(1, order.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
    unit = states / states.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    cos = (unit[:, 1:] * unit[:, :-1]).sum(-1)
    linked = (chain[:, 1:] == chain[:, :-1]) & (chain[:, 1:] >= 0)
    return torch.cat([torch.full_like(cos[:, :1], -2.0), torch.where(linked, cos, -2.0)], dim=1)


def top_similar(similarity: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, P] bool: each row's counts[b] largest similarities (ties: the lower patch index) among the tokens with a
    predecessor in their chain (similarity > -2)."""
    batch, width = similarity.shape
    ranked = similarity.masked_fill(similarity <= -2, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    top = torch.arange(width, device=similarity.device) < on_device(counts, similarity.device)[:, None]
    flags = torch.zeros(batch, width, dtype=torch.bool, device=similarity.device).scatter(1, ranked, top)
    return flags & (similarity > -2)


def chain_merge(hidden: torch.Tensor, order: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One merge: every flagged candidate (in patch order [B, P]) joins the nearest unflagged candidate before it
    (its chain head, a prefix-max scan), which becomes the plain mean of itself and its members. Returns (states
    [B, P, D] fp32: the heads' new states, others unchanged; keep [B, P] bool: the unflagged ones)."""
    batch, width = order.shape
    device = hidden.device
    states = hidden.float().gather(1, order.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
    index = torch.arange(width, device=device).expand(batch, -1)
    head = torch.where(flags, -1, index).cummax(dim=1).values.clamp(min=0)  # a chain's first token is unflagged
    sums = torch.zeros_like(states).scatter_add_(1, head[..., None].expand_as(states), states)
    count = torch.zeros(batch, width, device=device).scatter_add_(1, head, torch.ones(batch, width, device=device))
    merged = sums / count.clamp(min=1)[..., None]
    return torch.where(flags[..., None], states, merged), ~flags


def prune_keep(scores: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, P] bool: each row's counts[b] best candidates by `scores` [B, P] (ties: the lower sequence index
    `columns` [B, P]), among `valid` [B, P]."""
    batch, width = scores.shape
    device = scores.device
    by_column = columns.masked_fill(~valid, columns.shape[1] + width).argsort(dim=-1)  # sequence order
    ranked = scores.float().gather(1, by_column).masked_fill(~valid.gather(1, by_column), float("-inf"))
    ranked = by_column.gather(1, ranked.argsort(dim=-1, descending=True, stable=True))
    top = torch.arange(width, device=device) < on_device(counts, device)[:, None]
    return torch.zeros(batch, width, dtype=torch.bool, device=device).scatter(1, ranked, top) & valid


@dataclass
class FusionRun:
    """One prefill's FrameFusion state, per row: the sparsities of its merge calls, its phase ("merge", then
    "prune" when due, then "done") and the log of its calls (call, what, r, u, tokens before and after)."""

    layers: int
    sparsities: list[list[float]]
    phase: list[str]
    log: list[list[dict]] = field(default_factory=list)

    def wants_attention(self, call: int) -> list[bool]:
        """Rows whose prune is due at call point `call`: the engine reads layer call - 1's attention for them."""
        return [phase == "prune" and call >= 1 for phase in self.phase]

    @property
    def done(self) -> bool:
        return all(phase == "done" for phase in self.phase)

    def cost(self, row: int) -> float:
        """The achieved mean visual fraction over the layers (1 = nothing removed), from the row's log."""
        fraction, total, last = 1.0, 0.0, 0
        for entry in self.log[row]:
            total += fraction * (entry["call"] - last)
            fraction *= entry["after"] / max(entry["before"], 1)
            last = entry["call"]
        return (total + fraction * (self.layers - last)) / self.layers


@dataclass
class FrameFusion(PrefillMethod):
    """`cost`: the mean share of the video tokens each LLM layer keeps (official 0.3); `threshold`: the similarity
    from which consecutive frames' tokens at one slot merge (0.6, LLaVA-Video-7B); `ratio_floor`: merging stops
    once a call merges a smaller share (0.1); `num_layers`: the depth the ratio spreads over (None: the LLM's own;
    the official hard-codes 28); `rows`: the prompt's last tokens whose attention scores the prune (None: 4 on
    Qwen2-VL, else 1, as the official)."""

    cost: float = 0.3
    threshold: float = 0.6
    ratio_floor: float = 0.1
    num_layers: int | None = None
    rows: int | None = None

    name = "framefusion"
    stages = ("prefill",)
    modalities = ("video",)
    merges = True
    positions = "original"  # a merged token keeps its head's (the earliest frame's) position
    calls = ("mid_layer",)  # before layer 0 and after every layer's attention, before its MLP
    reads = ()
    params = {
        "cost": Kept(counts=False, hint="the mean share of the video tokens the LLM's layers keep"),
        "threshold": Real("[-1, 1]", hint="a cosine similarity"),
        "ratio_floor": Real("[0, 1]", hint="merging stops below this share merged"),
        "num_layers": OrNone(Int(1, hint="the depth the cost spreads over (None: the LLM's)")),
        "rows": OrNone(Int(1, hint="prompt tokens whose attention scores the prune (None: 4 on Qwen2-VL, else 1)")),
    }
    budget_param = "cost"
    controls = ("cost", "threshold", "ratio_floor")

    def query_count(self, family: str) -> int:
        """How many of the prompt's last tokens score the prune on `family` (official: 4 on Qwen2-VL, else 1)."""
        return self.rows if self.rows is not None else (4 if family == "qwen2-vl" else 1)

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        return ()  # it acts at its call points, not after whole layers

    def candidate_order(self, slots: torch.Tensor, videos: torch.Tensor, counts: list[int]):
        """The patch order (`patch_order`): by video, slot, then sequence index; chains = video and slot."""
        return patch_order(slots, videos, counts)

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        raise VTokenError("framefusion acts at its own call points (FrameFusion.step), not after whole layers")

    # ----------------------------------------------------------------- one prefill, call by call
    def start(self, batch: int, num_layers: int) -> FusionRun:
        """The state of a prefill of `batch` rows through an LLM of `num_layers` layers."""
        layers = self.num_layers if self.num_layers is not None else num_layers
        return FusionRun(layers, [[] for _ in range(batch)], ["merge"] * batch, [[] for _ in range(batch)])

    def step(self, run: FusionRun, tokens: MidLayerTokens) -> MidLayerStep:
        """Call point `tokens.call` (0..L - 1): merge calls for the rows still merging (the last one ends merging
        without a prune), the prune for the rows whose prune is due. One host read per call that merges (how many each
        row's threshold flags: r decides the branch and the count); the prune's counts are host-known."""
        call, counts = tokens.call, tokens.counts
        batch, width = tokens.order.shape
        valid = tokens.order >= 0
        keep = valid.clone()
        states, kept = None, list(counts)
        merging = [phase == "merge" and call < run.layers for phase in run.phase]  # calls 0..L - 1
        if any(merging):
            similarity = chain_similarity(tokens.hidden, tokens.order, tokens.chain)
            flags = (similarity >= self.threshold) & valid
            read = torch.stack([flags.sum(1), (similarity > -2).sum(1)], 1).tolist()  # the call's one host read
            flagged, linked = [f for f, _ in read], [n for _, n in read]
            top, chosen = [0] * batch, [False] * batch
            for row in range(batch):
                if not merging[row]:
                    continue
                n = counts[row]
                u = pruning_ratio(run.sparsities[row], run.layers, self.cost)
                r = flagged[row] / n if n else 0.0
                entry = {"call": call, "r": r, "u": u, "before": n}
                if r < u:
                    run.sparsities[row].append(r)
                    entry["branch"], kept[row] = "threshold", n - flagged[row]
                    if call == run.layers - 1:  # the last call point with a layer after it: nothing left to prune
                        run.phase[row] = "done"
                    elif r < self.ratio_floor:
                        run.phase[row] = "prune"
                else:
                    top[row], chosen[row] = int(u * n), True
                    entry["branch"] = "top-k"
                    run.phase[row] = "done"
                run.log[row].append(entry)
            if any(chosen):
                rows = on_device([int(c) for c in chosen], flags.device).bool()[:, None]
                flags = torch.where(rows, top_similar(similarity, top), flags)
                for row in range(batch):
                    if chosen[row]:  # only tokens with a predecessor in their chain can merge
                        kept[row] = counts[row] - min(top[row], linked[row])
            flags &= on_device([int(m) for m in merging], flags.device).bool()[:, None]
            states, keep = chain_merge(tokens.hidden, tokens.order, flags)
            keep &= valid
            for row in range(batch):
                if merging[row]:
                    run.log[row][-1]["after"] = kept[row]
        due = [phase == "prune" and not merging[row] for row, phase in enumerate(run.phase)]
        if any(due):
            if tokens.attention is None:
                raise VTokenError(f"framefusion: the prune at call {call} needs the layer's attention rows")
            rows = tokens.attention.float()
            if tokens.row_valid is not None:
                rows = rows * tokens.row_valid[..., None]
                scores = rows.sum(1) / tokens.row_valid.sum(1, keepdim=True).clamp(min=1)
            else:
                scores = rows.mean(1)
            targets = [0] * batch
            for row in range(batch):
                if due[row]:
                    ratio = pruning_ratio(run.sparsities[row], run.layers, self.cost)
                    targets[row] = round(counts[row] * (1 - ratio))
                    run.log[row].append({"call": call, "what": "prune", "p": ratio, "before": counts[row],
                                         "after": targets[row]})  # fmt: skip
                    run.phase[row] = "done"
                    kept[row] = targets[row]
                else:
                    targets[row] = counts[row]
            pruned = prune_keep(scores, tokens.columns, valid, targets)
            pruning = on_device([int(d) for d in due], pruned.device).bool()[:, None]
            keep = torch.where(pruning, pruned, keep)
        return MidLayerStep(keep, states, kept)
