"""PruneVid (issue 43, METHODS-4-video.md): the encoder stage (frame clustering, the gap relabelling, windows,
static/dynamic groups, density-peak merges) against the plain reference of `video_references.py` on synthetic videos
at the official settings and the official code's defect cases (fewer than 7 and 4 frames, one-frame windows, seeded
noise), the relabelling alone on many label sequences, the prefill stage's functions (the plain attention with
grouped-query heads, the quota per group) against naive loops and on a real LLM layer's queries and keys, the tiny
video models (what reaches the LLM, original M-RoPE positions on Qwen, DeepStack levels, padded batches),
refusals, and the kernels and syncs a selection costs."""

import pytest
import torch
from conftest import assert_batch_equals_one_by_one, feed_language_model, make_image
from test_fastvid import sharpened_onevision
from test_qwen_vl import _prompt, _reference_generate
from test_vidcom2 import _clip, _placed
from video_references import prunevid, prunevid_labels

import vtoken
from vtoken.launches import count_launches
from vtoken.methods.prunevid import group_quota_keep, plain_attention_max, refine_labels
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def synthetic(frames, tokens=24, dim=12, seed=0, cut_every=3, still=0.5):
    """Videos whose scenes change every `cut_every` frames; within a scene a share `still` of the positions barely
    move (static candidates), the others move freely. Returns tokens [sum F, T, D] and the video of every frame."""
    g = torch.Generator().manual_seed(seed)
    x = []
    for count in frames:
        for f in range(count):
            if f % cut_every == 0:
                scene = torch.randn(tokens, dim, generator=g)
                calm = torch.rand(tokens, generator=g) < still
            x.append(scene + torch.randn(tokens, dim, generator=g) * torch.where(calm, 0.05, 1.0)[:, None])
    return torch.stack(x), torch.arange(len(frames)).repeat_interleave(torch.tensor(frames))


def assert_video_equals(selection, first, expected, atol=1e-5):
    """Frames first.. of `selection` equal the reference's [(position, feature, group)] per frame, in order; the
    selection's groups and their sizes agree."""
    for offset, rows in enumerate(expected):
        f = first + offset
        count = selection.counts[f]
        assert selection.anchors[f, :count].tolist() == [j for j, _, _ in rows], f"frame {f}"
        kinds = [2 * f + (kind == "dynamic") for _, _, kind in rows]
        assert selection.groups[f, :count].tolist() == kinds, f"frame {f}"
        assert selection.group_sizes[2 * f : 2 * f + 2] == [kinds.count(2 * f), kinds.count(2 * f + 1)]
        if rows:
            want = torch.stack([v for _, v, _ in rows]).float()
            torch.testing.assert_close(selection.features[f, :count].float(), want, atol=atol, rtol=1e-5)


