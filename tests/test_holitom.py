"""HoliTom (issue 34, METHODS-3-video.md): the global window search, static and dynamic merges against the plain
reference of `video_references.py` on synthetic videos (scene cuts giving one-frame windows, long windows,
max_window, d > 0, count budgets, several videos in one call) and on the tiny video models (OneVision official:
the tower's attention recomputed eagerly, what reaches the LLM in HoliTom's order; Qwen-VL an extension: a static
token at its window's first frame's (t, h, w); Qwen3-VL's DeepStack merged alike), records, padded batches,
refusals, and the kernels and syncs a selection costs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_batch_equals_one_by_one,
    assert_greedy_matches,
    feed_language_model,
    greedy,
    video_inputs,
)
from test_fastvid import assert_frames_equal, qwen_block_query_keys, raster_order, sharpened_onevision
from test_qwen_vl import _prompt, _reference_generate
from test_vidcom2 import _clip, _placed
from video_references import holitom, windows

import vtoken
from vtoken.kernels import static_windows_reference
from vtoken.launches import count_launches
from vtoken.methods.holitom import window_gains
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def synthetic(frames, tokens=20, dim=10, seed=0, cut_every=4):
    """Videos of scenes that stay still at some positions and move at others, with a cut every `cut_every` frames
    (so one-frame windows appear where a scene has a single frame)."""
    g = torch.Generator().manual_seed(seed)
    x = []
    for count in frames:
        for f in range(count):
            if f % cut_every == 0:
                scene = torch.randn(tokens, dim, generator=g)
                still = torch.rand(tokens, generator=g) < 0.6
            moved = scene + torch.randn(tokens, dim, generator=g) * torch.where(still, 0.05, 1.0)[:, None]
            x.append(moved)
    x = torch.stack(x)
    attention = torch.rand(len(x), tokens, generator=g)
    return x, attention, torch.arange(len(frames)).repeat_interleave(torch.tensor(frames))


SETTINGS = [
    dict(),  # official: 0.10, tau 0.8, beta 0.6, k 7, d 0
    dict(budget=0.3, tau=0.5),
    dict(budget=0.3, tau=0.5, max_window=2),  # windows of at most 2 frames
    dict(budget=0.4, tau=0.6, d=0.5, k=3),  # dynamic density-peak centres (d > 0)
    dict(budget=5, tau=0.7, beta=0.2, seed=4),  # a count budget: tokens per frame on average
    dict(budget=1.0, tau=1.0),  # nothing static (no cosine above 1): each frame keeps all
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_random_videos_equal_the_reference(settings):
    """Videos of 9, 1, 6 and 9 frames in one call (runs of equal lengths batched together)."""
    frames = [9, 1, 6, 9]
    x, attention, videos = synthetic(frames)
    signals = {"projected": x, "tower_attention": attention}
    selection = vtoken.HoliTom(**settings).select(VisualTokens(x, (4, 5), signals, videos))
    first = 0
    for count in frames:
        part = slice(first, first + count)
        expected, _ = holitom(x[part], attention[part], **settings)
        assert_frames_equal(selection, first, expected)
        first += count


def test_windows_follow_the_static_positions():
    """Frames 0-2 one still scene, frame 3 a cut, frames 4-5 another still scene: windows (0, 2), (3, 3), (4, 5);
    the static positions of (0, 2) are kept once, as centres, at the first frame."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g)
    x = torch.stack([a, a, a, torch.randn(16, 6, generator=g), b, b]) + 0.01 * torch.randn(6, 16, 6, generator=g)
    x[1:3, :4] = torch.randn(2, 4, 6, generator=g)  # positions 0-3 move within the first scene
    _, gain = window_gains(F.cosine_similarity(x[:-1], x[1:], dim=-1)[None] > 0.8)
    start, removed = static_windows_reference(gain, 1024)
    assert start[0].tolist() == [0, 0, 0, 3, 4, 4] and removed.item() == 2 * 12 + 16
    expected, found = holitom(x, torch.rand(6, 16, generator=g), budget=0.5)
    assert found == [(0, 2), (3, 3), (4, 5)]
    signals = {"projected": x, "tower_attention": torch.zeros(6, 16)}
    selection = vtoken.HoliTom(budget=0.5).select(VisualTokens(x, (4, 4), signals))
    assert selection.counts[1] == selection.counts[2]  # frames 1, 2: dynamic positions only (0-3)
    assert set(selection.anchors[0, : selection.counts[0]].tolist()) >= set(selection.anchors[1, :4].tolist())


