"""FrameFusion (issue 43, METHODS-4-video.md): its algorithms as tensor functions against the spec's plain
references (the ratio P over random lists and depths, a merge call's chains in both branches, the prune with ties),
a whole prefill driven call by call on a stand-in LLM (hidden states that move between call points, attention rows
from them) against the reference re-enacting the spec row by row, in a batch of rows with different videos and
non-candidates (text, a newline), the slot table of the families' frame layouts (found on the host from the
call's one layout read), the syncs a call and a whole generate cost, and the refusal of image-only models. Through
`vtoken.patch` on real models: tests/test_video_llm_wiring.py."""

import os
import random
import re
from collections import Counter

import pytest
import torch
from conftest import video_inputs
from video_references import framefusion_merge, framefusion_prune, framefusion_ratio

import vtoken
from vtoken.adapters.frames import placeholder_runs, run_edges, runs_of_edges, slot_table
from vtoken.applicability import fitting_params
from vtoken.launches import count_launches
from vtoken.methods.framefusion import (
    chain_merge,
    chain_similarity,
    patch_order,
    prune_keep,
    pruning_ratio,
)
from vtoken.tokens import MidLayerTokens
from vtoken.zoo import TINY_MODELS


@pytest.mark.parametrize("layers", [28, 32, 80])
def test_the_ratio_equals_the_formula(layers):
    rng = random.Random(layers)
    for _ in range(100):
        sparsities = [rng.uniform(0, 0.3) for _ in range(rng.randint(0, 6))]
        cost = rng.uniform(0.2, 1.0)
        assert pruning_ratio(sparsities, layers, cost) == pytest.approx(framefusion_ratio(sparsities, layers, cost))
    assert pruning_ratio([], 28, 0.3) == pytest.approx(0.7)  # no merge yet: every layer keeps cost
    assert pruning_ratio([], 28, 1.0) == 0.0
    assert pruning_ratio([0.5, 0.5], 28, 0.01) == 1.0  # spent by the merges alone: no later layer keeps any


def layout(batch_videos, text=3, newline=True):
    """A batch of rows, each [text, its videos (frames of T tokens), OneVision's newline after each, text]: the
    frame spans per row (as an adapter's `frame_spans`), the row length and the videos' (F, T)."""
    spans, lengths = [], []
    for videos in batch_videos:
        column, items = text, []
        for frames, tokens in videos:
            first = torch.arange(frames) * tokens + column
            items.append(torch.stack([first, first + tokens], 1))
            column += frames * tokens + (1 if newline else 0)
        spans.append(items)
        lengths.append(column + text)
    return spans, max(lengths)


def frames_alike(batch, length, dim, spans, g, drift=0.15):
    """Hidden states where a slot's token changes little from frame to frame (and a few slots a lot)."""
    hidden = torch.randn(batch, length, dim, generator=g)
    for row, items in enumerate(spans):
        for frames in items:
            tokens = int(frames[0, 1] - frames[0, 0])
            base = torch.randn(tokens, dim, generator=g)
            moving = torch.rand(tokens, generator=g) < 0.3
            for start, end in frames.tolist():
                base = (
                    base
                    + drift * torch.randn(tokens, dim, generator=g)
                    + moving[:, None] * torch.randn(tokens, dim, generator=g)
                )
                hidden[row, start:end] = base
    return hidden


def test_the_slot_table_follows_the_frames():
    spans, length = layout([[(3, 4), (2, 5)], [(4, 3)]])
    slots, videos, counts = slot_table(spans, 2, length, "cpu")
    assert counts == [22, 12]
    row = slots[0].tolist()
    assert row[:3] == [-1] * 3 and row[3:7] == [0, 1, 2, 3] and row[15] == -1  # text, a frame, the newline
    assert videos[0, 16].item() == 1 and slots[0, 16:21].tolist() == [0, 1, 2, 3, 4]
    assert (slots[1, 15:] == -1).all()


def test_the_slot_table_is_built_on_the_host_and_copied_once():
    spans, length = layout([[(3, 4), (2, 5)], [(4, 3)]])
    pairs = [[[tuple(frame) for frame in video.tolist()] for video in row] for row in spans]
    with count_launches() as counted:
        slots, videos, counts = slot_table(pairs, 2, length, "cpu")
    assert counted.syncs == 0 and counted.kernels <= 1, counted.describe()
    want = slot_table(spans, 2, length, "cpu")
    assert torch.equal(slots, want[0]) and torch.equal(videos, want[1]) and counts == want[2] == [22, 12]