SETTINGS = [
    dict(),  # official: tau 0.8, segments 0.25, clusters 0.5, k 7, groups above 14 tokens clustered
    dict(min_tokens=4, cluster_ratio=0.3, tau=0.5),  # small groups clustered too
    dict(segment_ratio=0.5, k=3, seed=2),  # more frame clusters, another seed
    dict(tau=1.0),  # nothing static: every frame's tokens one dynamic group
    dict(tau=-1.0, min_tokens=30),  # every position static in windows of 2+ frames; nothing clustered
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_videos_equal_the_reference(settings):
    """Several videos in one call: 9 frames (scene cuts), 3 (fewer than k = 7 and than 4: one frame cluster),
    1 (a one-frame window: nothing static) and 9 again (batched with the first)."""
    frames = [9, 3, 1, 9]
    x, videos = synthetic(frames)
    method = vtoken.PruneVid(layer=None, **settings)
    selection = method.select(VisualTokens(x, (4, 6), {"projected": x}, videos))
    first = 0
    for count in frames:
        expected, _ = prunevid(x[first : first + count], **settings)
        assert_video_equals(selection, first, expected)
        first += count


def test_windows_follow_the_scenes_and_static_groups_lead_them():
    """Four scenes of 4 frames (4 frame clusters): the windows are the scenes, each window's static tokens come first
    (recorded on its first frame), later frames keep only dynamic tokens."""
    x, videos = synthetic([16], cut_every=4, still=0.7)
    expected, found = prunevid(x, min_tokens=4)
    assert found == [(0, 3), (4, 7), (8, 11), (12, 15)]
    for f, rows in enumerate(expected):
        kinds = [kind for _, _, kind in rows]
        assert ("static" in kinds) == (f % 4 == 0), (f, kinds)
        assert kinds == sorted(kinds, key=lambda kind: kind != "static")
    selection = vtoken.PruneVid(layer=None, min_tokens=4).select(VisualTokens(x, (4, 6), {"projected": x}, videos))
    assert_video_equals(selection, 0, expected)


def test_seeded_noise():
    """Duplicated frames tie in density: the noise breaks the tie, the same one for the same seed."""
    x, videos = synthetic([8], cut_every=8, still=1.0)
    x = x[[0, 0, 1, 1, 2, 3, 3, 4]]
    tokens = VisualTokens(x, (4, 6), {"projected": x}, videos)
    runs = [vtoken.PruneVid(layer=None, seed=s, tau=1.0, min_tokens=4).select(tokens) for s in (0, 0, 5)]
    assert runs[0].counts == runs[1].counts and torch.equal(runs[0].anchors, runs[1].anchors)
    for seed, selection in zip((0, 5), runs[1:], strict=True):
        expected, _ = prunevid(x, seed=seed, tau=1.0, min_tokens=4)
        assert_video_equals(selection, 0, expected)


def random_labels(g, frames):
    """Label sequences (labels below F, as the frame clusters' ranks are) with runs of tied lengths and single
    frames."""
    labels = []
    while len(labels) < frames:
        label = int(torch.randint(0, min(frames, max(2, frames // 4)), (1,), generator=g))
        labels += [label] * int(torch.randint(1, 4, (1,), generator=g))
    return labels[:frames]


def test_the_relabelling_equals_the_spec_on_many_sequences():
    """600 sequences of 1 to 40 frames (tied longest runs, labels whose runs are all single frames, every frame
    free) in batches of equal length: `refine_labels` (one `vtoken::fill_gaps` launch) equals the spec's scan."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for frames in range(1, 41):
        batch = [random_labels(g, frames) for _ in range(14)]
        batch += [list(range(frames)), [0] * frames]  # every frame free (all single); one run
        got = refine_labels(torch.tensor(batch))
        for labels, row in zip(batch, got.tolist(), strict=True):
            assert row == prunevid_labels(labels), labels
            checked += 1
    assert checked >= 600
    # hand cases: the left block counts an earlier relabelled gap; ties go left; a lone right neighbour
    hand = {
        (0, 0, 3, 1, 1, 1, 4, 2, 2, 2, 2): [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2],  # 3 -> 1 (3 > 2); 4: 4 vs 4 -> left
        (0, 0, 1, 2, 2, 2, 3, 1, 1, 4): [0, 0, 2, 2, 2, 2, 2, 1, 1, 1],  # 1's single frame is free; lone left
        (5, 1, 1, 6, 7, 1, 1, 3): [1, 1, 1, 1, 1, 1, 1, 1],  # a lone right neighbour; two tied runs of one label
        (3, 2, 1, 0): [0, 0, 0, 0],  # every frame free: one window
    }
    for labels, want in hand.items():
        assert prunevid_labels(list(labels)) == want
        assert refine_labels(torch.tensor([labels])).tolist() == [want]


def test_selection_is_batched_with_one_sync():
    """One host sync sizes the output and the groups; the gap scan is one launch; the kernels do not depend on the
    video's content."""
    counts = []
    for seed in (0, 1):
        x, videos = synthetic([8, 8], seed=seed)
        with count_launches() as counted:
            vtoken.PruneVid(layer=None, min_tokens=4).select(VisualTokens(x, (4, 6), {"projected": x}, videos))
        assert counted.syncs == 2, counted.describe()  # the output's size; the videos' frames (image_index)
        assert counted.ops["vtoken::fill_gaps"] == 1
        counts.append(counted.kernels)
    assert len(set(counts)) == 1, counts


def test_parameters_are_validated():
    for bad, match in [(dict(tau=1.5), "tau=1.5"), (dict(segment_ratio=0), "segment_ratio=0"),
                       (dict(cluster_ratio=1.5), "cluster_ratio=1.5"), (dict(k=0), "k=0"),
                       (dict(min_tokens=-1), "min_tokens=-1"), (dict(alpha=2), "alpha=2"), (dict(layer=-1), "layer"),
                       (dict(seed=0.5), "seed=0.5"), (dict(budget=0.2), "budget=0.2; it has none")]:  # fmt: skip
        with pytest.raises(vtoken.VTokenError, match=match):
            vtoken.PruneVid(**bad)
    assert vtoken.PruneVid(layer=None).stages == ("encoder",)
    assert vtoken.PruneVid().stages == vtoken.PruneVid.stages == ("encoder", "prefill", "decode")


# --------------------------------------------------------------------------- the prefill stage's functions
def naive_plain_attention(q, k, key_valid, visual, scaling):
    """Step 8 by loops: per row, per head (its KV group), softmax over the real keys; max over heads."""
    batch, rows, heads, _ = q.shape
    groups = k.shape[2]
    out = torch.zeros(batch, rows, visual.shape[1], dtype=torch.float64)
    for b in range(batch):
        keys = [s for s in range(k.shape[1]) if key_valid[b, s]]
        for r in range(rows):
            best = {}
            for h in range(heads):
                g = h // (heads // groups)
                logits = torch.stack([(q[b, r, h].double() @ k[b, s, g].double()) * scaling for s in keys])
                p = dict(zip(keys, logits.softmax(0).tolist(), strict=True))
                for s in keys:
                    best[s] = max(best.get(s, 0.0), p[s])
            for v, s in enumerate(visual[b].tolist()):
                out[b, r, v] = best[s] if s >= 0 else 0.0
    return out


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (6, 1)])
def test_plain_attention_equals_loops_with_grouped_query_heads(heads, groups):
    """The official product skips `repeat_kv` (grouped-query attention crashes there): each head reads its group."""
    g = torch.Generator().manual_seed(heads * 10 + groups)
    q, k = torch.randn(2, 3, heads, 8, generator=g), torch.randn(2, 11, groups, 8, generator=g)
    key_valid = torch.ones(2, 11, dtype=torch.bool)
    key_valid[1, :2] = False  # a left-padded row
    visual = torch.tensor([[2, 3, 4, 5, -1], [3, 4, 5, 6, 7]])
    got = plain_attention_max(q, k, key_valid, visual, 8**-0.5)
    torch.testing.assert_close(got.double(), naive_plain_attention(q, k, key_valid, visual, 8**-0.5), atol=1e-6,
                               rtol=1e-5)  # fmt: skip


def naive_quota_keep(scores, groups, quotas, valid):
    keep = []
    for b in range(scores.shape[0]):
        row = set()
        for group, quota in enumerate(quotas[b].tolist()):
            members = [j for j in range(scores.shape[1]) if valid[b, j] and groups[b, j] == group]
            row |= set(sorted(members, key=lambda j: (-float(scores[b, j]), j))[:quota])
        row |= {j for j in range(scores.shape[1]) if valid[b, j] and groups[b, j] < 0}
        keep.append([j in row for j in range(scores.shape[1])])
    return torch.tensor(keep)


def test_the_quota_per_group_keeps_the_best_with_ties_to_the_lower_index():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (3, 20), generator=g).float()  # many ties
    groups = torch.randint(-1, 4, (3, 20), generator=g)
    quotas = torch.tensor([[2, 0, 1, 5], [1, 1, 1, 1], [0, 0, 0, 0]])
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[2, 15:] = False
    with count_launches() as counted:
        keep = group_quota_keep(scores, groups, quotas, valid)
    assert counted.syncs == 0, counted.describe()
    assert torch.equal(keep, naive_quota_keep(scores, groups, quotas, valid))


def test_the_cut_on_a_real_layers_queries_and_keys():
    """Steps 8-9 on the tiny OneVision's LLM (grouped-query attention: 4 heads, 2 KV heads): layer 0's queries and
    keys before rotary (read at its projections), every token after the video's newline as a row, each window's and
    frame's quota. The method's functions keep what the loops of the spec keep."""
    model, processor = sharpened_onevision()
    frames = 6
    inputs = processor(videos=[_clip(frames)], text=[build_prompt(processor, "what happens?", 0, 1)],
                       return_tensors="pt")  # fmt: skip
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    method = vtoken.PruneVid(layer=None, min_tokens=6, tau=0.5, alpha=0.4)
    selection = method.select(VisualTokens(tokens, (14, 14), {"projected": tokens}, torch.zeros(frames).long()))
    rows = [selection.features[f, :n] for f, n in enumerate(selection.counts)]
    groups = [selection.groups[f, :n] for f, n in enumerate(selection.counts)]
    visual = torch.cat([*rows, placed[-1:]])
    group = torch.cat([*groups, torch.tensor([-1])])  # the newline: never a candidate
    ids = inputs["input_ids"][0]
    run = (ids == model.config.video_token_id).nonzero().squeeze(1)
    new_ids = torch.cat([ids[: run[0]], torch.full((len(visual),), model.config.video_token_id), ids[run[-1] + 1 :]])
    attention = model.model.language_model.layers[0].self_attn
    seen = {}
    hooks = [attention.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
             attention.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))]  # fmt: skip
    try:
        with torch.no_grad():
            embeds = model.get_input_embeddings()(new_ids[None])
            embeds[0, new_ids == model.config.video_token_id] = visual
            model.model.language_model(inputs_embeds=embeds)
    finally:
        for hook in hooks:
            hook.remove()
    d = attention.head_dim
    q, k = seen["q"].view(1, len(new_ids), -1, d), seen["k"].view(1, len(new_ids), -1, d)
    start = int(run[0])
    slots = torch.arange(start, start + len(visual))[None]
    after = torch.arange(start + len(visual), len(new_ids))  # the question's tokens after the newline
    key_valid = torch.ones(1, len(new_ids), dtype=torch.bool)
    scores = plain_attention_max(q[:, after], k, key_valid, slots, attention.scaling).amax(1)
    want = naive_plain_attention(q[:, after], k, key_valid, slots, attention.scaling).amax(1)
    torch.testing.assert_close(scores.double(), want, atol=1e-6, rtol=1e-5)
    ids_of = sorted({int(g) for g in group if g >= 0})
    dense = torch.tensor([ids_of.index(int(g)) if g >= 0 else -1 for g in group])[None]
    quotas = torch.tensor([[int(selection.group_sizes[g] * 0.4) for g in ids_of]])
    keep = group_quota_keep(scores, dense, quotas, torch.ones_like(dense, dtype=torch.bool))
    assert torch.equal(keep, naive_quota_keep(want, dense, quotas, torch.ones_like(dense, dtype=torch.bool)))
    assert keep[0, -1] and 0 < int(keep.sum()) < len(visual)  # the newline stays; some tokens go
    assert method.quotas([[selection.group_sizes[g] for g in ids_of]]) == quotas.tolist()