def test_the_window_search_equals_the_spec_with_ties_and_max_window():
    """The kernel's reference against the spec's recursion on random integer gains (many ties)."""
    g = torch.Generator().manual_seed(0)
    for frames, max_window in [(1, 4), (7, 1024), (12, 3), (9, 2)]:
        alike = torch.rand(frames - 1, 5, generator=g) < 0.7
        _, gain = window_gains(alike[None])
        start, removed = static_windows_reference(gain, max_window)
        found, best = windows(alike.tolist(), frames, 5, max_window)
        expected = [s for s, e in found for _ in range(s, e + 1)]
        assert start[0].tolist() == expected and removed.item() == best


def test_selection_is_batched_with_one_sync():
    """A fixed number of kernels whatever the frame count (the window search is one custom op) and one sync (the
    counts); the tokens are an adapter's, the video of every frame given on the host too (`image_of_crop`)."""
    counts = []
    for frames, settings in [([4], {}), ([12], {}), ([7], dict(budget=0.3, tau=0.5)), ([6, 6], {})]:
        x, attention, videos = synthetic(frames, seed=sum(frames))
        tokens = VisualTokens(x, (4, 5), {"projected": x, "tower_attention": attention}, videos,
                              image_of_crop=videos.tolist())  # fmt: skip
        with count_launches() as counted:
            vtoken.HoliTom(**settings).select(tokens)
        assert counted.syncs == 1 and "fastvid.py" in counted.sync_sites[0], counted.describe()
        assert counted.ops["vtoken::static_windows"] == 1
        counts.append(counted.kernels)
    assert len(set(counts[:3])) == 1 and counts[3] <= counts[0] + 4, counts  # two videos: one batch of both


def test_parameters_are_validated():
    for bad, match in [(dict(tau=2.5), "tau=2.5"), (dict(beta=-1), "beta=-1"), (dict(k=0), "k=0"),
                       (dict(d=1.5), "d=1.5"), (dict(max_window=0), "max_window=0"), (dict(budget=1.5), "budget"),
                       (dict(seed=0.5), "seed=0.5"),
                       (dict(inner_ratio=2), "inner_ratio=2"), (dict(inner_layer=0), "inner_layer=0"),
                       (dict(inner_layer=1.5), "inner_layer=1.5")]:  # fmt: skip
        with pytest.raises(vtoken.VTokenError, match=match):
            vtoken.HoliTom(**bad)


# --------------------------------------------------------------------------- on the tiny models
def eager_tower_attention(tower, pixel_values):
    """Independent HoliTom signal: an eager copy of the SigLIP tower run with output_attentions; the last layer's
    map, mean over heads then queries, pooled with F.interpolate like the tokens."""
    config = copy.deepcopy(tower.config)
    config._attn_implementation = "eager"
    eager = type(tower)(config).eval()
    eager.load_state_dict(tower.state_dict())
    with torch.no_grad():
        maps = eager(pixel_values.flatten(0, 1), output_attentions=True).attentions[-1]
    received = maps.mean(1).mean(1)
    side = int(received.shape[1] ** 0.5)
    return F.interpolate(received.view(-1, 1, side, side), size=(side + 1) // 2, mode="bilinear").flatten(1)


@pytest.fixture(scope="module")
def onevision():
    return sharpened_onevision()


@pytest.mark.parametrize("frames, settings", [(6, {}), (8, dict(budget=0.3, tau=0.3)), (5, dict(budget=0.25, tau=0.4,
                                                                                                d=0.5))])  # fmt: skip
def test_onevision_equals_the_reference_and_the_llm_fed_by_hand(onevision, frames, settings):
    model, processor = onevision
    inputs = video_inputs(processor, frames)
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    attention = eager_tower_attention(model.model.vision_tower, inputs["pixel_values_videos"])
    expected, found = holitom(tokens, attention, **settings)
    with torch.no_grad(), vtoken.patched(model, vtoken.HoliTom(**settings)) as handle:
        logits = model(**inputs).logits
    records = handle.records
    assert [(r.modality, r.crop, r.tokens_in) for r in records] == [("video", f, 196) for f in range(frames)]
    assert [r.kept.tolist() for r in records] == [sorted(j for j, _ in rows) for rows in expected]
    visual = torch.cat([torch.stack([v for _, v in rows]).float() for rows in expected if rows] + [placed[-1:]])
    ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-4
    if settings:
        assert any(e > s for s, e in found)  # a window of several frames took part


def _qwen_received_attention(model, inputs):
    """Independent HoliTom-on-Qwen signal: the last full-attention block's q/k recomputed from its input, the
    eager attention per temporal patch, mean over heads and queries, then over each merge group; raster order."""
    visual = model.model.visual
    full = getattr(visual, "fullatt_block_indexes", None)
    q, k = qwen_block_query_keys(model, inputs, visual.blocks[full[-1] if full is not None else -1].attn)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    heads, dim = q.shape[1:]
    q, k = q.view(t, h * w, heads, dim), k.view(t, h * w, heads, dim)
    probs = torch.einsum("tihd,tjhd->thij", q, k).mul(dim**-0.5).softmax(-1).mean((1, 2))  # [t, patches]
    return raster_order(model, inputs, probs.view(t, -1, 4).mean(-1))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_qwen_extension_keeps_original_positions(name):
    """A static token stands at its window's first frame's (t, h, w); dynamic tokens at their own."""
    model, processor = TINY_MODELS[name]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    tokens = placed.view(t, h * w // 4, -1)
    attention = _qwen_received_attention(model, inputs)
    settings = dict(budget=0.4, tau=0.0)
    expected, found = holitom(tokens, attention, **settings)
    assert any(e > s for s, e in found)
    with torch.no_grad(), vtoken.patched(model, vtoken.HoliTom(**settings)) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 4)
    assert [r.kept.tolist() for r in handle.records] == [sorted(j for j, _ in rows) for rows in expected]
    rows = sorted((f * tokens.shape[1] + j, v) for f, frame in enumerate(expected) for j, v in frame)
    offsets = torch.tensor([o for o, _ in rows])
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.video_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    features = torch.stack([v for _, v in rows]).float()
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep.nonzero().squeeze(1), features, steps=4)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-4
    assert_greedy_matches(generated, ref_greedy)