def test_the_runs_read_with_the_layout_equal_the_prompts_runs():
    """`run_edges` (on the device, no sync) read to the host gives `placeholder_runs`; a row with more runs than
    the width the call's videos make matches none."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        mask = torch.rand(3, 17, generator=g) < torch.rand(1, generator=g)
        runs = placeholder_runs(mask)
        most = max([sum(1 for r, _, _ in runs if r == row) for row in range(3)])
        with count_launches() as counted:
            edges = run_edges(mask, most + 1)
        assert counted.syncs == 0, counted.describe()
        assert runs_of_edges(edges.tolist()) == runs
        if most:
            assert runs_of_edges(run_edges(mask, most - 1).tolist()) is None


@pytest.mark.parametrize("threshold, u", [(0.6, 0.9), (0.6, 0.05), (-1.0, 0.4)])
def test_a_merge_call_equals_the_spec(threshold, u):
    """Threshold branch (r < u), top-k branch (r >= u) and top-k with every pair alike."""
    g = torch.Generator().manual_seed(0)
    spans, length = layout([[(4, 5), (3, 5)], [(5, 4)]])
    hidden = frames_alike(2, length, 8, spans, g)
    slots, videos, counts = slot_table(spans, 2, length, "cpu")
    order, chain = patch_order(slots, videos, counts)
    similarity = chain_similarity(hidden, order, chain)
    flags = similarity >= threshold
    for row in range(2):
        n = counts[row]
        r = int(flags[row, :n].sum()) / n
        if r >= u:  # the top-k branch: the int(u n) most similar
            eligible = similarity[row] > -2
            ranked = similarity[row].masked_fill(~eligible, float("-inf")).argsort(descending=True, stable=True)
            flags[row] = torch.zeros_like(flags[row]).scatter(0, ranked[: int(u * n)], True) & eligible
    states, keep = chain_merge(hidden, order, flags & (order >= 0))
    for row in range(2):
        tokens = [(j, int(videos[row, j]), int(slots[row, j])) for j in range(length) if slots[row, j] >= 0]
        want, *_ = framefusion_merge(tokens, {j: hidden[row, j].double() for j, _, _ in tokens}, threshold, u, 0.1)
        n = counts[row]
        got = {int(order[row, i]): states[row, i] for i in range(n) if keep[row, i]}
        assert sorted(got) == sorted(want)
        for j in want:
            torch.testing.assert_close(got[j].double(), want[j], atol=1e-5, rtol=1e-5)


def test_the_prune_keeps_the_best_with_ties_to_the_lower_index():
    scores = torch.tensor([[0.2, 0.5, 0.5, 0.1, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    columns = torch.tensor([[9, 4, 7, 1, 2, 0], [3, 2, 1, 0, 5, 6]])
    valid = torch.tensor([[True] * 5 + [False], [True] * 4 + [False] * 2])
    keep = prune_keep(scores, columns, valid, [2, 3])
    for row, count in enumerate([2, 3]):
        want = framefusion_prune({int(columns[row, i]): float(scores[row, i]) for i in range(6) if valid[row, i]},
                                 count)  # fmt: skip
        assert sorted(int(columns[row, i]) for i in range(6) if keep[row, i]) == want


# --------------------------------------------------------------------------- a prefill on a stand-in LLM
def evolve(states, call, weights):
    """The stand-in for layer call - 1 up to its attention: every token moves by a fixed map of its own state."""
    return states + 0.5 * torch.tanh(states @ weights[call])


def attention_rows(states, alive, rows):
    """[R, L]: causal softmax attention (one head) of the last `rows` alive tokens over the alive tokens."""
    index = alive.nonzero().squeeze(1)
    queries = index[-rows:]
    logits = states[queries] @ states.T / states.shape[1] ** 0.5
    causal = (torch.arange(states.shape[0])[None, :] <= queries[:, None]) & alive[None, :]
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)


def run_by_hand(hidden, slots, videos, layers, settings, weights, rows):
    """The spec re-enacted row by row (fp64): survivors {sequence index: state} and the log of each row."""
    out = []
    for row in range(hidden.shape[0]):
        length = hidden.shape[1]
        states = hidden[row].double().clone()
        alive = torch.ones(length, dtype=torch.bool)
        cands = {j: (j, int(videos[row, j]), int(slots[row, j])) for j in range(length) if slots[row, j] >= 0}
        sparsities, phase, log = [], "merge", []
        for call in range(layers + 1):  # every call point; a row done passes through
            if call:
                states = evolve(states, call, {k: w.double() for k, w in weights.items()})
            if phase == "done":
                continue
            if phase == "prune":
                ratio = framefusion_ratio(sparsities, layers, settings["cost"])
                probs = attention_rows(states, alive, rows).mean(0)
                kept = framefusion_prune({j: float(probs[j]) for j in cands}, round(len(cands) * (1 - ratio)))
                for j in set(cands) - set(kept):
                    alive[j] = False
                    del cands[j]
                log.append(("prune", call, len(cands)))
                phase = "done"
                continue
            if call == layers:
                continue
            u = framefusion_ratio(sparsities, layers, settings["cost"])
            merged, r, branch, due = framefusion_merge(list(cands.values()), states, settings["threshold"], u,
                                                       settings["ratio_floor"])  # fmt: skip
            for j in set(cands) - set(merged):
                alive[j] = False
                del cands[j]
            for j, state in merged.items():
                states[j] = state
            log.append((branch, call, len(cands)))
            if branch == "top-k":
                phase = "done"
            else:
                sparsities.append(r)
                phase = "done" if call == layers - 1 else "prune" if due else "merge"
        out.append(({j: states[j] for j in range(length) if alive[j]}, log))
    return out


def run_vtoken(method, hidden, slots, videos, counts, layers, weights, rows):
    """A minimal engine driving `FrameFusion.start` / `step` on the stand-in: the sequence stays whole (dropped
    tokens are marked), candidates kept in patch order by compaction. Returns the same as `run_by_hand` and the run."""
    batch, length, _ = hidden.shape
    states, alive = hidden.clone(), torch.ones(batch, length, dtype=torch.bool)
    order, chain = patch_order(slots, videos, counts)
    run = method.start(batch, layers)
    logs = [[] for _ in range(batch)]
    for call in range(layers + 1):  # every call point: rows done pass through
        if call:
            states = evolve(states, call, weights)
        attention = None
        if any(run.wants_attention(call)):
            attention = torch.zeros(batch, rows, order.shape[1])
            for row in range(batch):
                probs = attention_rows(states[row], alive[row], rows)
                attention[row] = probs.gather(1, order[row].clamp(min=0).expand(rows, -1))
        step = method.step(run, MidLayerTokens(call, states, order, chain, order, list(counts), attention))
        if step.states is not None:
            place = order.clamp(min=0)[..., None].expand(-1, -1, states.shape[-1])
            merged = torch.where((order >= 0)[..., None], step.states, states.gather(1, place))
            states = states.scatter(1, place, merged)
        dropped = (order >= 0) & ~step.keep
        alive = alive & ~torch.zeros_like(alive).scatter(1, order.clamp(min=0), dropped)
        compact = (~step.keep).long().argsort(dim=1, stable=True)  # kept first, in patch order
        counts = step.kept
        width = max(max(counts), 1)
        valid = torch.arange(width) < torch.tensor(counts)[:, None]
        order = order.gather(1, compact)[:, :width].masked_fill(~valid, -1)
        chain = chain.gather(1, compact)[:, :width].masked_fill(~valid, -1)
    for row in range(batch):
        for entry in run.log[row]:
            logs[row].append((entry.get("branch", entry.get("what")), entry["call"], entry["after"]))
    return [({j: states[row, j] for j in range(length) if alive[row, j]}, logs[row]) for row in range(batch)], run


@pytest.mark.parametrize(
    "settings",
    [
        dict(cost=0.3, threshold=0.6, ratio_floor=0.1),  # official: merges, then the prune
        dict(cost=0.3, threshold=0.97, ratio_floor=0.1),  # little alike: merging ends at once, the prune
        dict(cost=0.5, threshold=0.3, ratio_floor=0.0),  # much alike: the top-k branch ends everything
        dict(cost=0.7, threshold=0.99, ratio_floor=0.0),  # merging runs to the last call point L - 1: no prune
    ],
)
def test_a_prefill_equals_the_spec_call_by_call(settings):
    g = torch.Generator().manual_seed(1)
    layers, dim, rows = 5, 12, 2
    spans, length = layout([[(4, 5), (3, 5)], [(5, 4)]])
    hidden = frames_alike(2, length, dim, spans, g, drift=0.2)
    weights = {c: torch.randn(dim, dim, generator=g) * 0.05 for c in range(1, layers + 1)}
    slots, videos, counts = slot_table(spans, 2, length, "cpu")
    method = vtoken.FrameFusion(**settings, rows=rows)
    got, run = run_vtoken(method, hidden, slots, videos, counts, layers, weights, rows)
    want = run_by_hand(hidden, slots, videos, layers, settings, weights, rows)
    if settings["threshold"] == 0.99:  # every row merged at every call point, then stopped without a prune
        assert all([entry[1] for entry in log] == list(range(layers)) for _, log in got)
    for (states, log), (ref_states, ref_log) in zip(got, want, strict=True):
        assert log == ref_log
        assert sorted(states) == sorted(ref_states)
        for j in ref_states:
            torch.testing.assert_close(states[j].double(), ref_states[j], atol=1e-4, rtol=1e-4)
    assert all(0 < run.cost(row) <= 1 for row in range(2))


def test_a_merge_call_reads_the_device_once_and_a_prune_not_at_all():
    g = torch.Generator().manual_seed(2)
    spans, length = layout([[(4, 5)], [(4, 5)]])
    hidden = frames_alike(2, length, 8, spans, g)
    slots, videos, counts = slot_table(spans, 2, length, "cpu")
    order, chain = patch_order(slots, videos, counts)
    method = vtoken.FrameFusion(threshold=1.0)  # nothing alike: merging ends at call 0, the prune is due
    run = method.start(2, 4)
    with count_launches() as counted:
        method.step(run, MidLayerTokens(0, hidden, order, chain, order, counts))
    assert counted.syncs == 1, counted.describe()
    assert run.wants_attention(1) == [True, True]
    attention = torch.rand(2, 1, order.shape[1])
    with count_launches() as counted:
        step = method.step(run, MidLayerTokens(1, hidden, order, chain, order, counts, attention))
    assert counted.syncs == 0, counted.describe()
    assert step.keep.sum(1).tolist() == step.kept and run.done


def _site(site: str) -> str:
    """'file (function)' of a counter's 'op at path:line (function)'."""
    match = re.match(r"(?:.* at )?(.*):\d+ \((.*)\)$", site)
    return f"{os.path.basename(match.group(1))} ({match.group(2)})" if match else site