# --------------------------------------------------------------------------- on the tiny models
def test_onevision_equals_the_reference_and_the_llm_fed_by_hand():
    """LightCompress's form (layer=None) on LLaVA-OneVision: the merged tokens in output order, then the video's
    one newline, at contiguous positions. The tiny model's projector is spread out (its random tokens all lie
    near one vector, and fp32 clusters would hang on the last bits)."""
    model, processor = sharpened_onevision()
    frames, settings = 8, dict(min_tokens=6, tau=0.5)
    inputs = processor(videos=[_clip(frames)], text=[build_prompt(processor, "what happens?", 0, 1)],
                       return_tensors="pt")  # fmt: skip
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    expected, _ = prunevid(tokens, **settings)
    with torch.no_grad(), vtoken.patched(model, vtoken.PruneVid(layer=None, **settings)) as handle:
        logits = model(**inputs).logits
    assert [r.kept.tolist() for r in handle.records] == [sorted(j for j, _, _ in rows) for rows in expected]
    assert [r.tokens_out for r in handle.records] == [len(rows) for rows in expected]
    visual = torch.cat([torch.stack([v for _, v, _ in rows]).float() for rows in expected if rows] + [placed[-1:]])
    ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_qwen_keeps_original_positions(name):
    """Qwen (an extension): every token at its recorded (t, h, w), a window's static tokens at its first frame's."""
    model, processor = TINY_MODELS[name]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t = inputs["video_grid_thw"][0, 0].item()
    tokens = placed.view(t, -1, placed.shape[-1])
    settings = dict(min_tokens=4, tau=0.3)
    expected, _ = prunevid(tokens, **settings)
    with torch.no_grad(), vtoken.patched(model, vtoken.PruneVid(layer=None, **settings)):
        logits = model(**inputs).logits
    per_frame = tokens.shape[1]
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.video_token_id).nonzero().squeeze(1)
    rows = [(f * per_frame + j, v) for f, frame in enumerate(expected) for j, v, _ in frame]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[torch.tensor([o for o, _ in rows])]] = True
    # the prompt keeps its placeholders in column order: the rows go there sorted by their (recorded) place
    features = torch.stack([v for _, v in sorted(rows, key=lambda r: r[0])]).float()
    ref_logits, *_ = _reference_generate(model, inputs, keep.nonzero().squeeze(1), features, steps=1)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-4


