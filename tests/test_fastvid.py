"""FastVID (issue 34, METHODS-3-video.md): segments, anchors, salient picks and density-peak merges against the plain
references of `video_references.py` (both forms: LLaVA-OneVision's parallel one and the Qwen2.5-VL one), on
synthetic videos (scene cuts, fewer frames than segments, p = 1, several videos of different lengths in one call)
and on the tiny video models (signals recomputed independently, what reaches the LLM, original M-RoPE positions on
Qwen), records, padded batches, refusals, the SigLIP head (the tower's own, a module, a directory) and the
kernels and syncs a selection costs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_greedy_matches,
    feed_language_model,
    greedy,
    video_inputs,
)
from test_qwen_vl import _prompt, _reference_generate
from test_vidcom2 import _clip, _placed
from video_references import fastvid_onevision, fastvid_qwen

import vtoken
from vtoken.adapters import hf
from vtoken.launches import count_launches
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS


def assert_frames_equal(selection, first, expected, atol=1e-5):
    """Frames first.. of `selection` equal the reference's [(position, feature)] per frame, in order."""
    for offset, rows in enumerate(expected):
        f = first + offset
        count = selection.counts[f]
        assert selection.anchors[f, :count].tolist() == [j for j, _ in rows], f"frame {f}"
        if rows:
            want = torch.stack([v for _, v in rows]).float()
            torch.testing.assert_close(selection.features[f, :count].float(), want, atol=atol, rtol=1e-5)


def synthetic(frames, tokens=24, dim=12, seed=0, cut_every=3):
    """Videos whose frames drift slowly with a scene cut every `cut_every` frames: tokens [sum F, T, D], attention
    [sum F, T], global features [sum F, G], video index."""
    g = torch.Generator().manual_seed(seed)
    x, globals_ = [], []
    for count in frames:
        scene = torch.randn(tokens, dim, generator=g)
        for f in range(count):
            if f and f % cut_every == 0:
                scene = torch.randn(tokens, dim, generator=g)
            scene = scene + 0.15 * torch.randn(tokens, dim, generator=g)
            x.append(scene.clone())
            globals_.append(scene.mean(0) + 0.05 * torch.randn(dim, generator=g))
    x = torch.stack(x)
    attention = torch.rand(len(x), tokens, generator=g).softmax(-1)
    videos = torch.arange(len(frames)).repeat_interleave(torch.tensor(frames))
    return x, attention, torch.stack(globals_), videos


ONEVISION_SETTINGS = [
    dict(),  # official: 0.10, c 8, tau 0.9, d 0.4, p 4, beta 0.6
    dict(budget=0.5, c=2, tau=0.2),  # long segments: several anchors, each absorbing the whole segment
    dict(budget=0.4, c=3, p=1),  # every frame an anchor with exactly C: its own tokens only
    dict(budget=0.3, d=0.0),  # no context: salient tokens only
    dict(budget=0.9, c=2, tau=-1.0, p=8),  # quotas capped at the tokens left
    dict(budget=6, c=4, tau=0.5, beta=0.2, seed=3),  # a count budget, another seed
]


@pytest.mark.parametrize("settings", ONEVISION_SETTINGS)
def test_onevision_form_equals_the_reference(settings):
    """Several videos in one call: 9 frames (scene cuts), 1 frame, 3 frames (fewer than c - 1 = 7 cuts: the
    official top-k raises) and 9 frames again."""
    frames = [9, 1, 3, 9]
    x, attention, pooled, videos = synthetic(frames)
    signals = {"projected": x, "siglip_head_attention": attention, "siglip_head_pooled": pooled}
    selection = vtoken.FastVID(**settings).select(VisualTokens(x, (4, 6), signals, videos))
    first = 0
    for count in frames:
        part = slice(first, first + count)
        expected = fastvid_onevision(x[part], attention[part], pooled[part], **settings)
        assert_frames_equal(selection, first, expected)
        first += count


QWEN_SETTINGS = [
    dict(),  # official: 0.27, c 8, tau 0.84, ignore 0.95, d 0.4, p 4, beta 0.6
    dict(budget=0.5, c=2, tau=0.0, ignore=0.99),  # long segments cut again into sub-segments
    dict(budget=0.5, c=2, tau=0.0, ignore=0.0, p=2),  # one sub-segment per segment; anchors every 2
    dict(budget=0.1, c=3, d=0.9),  # context capped at T // 2
    dict(budget=3, seed=5),
]