def test_qwen3_vl_merges_deepstack_levels_alike():
    model, processor = TINY_MODELS["tiny-qwen3-vl"]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t = inputs["video_grid_thw"][0, 0].item()
    tokens = placed.view(t, -1, placed.shape[-1])
    attention = _qwen_received_attention(model, inputs)
    settings = dict(budget=0.4, tau=0.0)
    with torch.no_grad():
        levels = model.model.visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).deepstack_features
    seen = {}

    def grab(module, args, kwargs):
        seen["deepstack"] = [d.clone() for d in kwargs["deepstack_visual_embeds"]]

    with torch.no_grad(), vtoken.patched(model, vtoken.HoliTom(**settings)) as handle:
        hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            model(**inputs)
        finally:
            hook.remove()
    expected, found = holitom(tokens, attention, **settings)
    assert [r.kept.tolist() for r in handle.records] == [sorted(j for j, _ in rows) for rows in expected]
    assert any(e > s for s, e in found)
    for level, got in zip(levels, seen["deepstack"], strict=True):
        merged, _ = holitom(tokens, attention, values=level.view(t, tokens.shape[1], -1), **settings)
        rows = sorted((f * tokens.shape[1] + j, v) for f, frame in enumerate(merged) for j, v in frame)
        torch.testing.assert_close(got, torch.stack([v for _, v in rows]).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llava-next-video", "tiny-video-llava"])
def test_clip_video_families_are_refused_with_the_reason(name):
    model, _ = TINY_MODELS[name]()
    with pytest.raises(vtoken.MissingSignalError, match="tower_attention.*last-layer attention"):
        vtoken.patch(model, "holitom")
    assert vtoken.handle_of(model) is None


# --------------------------------------------------------------------------- the merge inside the LLM
def loop_running_average(hidden, valid, keep, order):
    """The official loop: each dropped token, ascending, into its most cosine-similar kept token (similarities of
    the un-merged states; the first in `order` on ties), h_t <- (h_t + h_n) / 2."""
    out = hidden.clone().double()
    for b in range(hidden.shape[0]):
        kept = [t for t in order[b].tolist() if keep[b, t]]
        states = hidden[b].double()
        for n in range(hidden.shape[1]):
            if not valid[b, n] or keep[b, n]:
                continue
            sims = [float(states[n] @ states[t] / (states[n].norm() * states[t].norm())) for t in kept]
            t = kept[sims.index(max(sims))]
            out[b, t] = (out[b, t] + states[n]) / 2
    return out


def test_the_running_average_equals_the_official_loop():
    from vtoken.methods.holitom import running_average

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 13, 6, generator=g)
    hidden[0, 7] = hidden[0, 2] * 3  # a tie in cosine: the first kept token in `order` takes it
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, 10:] = False
    keep = torch.rand(2, 13, generator=g) < 0.4
    keep[0, 2] = keep[0, 11] = True
    order = torch.rand(2, 13, generator=g).argsort(-1)
    got = running_average(hidden, valid, keep & valid, order)
    want = loop_running_average(hidden, valid, keep & valid, order)
    torch.testing.assert_close(got.double()[keep & valid], want[keep & valid], rtol=1e-6, atol=1e-6)


INNER = 2  # the inner merge before LLM layer 2 of a 4-layer LLM, reading layer 1