def test_qwen3_vl_merges_deepstack_levels_alike_and_keeps_timestamps():
    """Qwen3-VL (an extension): each temporal patch is its own run after a `<t seconds>` timestamp, which stays; each
    DeepStack level is merged exactly as the tokens (`Selection.mix`)."""
    model, processor = TINY_MODELS["tiny-qwen3-vl"]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t = inputs["video_grid_thw"][0, 0].item()
    tokens = placed.view(t, -1, placed.shape[-1])
    settings = dict(min_tokens=4, tau=0.3)
    with torch.no_grad():
        levels = model.model.visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).deepstack_features
    seen = {}

    def grab(module, args, kwargs):
        seen["deepstack"] = [d.clone() for d in kwargs["deepstack_visual_embeds"]]
        seen["embeds"] = kwargs["inputs_embeds"].clone()

    with torch.no_grad(), vtoken.patched(model, vtoken.PruneVid(layer=None, **settings)):
        hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            model(**inputs)
        finally:
            hook.remove()
    expected, _ = prunevid(tokens, **settings)
    order = sorted(((f * tokens.shape[1] + j), n) for n, (f, j) in
                   enumerate((f, j) for f, rows in enumerate(expected) for j, _, _ in rows))  # fmt: skip
    for level, got in zip(levels, seen["deepstack"], strict=True):
        rows = prunevid(tokens, values=level.view(t, tokens.shape[1], -1), **settings)[0]
        want = torch.stack([v for frame in rows for _, v, _ in frame]).float()
        torch.testing.assert_close(got, want[[n for _, n in order]], atol=1e-5, rtol=1e-5)
    assert seen["embeds"].shape[1] == inputs["input_ids"].shape[1] - t * tokens.shape[1] + len(order)