@pytest.mark.parametrize("settings", QWEN_SETTINGS)
def test_qwen_form_equals_the_reference(settings):
    frames = [9, 1, 4]
    x, attention, _, videos = synthetic(frames, seed=1)
    signals = {"projected": x, "vit_query_attention": attention}
    selection = vtoken.FastVID(variant="qwen", **settings).select(VisualTokens(x, (4, 6), signals, videos))
    first = 0
    for count in frames:
        part = slice(first, first + count)
        expected = fastvid_qwen(x[part], attention[part], **settings)
        assert_frames_equal(selection, first, expected)
        first += count


def test_budgets_follow_segments_and_anchors():
    """T = 196 at 0.10: keep 19, S 12, C 7. Two identical scenes of 5 frames (one cut between them, c = 2, tau
    below every similarity): anchors are frames 4, 0 and 9, 5; each takes (7 * 5) // 2 = 17 context tokens."""
    g = torch.Generator().manual_seed(0)
    scenes = [torch.randn(196, 8, generator=g) for _ in range(2)]
    x = torch.stack([scenes[f // 5] + 0.01 * torch.randn(196, 8, generator=g) for f in range(10)])
    pooled = torch.stack([scenes[f // 5].mean(0) for f in range(10)]) + 0.001 * torch.randn(10, 8, generator=g)
    signals = {"projected": x, "siglip_head_attention": torch.rand(10, 196, generator=g), "siglip_head_pooled": pooled}
    selection = vtoken.FastVID(c=2, tau=-1.0).select(VisualTokens(x, (14, 14), signals))
    assert selection.counts == [12 + 17, 12, 12, 12, 12 + 17, 12 + 17, 12, 12, 12, 12 + 17]
    one = vtoken.FastVID().select(VisualTokens(x[:1], (14, 14), {k: v[:1] for k, v in signals.items()}))
    assert one.counts == [19]  # a one-frame video: its own anchor with C


def test_a_token_no_target_draws_keeps_its_features_and_merges_use_fp32():
    """bf16 tokens: merges run in fp32 and the output comes back in bf16; the salient tokens pass unchanged."""
    x, attention, pooled, _ = synthetic([5], seed=2)
    signals = {"projected": x.bfloat16(), "siglip_head_attention": attention, "siglip_head_pooled": pooled}
    selection = vtoken.FastVID(budget=0.5).select(VisualTokens(x.bfloat16(), (4, 6), signals))
    assert selection.features.dtype == torch.bfloat16
    expected = fastvid_onevision(x.bfloat16().float(), attention, pooled, budget=0.5)
    assert_frames_equal(selection, 0, expected, atol=2e-2)


def test_selection_is_batched_with_one_sync():
    """A fixed number of kernels whatever the frame count, budget, segmentation or videos in the call; one host sync
    (the counts). The tokens are an adapter's: the video of every frame on the device (`image_index`) and on the host
    (`image_of_crop`), so nothing reads the device to find the videos."""

    def launches(frames, **settings):
        x, attention, pooled, videos = synthetic(frames, seed=sum(frames))
        signals = {"projected": x, "siglip_head_attention": attention, "siglip_head_pooled": pooled}
        tokens = VisualTokens(x, (4, 6), signals, videos, image_of_crop=videos.tolist())
        with count_launches() as counted:
            vtoken.FastVID(**settings).select(tokens)
        return counted

    base = launches([4], budget=0.5)
    assert base.syncs == 1 and "fastvid.py" in base.sync_sites[0], base.describe()
    for frames, settings in [([16], dict(budget=0.3)), ([9], dict(budget=0.5, c=2, tau=0.1)), ([6], dict(budget=0.4,
                             p=1)), ([5, 5], dict(budget=0.5))]:  # fmt: skip
        other = launches(frames, **settings)
        assert (other.kernels, other.syncs) == (base.kernels, 1), other.describe()
    several = launches([3, 5, 2], budget=0.5)  # runs of different lengths: one burst per run, still one sync
    assert several.syncs == 1, several.describe()
    qwen = []
    for frames in (4, 12):
        x, attention, _, videos = synthetic([frames])
        tokens = VisualTokens(x, (4, 6), {"projected": x, "vit_query_attention": attention}, videos,
                              image_of_crop=videos.tolist())  # fmt: skip
        with count_launches() as counted:
            vtoken.FastVID(variant="qwen").select(tokens)
        qwen.append((counted.kernels, counted.syncs))
    assert qwen[0] == qwen[1] and qwen[0][1] == 1


@pytest.mark.parametrize("family", ["tiny-onevision", "tiny-qwen2-vl"])
def test_through_the_adapters_the_videos_are_known_on_the_host(family):
    """The OneVision and Qwen adapters hand FastVID the video of every frame on the host (`image_of_crop`): the
    selection inside a patched forward reads the device once (its counts), not the video index."""
    from conftest import video_inputs

    model, processor = TINY_MODELS[family]()
    inputs = video_inputs(processor, 4)
    method = vtoken.FastVID()
    seen, select = [], method.select

    def counted(tokens):
        with count_launches() as launches:
            out = select(tokens)
        seen.append((tokens.image_of_crop, tokens.num_crops, launches))
        return out

    method.select = counted
    with torch.no_grad(), vtoken.patched(model, method):
        model(**inputs)
    (owners, crops, launches), *_ = seen
    assert owners == [0] * crops and len(seen) == 1
    assert launches.syncs == 1 and "fastvid.py" in launches.sync_sites[0], launches.describe()


def test_parameters_are_validated():
    for bad, match in [(dict(c=0), "c=0"), (dict(tau=1.5), "tau=1.5"), (dict(d=-0.1), "d=-0.1"), (dict(p=0), "p=0"),
                       (dict(beta=2), "beta=2"), (dict(variant="llava"), "variant='llava'; accepted: onevision, qwen"),
                       (dict(budget=0.0), "budget"), (dict(seed=-1), "seed=-1"), (dict(head=3), "head=3"),
                       (dict(ignore=True), "ignore=True")]:  # fmt: skip
        with pytest.raises(vtoken.VTokenError, match=match):
            vtoken.FastVID(**bad)
    assert vtoken.FastVID().resolved("budget", "qwen") == 0.27 and vtoken.FastVID(tau=0.5).resolved("tau") == 0.5


# --------------------------------------------------------------------------- on the tiny models
def sharpened_onevision(text_layers=2):
    """The tiny LLaVA-OneVision (an LLM of `text_layers` layers) with features that tell tokens apart (random weights
    attend almost uniformly and project every token near one common vector, so rankings would hang on the last
    bits): the MAP head's probe queries and the last tower layer's queries scaled up, the projector's output
    centred and spread out."""
    model, processor = TINY_MODELS["tiny-onevision"](text_layers=text_layers)
    tower = model.model.vision_tower
    projector = model.model.multi_modal_projector
    with torch.no_grad():
        dim = tower.head.attention.embed_dim
        tower.head.attention.in_proj_weight[:dim] *= 60
        tower.encoder.layers[-1].self_attn.q_proj.weight *= 40
        inputs = video_inputs(processor, 2)
        hidden = tower(inputs["pixel_values_videos"].flatten(0, 1), output_hidden_states=True).hidden_states[-1]
        mean = projector(hidden).mean((0, 1))
        projector.linear_2.weight *= 100  # then the output is 100 * (what it was - its mean over those frames)
        projector.linear_2.bias.copy_(100 * (projector.linear_2.bias - mean))
    return model, processor


@pytest.fixture(scope="module")
def onevision():
    return sharpened_onevision()


def onevision_signals(model, pixel_values):
    """Independent LLaVA-OneVision signals per frame: the tower's own forward (post_layernorm + MAP head: g), the
    probe's attention recomputed from the head's in_proj weights, pooled with F.interpolate like the tokens."""
    tower = model.model.vision_tower
    frames = pixel_values.flatten(0, 1)
    with torch.no_grad():
        out = tower(frames, output_hidden_states=True)
        hidden = tower.post_layernorm(out.hidden_states[-1])
        head = tower.head
        mha = head.attention
        dim, heads = mha.embed_dim, mha.num_heads
        wq, wk, _ = mha.in_proj_weight.chunk(3)
        bq, bk, _ = mha.in_proj_bias.chunk(3)
        q = (head.probe[0] @ wq.T + bq).view(1, heads, dim // heads)
        k = (hidden @ wk.T + bk).view(len(frames), -1, heads, dim // heads)
        probs = torch.einsum("qhd,fnhd->fhn", q, k).mul((dim // heads) ** -0.5).softmax(-1).mean(1)
        side = int(probs.shape[1] ** 0.5)
        pooled = F.interpolate(probs.view(-1, 1, side, side), size=(side + 1) // 2, mode="bilinear")
    return pooled.flatten(1), out.pooler_output


def feed_at_original_positions(model, input_ids, token_id, offsets, visual, steps):
    """The bare LLaVA-style language model on `input_ids[0]` keeping only the placeholders at `offsets` (within its
    one run) filled with `visual` [n, D], every kept column at its ORIGINAL position (gaps where tokens were
    dropped), then greedy decoding from the unpruned length on: (prefill logits, ids [1, steps], per-step logits
    [steps, 1, V])."""
    ids = input_ids[0]
    placeholders = (ids == token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    columns = keep.nonzero().squeeze(1)
    lm = model.model.language_model
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids[columns][None])
        embeds[0, ids[columns] == token_id] = visual
        out = lm(inputs_embeds=embeds, position_ids=columns[None], use_cache=True)
        logits = model.lm_head(out.last_hidden_state)
        cache, tokens, step_logits = hf.cache_out(out), [], [logits[:, -1]]
        for step in range(steps):
            tokens.append(step_logits[-1].argmax(-1, keepdim=True))
            if step == steps - 1:
                break
            out = lm(inputs_embeds=model.get_input_embeddings()(tokens[-1]), **hf.cache_kwargs(cache), use_cache=True,
                     position_ids=torch.full((1, 1), len(ids) + step))  # fmt: skip
            step_logits.append(model.lm_head(out.last_hidden_state)[:, -1])
    return logits, torch.cat(tokens, 1), torch.stack(step_logits)


@pytest.mark.parametrize("frames, settings", [(6, {}), (8, dict(budget=0.3, c=2, tau=0.5)), (3, dict(p=1))])
def test_onevision_equals_the_reference_and_the_llm_fed_by_hand(onevision, frames, settings):
    """The tiny OneVision's SigLIP tower keeps its head (vision_use_head defaults to True in a config): the
    method reads it. The LLM gets the merged frames, then the video's one newline, each kept token at its
    ORIGINAL position (the official `position_ids = keep_indexs`: gaps), and decoding continues at the unpruned
    length."""
    model, processor = onevision
    inputs = video_inputs(processor, frames)
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    attention, pooled = onevision_signals(model, inputs["pixel_values_videos"])
    expected = fastvid_onevision(tokens, attention, pooled, **settings)
    with torch.no_grad(), vtoken.patched(model, vtoken.FastVID(**settings)) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 3)
    records = handle.records
    assert [(r.modality, r.image, r.crop, r.tokens_in) for r in records] == [
        ("video", 0, f, 196) for f in range(frames)
    ]
    assert [r.kept.tolist() for r in records] == [[j for j, _ in rows] for rows in expected]
    assert [r.tokens_out for r in records] == [len(rows) for rows in expected]
    visual = torch.cat([torch.stack([v for _, v in rows]).float() for rows in expected] + [placed[-1:]])
    offsets = torch.tensor([f * 196 + j for f, rows in enumerate(expected) for j, _ in rows] + [frames * 196])
    ref_logits, *ref_greedy = feed_at_original_positions(model, inputs["input_ids"], model.config.video_token_id,
                                                         offsets, visual, 3)  # fmt: skip
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-4
    assert_greedy_matches(generated, ref_greedy)
    contiguous = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, visual)
    assert (contiguous - ref_logits).abs().max() > 1e-3  # the positions matter: renumbering would differ


def test_onevision_text_turn_continues_at_the_unpruned_positions(onevision):
    """A chat turn on the cache of a FastVID turn (original positions): the new tokens continue where the unpruned
    conversation would (turn 1's prompt length + its generated tokens), as the bare LLM fed the whole conversation
    by hand at those positions gives."""
    model, processor = onevision
    inputs = video_inputs(processor, 4)
    settings = dict(budget=0.3, c=2)
    new = processor.tokenizer(" and then?", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad(), vtoken.patched(model, vtoken.FastVID(**settings)) as handle:
        first = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        kept = [r.kept + 196 * r.crop for r in handle.records]
        ids = torch.cat([first.sequences, new], 1)
        second = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                do_sample=False, output_logits=True, return_dict_in_generate=True,
                                **hf.cache_kwargs(hf.cache_out(first)))  # fmt: skip
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(4, -1, placed.shape[-1])
    attention, pooled = onevision_signals(model, inputs["pixel_values_videos"])
    expected = fastvid_onevision(tokens, attention, pooled, **settings)
    visual = torch.cat([torch.stack([v for _, v in rows]).float() for rows in expected] + [placed[-1:]])
    offsets = torch.cat([*kept, torch.tensor([4 * 196])])
    logits, *_ = feed_at_original_positions(model, ids, model.config.video_token_id, offsets, visual, 1)
    torch.testing.assert_close(second.logits[0], logits[:, -1], atol=1e-4, rtol=0)


def qwen_block_query_keys(model, inputs, attn):
    """([S, H, d], [S, H, d]) float64 queries and keys of the Qwen vision block attention `attn` on `inputs` (S: the
    call's patches in the encoder's order), recomputed from the block's input: its qkv weights and a rotate-half
    rotary written here."""
    seen = {}

    def grab(module, args, kwargs):
        seen["x"], seen["cos_sin"] = args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"]

    hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    x, (cos, sin) = seen["x"], seen["cos_sin"]
    with torch.no_grad():
        q, k, _ = (x @ attn.qkv.weight.T + attn.qkv.bias).view(len(x), 3, attn.num_heads, -1).unbind(1)

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]

    return rotate(q.double()), rotate(k.double())


def raster_order(model, inputs, values):
    """[t, groups] per-merge-group `values` in the encoder's order, put in raster order (Qwen2.5-VL's encoder visits
    merge groups window by window; Qwen2-VL's in raster order already)."""
    visual = model.model.visual
    if not hasattr(visual, "fullatt_block_indexes"):
        return values
    from transformers.vision_utils import get_vision_window_index

    grid = inputs["video_grid_thw"]
    index, _ = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size, visual.patch_size)
    return values.flatten()[torch.argsort(index)].view(values.shape[0], -1)


def _qwen_query_attention(model, inputs):
    """Independent FastVID-Qwen signal: the last vision block's q/k recomputed from its input, each temporal patch's
    mean query against each merge group's mean key."""
    q, k = qwen_block_query_keys(model, inputs, model.model.visual.blocks[-1].attn)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    heads, dim = q.shape[1:]
    mq = q.view(t, h * w, heads, dim).mean(1)
    mk = k.view(t, h * w // 4, 4, heads, dim).mean(2)
    probs = torch.einsum("thd,tnhd->thn", mq, mk).mul(dim**-0.5).softmax(-1).mean(1)  # [t, groups] encoder order
    return raster_order(model, inputs, probs)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_qwen_keeps_original_positions(name):
    """The Qwen form by default on Qwen-VL families: the reference on the LLM-input tokens and the independently
    recomputed signal; the LLM gets the merged tokens at their own (t, h, w) positions (generate included)."""
    model, processor = TINY_MODELS[name]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    tokens = placed.view(t, h * w // 4, -1)
    attention = _qwen_query_attention(model, inputs)
    settings = dict(budget=0.5, c=2, tau=0.0)
    expected = fastvid_qwen(tokens, attention, **settings)
    with torch.no_grad(), vtoken.patched(model, vtoken.FastVID(**settings)) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 4)
    assert [r.kept.tolist() for r in handle.records] == [[j for j, _ in rows] for rows in expected]
    offsets = torch.tensor([f * tokens.shape[1] + j for f, rows in enumerate(expected) for j, _ in rows])
    features = torch.stack([v for rows in expected for _, v in rows]).float()
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.video_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep.nonzero().squeeze(1), features, steps=4)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-4
    assert_greedy_matches(generated, ref_greedy)


def test_qwen3_vl_merges_deepstack_levels_alike_and_keeps_timestamps():
    """Qwen3-VL (an extension): each temporal patch is its own run after a `<t seconds>` timestamp; a frame may keep
    nothing while every timestamp stays; each DeepStack level is merged exactly as the tokens (`Selection.mix`)."""
    model, processor = TINY_MODELS["tiny-qwen3-vl"]()
    inputs = processor(videos=[_clip(16)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t = inputs["video_grid_thw"][0, 0].item()
    tokens = placed.view(t, -1, placed.shape[-1])
    attention = _qwen_query_attention(model, inputs)
    settings = dict(budget=0.5, c=1, tau=-1.0, ignore=-1.0)  # one segment, one sub-segment: its last frame keeps
    with torch.no_grad():
        levels = model.model.visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).deepstack_features
    seen = {}

    def grab_llm(module, args, kwargs):
        seen["deepstack"] = [d.clone() for d in kwargs["deepstack_visual_embeds"]]

    def grab_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"].clone()

    with torch.no_grad(), vtoken.patched(model, vtoken.FastVID(**settings)) as handle:
        hooks = [model.model.language_model.register_forward_pre_hook(grab_llm, with_kwargs=True),
                 model.model.register_forward_pre_hook(grab_ids, with_kwargs=True)]  # fmt: skip
        try:
            model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
    expected = fastvid_qwen(tokens, attention, **settings)
    assert [r.kept.tolist() for r in handle.records] == [[j for j, _ in rows] for rows in expected]
    assert 0 in [len(rows) for rows in expected]  # a frame that keeps nothing
    for level, got in zip(levels, seen["deepstack"], strict=True):
        rows = fastvid_qwen(tokens, attention, values=level.view(t, tokens.shape[1], -1), **settings)
        want = torch.stack([v for frame in rows for _, v in frame]).float()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    video = model.config.video_token_id
    ids = inputs["input_ids"][0]
    assert torch.equal(seen["ids"][0][seen["ids"][0] != video], ids[ids != video])  # the text, timestamps included


# --------------------------------------------------------------------------- refusals and the head
@pytest.mark.parametrize("name", ["tiny-llava-next-video", "tiny-video-llava"])
def test_clip_video_families_are_refused_with_the_reason(name):
    model, _ = TINY_MODELS[name]()
    with pytest.raises(vtoken.MissingSignalError, match="SigLIP's attention-pooling head"):
        vtoken.patch(model, "fastvid")
    assert vtoken.handle_of(model) is None
    assert "attention-pooling head" in vtoken.applicable_methods(model)["fastvid"]


def test_the_forms_are_refused_where_their_signal_is_missing():
    model, _ = TINY_MODELS["tiny-qwen2-vl"]()
    with pytest.raises(vtoken.MissingSignalError, match="siglip_head_attention"):
        vtoken.patch(model, vtoken.FastVID(variant="onevision"))
    model, _ = TINY_MODELS["tiny-onevision"]()
    with pytest.raises(vtoken.MissingSignalError, match="vit_query_attention"):
        vtoken.patch(model, vtoken.FastVID(variant="qwen"))


@pytest.fixture(scope="module")
def headless():
    """The tiny OneVision as Hugging Face converts real checkpoints: a SigLIP tower without its MAP head, and the
    head's weights in a SigLIP model of their own (the tiny model's tower, head included)."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    siglip = copy.deepcopy(model.model.vision_tower)
    config = copy.deepcopy(model.config)
    config.vision_config.vision_use_head = False
    bare = type(model)(config).eval()
    bare.load_state_dict(model.state_dict(), strict=False)
    bare.generation_config.pad_token_id = model.generation_config.pad_token_id
    return bare, processor, siglip, model


def test_a_checkpoint_without_the_head_is_refused_naming_what_to_pass(headless):
    model, *_ = headless
    assert not hasattr(model.model.vision_tower, "head")
    with pytest.raises(vtoken.MissingSignalError, match="vision_use_head=False.*google/siglip-so400m-patch14-384"):
        vtoken.patch(model, "fastvid")
    assert "vision_use_head=False" in vtoken.applicable_methods(model)["fastvid"]
    with pytest.raises(vtoken.MissingSignalError, match="cannot be loaded"):
        vtoken.patch(model, vtoken.FastVID(head="/nonexistent/siglip"))
    assert vtoken.handle_of(model) is None


def test_the_head_from_a_module_or_a_directory_gives_the_towers_own_result(headless, tmp_path):
    model, processor, siglip, whole = headless
    inputs = video_inputs(processor, 5)
    with torch.no_grad():
        with vtoken.patched(whole, vtoken.FastVID(budget=0.3, c=2)) as handle:
            whole(**inputs)
            reference = [r.kept.tolist() for r in handle.records]
        with vtoken.patched(model, vtoken.FastVID(budget=0.3, c=2, head=siglip)) as handle:
            model(**inputs)
            assert [r.kept.tolist() for r in handle.records] == reference
        siglip.save_pretrained(tmp_path / "siglip")
        with vtoken.patched(model, vtoken.FastVID(budget=0.3, c=2, head=tmp_path / "siglip")) as handle:
            model(**inputs)
            assert [r.kept.tolist() for r in handle.records] == reference
    narrow = copy.deepcopy(siglip)
    narrow.head.probe = torch.nn.Parameter(torch.zeros(1, 1, 8))
    with pytest.raises(vtoken.MissingSignalError, match="8 wide"):
        vtoken.patch(model, vtoken.FastVID(head=narrow))