@pytest.fixture(scope="module")
def deep_onevision():
    """The sharpened tiny OneVision with a 4-layer LLM (the merge needs layers before and after it), and an eager
    copy of its language model and head (attention maps for the reference)."""
    model, processor = sharpened_onevision()
    config = copy.deepcopy(model.config)
    config.text_config.num_hidden_layers = 4
    torch.manual_seed(1)
    deep = type(model)(config).eval()
    deep.load_state_dict(model.state_dict(), strict=False)  # the sharpened tower; LLM layers 2-3 new
    deep.generation_config.pad_token_id = model.generation_config.pad_token_id
    eager = copy.deepcopy(deep)
    eager.set_attn_implementation("eager")
    return deep, processor, eager.model.language_model, eager.lm_head


def inner_rule(ratio):
    """The reference's rule at the merge point: the last token's attention (head mean) over the visual tokens,
    the top round(V * (1 - ratio)) kept, the official running average written into the hidden states in place."""

    def rule(ctx):
        hidden, labels, visual = ctx["hidden"], ctx["labels"], ctx["visual"]
        slots = [s for s, c in enumerate(labels) if c in visual]
        attention = ctx["weights"].mean(0)[-1]
        kept = sorted(slots, key=lambda s: (-float(attention[s]), s))[: round(len(slots) * (1 - ratio))]
        states = hidden.clone()
        for n in slots:
            if n in kept:
                continue
            sims = [float(states[n] @ states[t] / (states[n].norm() * states[t].norm())) for t in kept]
            t = kept[sims.index(max(sims))]
            hidden[t] = (hidden[t] + states[n]) / 2
        return {labels[s] for s in kept}, []

    return rule


def test_inner_merge_equals_the_llm_run_layer_by_layer(deep_onevision):
    """Outer stage, then the merge before layer 2: per-step logits of 6 greedy tokens equal the eager LLM run by
    hand on the outer stage's output (kept tokens at their original positions, decoding at the unpruned length)."""
    from test_llm_methods import patched_generate, reference_generate

    model, processor, lm, head = deep_onevision
    inputs = video_inputs(processor, 4)
    method = vtoken.HoliTom(budget=0.3, tau=0.3, inner_layer=INNER, inner_ratio=0.5)
    logits, records = patched_generate(model, inputs, method)
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"], seen["ids"] = kwargs["inputs_embeds"].clone(), seen.get("ids")

    def grab_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"].clone()

    with torch.no_grad(), vtoken.patched(model, vtoken.HoliTom(budget=0.3, tau=0.3)):
        hooks = [model.model.register_forward_pre_hook(grab_ids, with_kwargs=True),
                 model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)]  # fmt: skip
        try:
            model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
    ids = seen["ids"][0]
    visual = set((ids == model.config.video_token_id).nonzero().squeeze(1).tolist())
    ref_logits, kept_after, _ = reference_generate(lm, head, seen["embeds"], visual, inner_rule(0.5), (INNER - 1,),
                                                   False)  # fmt: skip
    prefill = [r for r in records if r.stage.startswith("prefill")]
    assert [r.stage for r in prefill] == [f"prefill.layer{INNER - 1}"]
    assert prefill[0].tokens_in == len(visual) and prefill[0].tokens_out == round(len(visual) * 0.5)
    assert (prefill[0].kept + min(visual)).tolist() == sorted(kept_after[0])
    assert (logits - ref_logits).abs().max() <= 1e-4


def test_inner_merge_padded_batch_and_qwen_positions(deep_onevision):
    model, processor, *_ = deep_onevision
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in ("what happens?", "describe it.")]
    clips = [_clip(4, 1), _clip(4, 2)]
    batched = processor(videos=clips, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(videos=[c], text=[p], return_tensors="pt") for c, p in zip(clips, prompts, strict=True)]
    with torch.no_grad(), vtoken.patched(model, vtoken.HoliTom(budget=0.3, inner_layer=INNER)):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=4)
    qwen, qwen_processor = TINY_MODELS["tiny-qwen2.5-vl"]()
    with pytest.raises(vtoken.VTokenError, match="inner_layer=2 is beyond this LLM's 2 layers"):
        vtoken.patch(qwen, vtoken.HoliTom(inner_layer=2))
    inputs = video_inputs(qwen_processor, 8)
    with torch.no_grad(), vtoken.patched(qwen, vtoken.HoliTom(budget=0.5, inner_layer=1)) as handle:
        qwen.generate(**inputs, max_new_tokens=2, do_sample=False)
        stages = [r.stage for r in handle.records]
    assert "prefill.layer0" in stages and "encoder" in stages
    assert vtoken.HoliTom().stages == ("encoder",) and vtoken.HoliTom(inner_layer=3).stages == ("encoder", "prefill")
    with vtoken.patched(model, [vtoken.HoliTom(), vtoken.FastV(layer=1)]):  # without the inner merge: composes
        pass