@pytest.mark.parametrize("beams", [1, 2])
def test_a_generate_reads_the_layout_once_and_each_merge_call_once(beams):
    """A patched generate of 3 tokens on the tiny OneVision (2 layers: 2 merge calls) reads the device at the
    call's layout read (where the frames sit comes with it) and once per merge call, nowhere else: no forward or
    decoding step reads the prompt's frames (rows repeated for beams too)."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = video_inputs(processor, 4)
    generate = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, num_beams=beams)
    method = vtoken.make_method("framefusion", **fitting_params(model, "framefusion"))
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        model.generate(**inputs, **generate)  # warm: per-shape caches
        with count_launches() as counted:
            model.generate(**inputs, **generate)
        merges = [r for r in handle.records if r.stage.startswith("prefill.merge")]
    ours = Counter(_site(s) for s in counted.sync_sites if f"vtoken{os.sep}" in s.split(" at ")[-1])
    assert ours == Counter({"calls.py (note_layout)": 1, "framefusion.py (step)": 2}), counted.describe()
    assert len({r.stage for r in merges}) == 2


def test_parameters_and_the_refusal_of_image_only_models():
    for bad, match in [(dict(cost=0), "cost"), (dict(cost=3), "cost"), (dict(threshold=2), "threshold=2"),
                       (dict(ratio_floor=-0.1), "ratio_floor=-0.1"), (dict(num_layers=0), "num_layers=0"),
                       (dict(rows=0), "rows=0")]:  # fmt: skip
        with pytest.raises(vtoken.VTokenError, match=match):
            vtoken.FrameFusion(**bad)
    assert vtoken.FrameFusion().query_count("qwen2-vl") == 4 and vtoken.FrameFusion().query_count("internvl") == 1
    image_only, _ = TINY_MODELS["tiny-llava"]()
    with pytest.raises(vtoken.VTokenError, match="video inputs only"):
        vtoken.patch(image_only, "framefusion")