def test_padded_batch_equals_rows_alone():
    model, processor = TINY_MODELS["tiny-onevision"]()
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in ("what happens?", "describe it.")]
    clips = [_clip(6, 1), _clip(6, 2)]
    batched = processor(videos=clips, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(videos=[c], text=[p], return_tensors="pt") for c, p in zip(clips, prompts, strict=True)]
    with torch.no_grad(), vtoken.patched(model, vtoken.PruneVid(layer=None, min_tokens=6)):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)


def test_refusals_name_why():
    model, processor = TINY_MODELS["tiny-onevision"]()  # a 2-layer LLM
    with pytest.raises(vtoken.VTokenError, match="layer=10 leaves no later layer.*at most 0"):
        vtoken.patch(model, "prunevid")
    assert vtoken.handle_of(model) is None
    assert vtoken.PruneVid.fit(vtoken.model_view(model)) == {"layer": 0}  # the deepest a cut can follow
    assert vtoken.applicable_methods(model)["prunevid"] is None
    image = processor(images=[make_image(300, 200)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with vtoken.patched(model, vtoken.PruneVid(layer=None)), pytest.raises(vtoken.InputError, match="prunevid acts"):
        model(**image)
    image_only, _ = TINY_MODELS["tiny-llava"]()
    with pytest.raises(vtoken.VTokenError, match="video inputs only"):
        vtoken.patch(image_only, vtoken.PruneVid(layer=None))
    for name in ("tiny-llava-next-video", "tiny-video-llava", "tiny-internvl"):  # a projector after selection
        model, _ = TINY_MODELS[name]()
        with pytest.raises(vtoken.MissingSignalError, match="projected_merge.*project only the selected tokens"):
            vtoken.patch(model, vtoken.PruneVid(layer=None))
        assert "projected_merge" in vtoken.applicable_methods(model)["prunevid"]
