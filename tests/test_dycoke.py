"""DyCoke (issue 26, METHODS-2.md): temporal token merging against a plain-Python reference written from the spec,
the decode-time KV selection against the bare language model recomputed by hand (eager attention, no cache, a
mask per query row and layer), keep-all identities, padded batches, use_cache, threads, restore, records, the
state reset at every generate call, and clear errors."""

import copy
import threading

import pytest
import torch
from conftest import shortened_prompt, video_inputs
from test_vidcom2 import _clip, _placed

import vtoken
from vtoken.adapters import hf
from vtoken.applicability import applicable_methods, fitting_params
from vtoken.methods.dycoke import frame_counts
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt

LAYERS = 4
STEPS = 6
VIDEO_FAMILIES = ["tiny-onevision", "tiny-llava-next-video", "tiny-video-llava", "tiny-qwen2-vl", "tiny-qwen2.5-vl",
                  "tiny-qwen3-vl", "tiny-internvl", "tiny-perception-lm"]  # fmt: skip


# --------------------------------------------------------------------------- stage 1: temporal merging
def reference_merge(frames, k):
    """One video [F, T, D] straight from the spec, in plain Python: the kept positions of every frame."""
    count, per_frame = frames.shape[:2]
    m = int((1 - k) * per_frame)

    def lowest(a, b):
        sims = [float(a[t].double() @ b[t].double() / (a[t].double().norm() * b[t].double().norm()))
                for t in range(per_frame)]  # fmt: skip
        return sorted(sorted(range(per_frame), key=lambda t: (sims[t], t))[:m])

    kept = [list(range(per_frame)) for _ in range(count)]
    for i in range(0, count - 1, 2):
        kept[i + 1] = lowest(frames[i], frames[i + 1])
    for i in range(0, count - 4, 4):
        kept[i + 2] = lowest(frames[i], frames[i + 2])
    return kept


@pytest.mark.parametrize("k", [0.7, 0.5, 0.0, 1.0])
def test_random_videos_equal_the_reference(k):
    """Several videos in one call, of 1, 2, 3, 4, 5, 8 and 13 frames (<= 4 crashes the official; odd counts lose
    their last frame there)."""
    g = torch.Generator().manual_seed(3)
    frames = [1, 2, 3, 4, 5, 8, 13]
    tokens = torch.randn(sum(frames), 12, 6, generator=g)
    videos = torch.arange(len(frames)).repeat_interleave(torch.tensor(frames))
    selection = vtoken.DyCoke(k=k).select(VisualTokens(tokens, (3, 4), {"projected": tokens}, videos))
    first = 0
    for count in frames:
        expected = reference_merge(tokens[first : first + count], k)
        assert [selection.kept_of(f).tolist() for f in range(first, first + count)] == expected
        assert selection.counts_per_crop()[first : first + count] == frame_counts(count, 12, k)
        first += count


def test_temporal_merge_is_one_burst_without_a_sync():
    """Stage 1 on the GPU: one cosine over every (frame, reference frame) pair and one sort, whatever the frames and
    videos; the frame layout comes from the adapter's host-side `image_of_crop` (without it, `image_index` is read
    back once)."""
    from vtoken.launches import count_launches

    def counted(frames: list[int], host: bool = True):
        g = torch.Generator().manual_seed(len(frames))
        tokens = torch.randn(sum(frames), 12, 6, generator=g)
        owners = [v for v, n in enumerate(frames) for _ in range(n)]
        visual = VisualTokens(tokens, (3, 4), {"projected": tokens}, torch.tensor(owners),
                              image_of_crop=owners if host else None)  # fmt: skip
        with count_launches() as launches:
            selection = vtoken.DyCoke(k=0.7).select(visual)
        first = 0
        for count in frames:  # the same picks as the spec
            expected = reference_merge(tokens[first : first + count], 0.7)
            assert [selection.kept_of(f).tolist() for f in range(first, first + count)] == expected
            first += count
        return launches

    runs = [counted(frames) for frames in ([4], [9], [32], [3, 8, 5])]
    assert all(run.syncs == 0 for run in runs), [run.describe() for run in runs]
    assert len({run.kernels for run in runs}) == 1 and runs[0].kernels <= 25, [run.describe() for run in runs]
    unhosted = counted([3, 8, 5], host=False)
    assert unhosted.syncs == 1 and unhosted.kernels == runs[0].kernels, unhosted.describe()


def test_hand_made_frames_keep_what_changed():
    """Frame 1 repeats frame 0 except at positions 3 and 5; frame 2 repeats frame 0 except at 1 and 7 (re-pruned
    against frame 0 as 9 frames have i = 0 and 4 in range(0, 5, 4): frames 2 and 6); frame 8 (odd count) stays."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 4, generator=g)
    video = base.repeat(9, 1, 1)
    video[1, [3, 5]] = -base[[3, 5]]
    video[2, [1, 7]] = -base[[1, 7]]
    video[4] = torch.randn(10, 4, generator=g)
    video[6, [0, 9]] = -video[4, [0, 9]] + 0.1
    selection = vtoken.DyCoke(k=0.75).select(VisualTokens(video, (2, 5), {"projected": video}))
    kept = [selection.kept_of(f).tolist() for f in range(9)]
    assert kept[1] == [3, 5] and kept[2] == [1, 7] and kept[3] == [1, 7] and kept[8] == list(range(10))
    assert kept[0] == kept[4] == list(range(10)) and len(kept[6]) == len(kept[5]) == len(kept[7]) == 2
    assert frame_counts(9, 10, 0.75) == [10, 2, 2, 2, 10, 2, 2, 2, 10]
    assert frame_counts(8, 196, 0.7) == [196, 58, 58, 58, 196, 58, 196, 58]  # range(0, 4, 4): frame 2 only


def test_the_count_is_known_before_encoding():
    """int((1 - k) * tpf) with the official float expression: (1 - 0.7) * 196 = 58.8 -> 58. On OneVision the prompt
    is shrunk before the frames are encoded (the count the encoder then produces is checked against it)."""
    method = vtoken.DyCoke()
    assert method.planned_count(196) is None  # per crop it is not: it depends on the frame's place
    assert method.frame_counts(4, 196) == [196, 58, 196, 58] and method.video_count(4, 196) == 508
    assert frame_counts(2, 10, 0.8) == [10, 1]  # (1 - 0.8) * 10 = 1.9999999999999996 -> 1, as the official
    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = video_inputs(processor, 7)
    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=1)) as handle:
        video = handle.adapter.modalities[1]
        runs = handle.adapter.plan(video, inputs["pixel_values_videos"])
        assert handle.adapter.planned_counts(video, runs) == [sum(frame_counts(7, 196, 0.7)) + 1]  # + the newline
        model(**inputs)  # the prompt shrunk first; `prepare` checks what the encoder produced against it
    assert sum(r.tokens_out for r in handle.records if r.stage == "encoder") == sum(frame_counts(7, 196, 0.7))


# --------------------------------------------------------------------------- stage 2: decode-time selection
def test_decode_keep_on_hand_made_rows():
    method = vtoken.DyCoke(p=0.5)
    attention = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.0], [0.5, 0.1, 0.1, 0.3, 0.0]])
    valid = torch.tensor([[True] * 4 + [False], [True] * 5])
    keep, reselect = method.decode_keep(attention, valid, None)
    assert reselect.all()  # the first step selects
    assert keep.tolist() == [[False, True, False, True, False], [True, False, False, True, False]]  # int(5 * .5) = 2
    similar = attention * 1.01
    different = torch.tensor([[0.4, 0.1, 0.2, 0.3, 0.0], [0.5, 0.1, 0.1, 0.3, 0.0]])
    _, reselect = method.decode_keep(different, valid, similar)
    assert reselect.tolist() == [True, False]  # cosine 0.83 < 0.9; 1.0


@pytest.fixture(scope="module")
def deep_onevision():
    """The tiny LLaVA-OneVision with a 4-layer LLM (GQA: 4 query, 2 key/value heads), queries scaled up."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    config = copy.deepcopy(model.config)
    config.text_config.num_hidden_layers = LAYERS
    torch.manual_seed(1)
    deep = type(model)(config).eval()
    deep.generation_config.pad_token_id = model.generation_config.pad_token_id
    with torch.no_grad():  # sharper attention than random weights give: the top tokens stand out
        for layer in deep.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    return deep, processor


def causal(n, dtype):
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def reference_generate(model, embeds, span, layer, p, threshold, steps=STEPS):
    """Greedy decoding recomputed from scratch at every step by an eager copy of the LLM, layer by layer: a
    generated token that re-selected attends, at layers >= `layer`, only to the span columns it kept.
    Returns per-step logits, the number of selecting steps, the last kept span ranks and the cosines."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    lm, head = eager.model.language_model, eager.lm_head
    weights = {}
    hooks = [lm.layers[layer - 1].self_attn.register_forward_hook(lambda m, a, out: weights.__setitem__(0, out[1]))]
    allowed, previous, logits, selections, last, cosines = {}, None, [], 0, None, []
    with torch.no_grad():
        for step in range(steps):
            n = embeds.shape[1]
            pos = torch.arange(n)[None]
            rotary = lm.rotary_emb(embeds, pos)
            base = causal(n, embeds.dtype)
            hidden = embeds
            for i, block in enumerate(lm.layers):
                if i == layer and step > 0:  # the new token (the last row) decides from layer - 1's row
                    row = weights[0][0].float().mean(0)[-1]
                    scores = [float(row[c]) for c in span]
                    if previous is not None:
                        cosines.append(sum(a * b for a, b in zip(scores, previous, strict=True)) / (
                            sum(a * a for a in scores) ** 0.5 * sum(b * b for b in previous) ** 0.5))  # fmt: skip
                    select = previous is None or cosines[-1] < threshold
                    previous = scores
                    if select:
                        count = int(len(span) * (1 - p))
                        last = sorted(sorted(range(len(span)), key=lambda r: (-scores[r], r))[:count])
                        allowed[n - 1] = {span[r] for r in last}
                        selections += 1
                mask = base.clone()
                if i >= layer:
                    for query, kept in allowed.items():
                        for c in span:
                            if c not in kept:
                                mask[0, 0, query, c] = torch.finfo(embeds.dtype).min
                hidden = block(hidden, attention_mask=mask, position_ids=pos, position_embeddings=rotary)
            logits.append(head(lm.norm(hidden[:, -1])))
            embeds = torch.cat([embeds, lm.embed_tokens(logits[-1].argmax(-1))[:, None]], dim=1)
    for hook in hooks:
        hook.remove()
    return torch.cat(logits), selections, last, cosines


@pytest.mark.parametrize("frames, k, layer, p, threshold", [
    (6, 0.7, 2, 0.7, 0.9),  # the official settings (layer fitted to 4 layers): the first step selects
    (5, 0.5, 1, 0.6, 0.99995),  # every step re-selects
    (3, 0.7, 3, 0.3, 0.9869),  # some steps re-select, others attend to everything (cosines near 0.9865-0.9871)
])  # fmt: skip
def test_equals_the_llm_fed_and_recomputed_by_hand(deep_onevision, frames, k, layer, p, threshold):
    model, processor = deep_onevision
    inputs = video_inputs(processor, frames)
    video_id = model.config.video_token_id
    placed = _placed(model, inputs, video_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    kept = reference_merge(tokens, k)
    visual = [tokens[f, torch.tensor(kf, dtype=torch.long)] for f, kf in enumerate(kept)]
    ids, embeds = shortened_prompt(model, inputs["input_ids"], video_id, [torch.cat([*visual, placed[-1:]])])
    span = (ids[0] == video_id).nonzero().squeeze(1).tolist()[:-1]  # OneVision's closing newline is not chosen
    ref_logits, selections, last, cosines = reference_generate(model, embeds, span, layer, p, threshold)
    method = vtoken.DyCoke(k=k, layer=layer, p=p)
    method.threshold = threshold
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, min_new_tokens=STEPS)  # fmt: skip
        records, summary = handle.records, handle.summary()
    logits = torch.cat(out.logits)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-4
    assert torch.equal(out.sequences[0, inputs["input_ids"].shape[1] :], ref_logits.argmax(-1))
    assert [r.kept.tolist() for r in records if r.stage == "encoder"] == kept
    (decode,) = [r for r in records if r.stage == f"decode.layer{layer}"]
    assert decode.tokens_in == len(span) and decode.tokens_out == int(len(span) * (1 - p))
    assert decode.extra == {"steps": STEPS - 1, "selections": selections} and decode.kept.tolist() == last
    assert f"{selections} of {STEPS - 1} decoding steps (over all rows) selected" in summary
    assert selections == {0.9: 1, 0.99995: STEPS - 1}.get(threshold, selections)
    assert selections == 1 + sum(c < threshold for c in cosines) and (threshold != 0.9869 or 1 < selections < 5)


def reference_beam_search(model, embeds, span, layer, p, threshold, beams, steps):
    """Beam search (no EOS, length_penalty 0: a beam's score is its summed log-probabilities) recomputed by hand:
    every beam decodes with its own DyCoke state (the steps that selected and the previous row), inherited from
    its parent. Returns every final beam's tokens and score, best first."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    lm, head = eager.model.language_model, eager.lm_head
    weights = {}
    hook = lm.layers[layer - 1].self_attn.register_forward_hook(lambda m, a, out: weights.__setitem__(0, out[1]))
    minimum = torch.finfo(embeds.dtype).min

    def run(tokens, allowed, previous):
        """Log-probabilities after `tokens`, and the state after this step."""
        allowed = dict(allowed)
        sequence = torch.cat([embeds, lm.embed_tokens(torch.tensor([tokens], dtype=torch.long))], 1)
        n = sequence.shape[1]
        pos = torch.arange(n)[None]
        rotary, hidden = lm.rotary_emb(sequence, pos), sequence
        for i, block in enumerate(lm.layers):
            if i == layer and tokens:
                row = weights[0][0].float().mean(0)[-1]
                scores = [float(row[c]) for c in span]
                select = previous is None or sum(a * b for a, b in zip(scores, previous, strict=True)) / (
                    sum(a * a for a in scores) ** 0.5 * sum(b * b for b in previous) ** 0.5) < threshold  # fmt: skip
                previous = scores
                if select:
                    top = sorted(range(len(span)), key=lambda r: (-scores[r], r))[: int(len(span) * (1 - p))]
                    allowed[n - 1] = {span[r] for r in top}
            mask = causal(n, sequence.dtype)
            if i >= layer:
                for query, kept in allowed.items():
                    mask[0, 0, query, [c for c in span if c not in kept]] = minimum
            hidden = block(hidden, attention_mask=mask, position_ids=pos, position_embeddings=rotary)
        return head(lm.norm(hidden[:, -1]))[0].float().log_softmax(-1), allowed, previous

    with torch.no_grad():
        live = [([], 0.0, {}, None)]  # tokens, score, allowed, previous
        for _ in range(steps):
            candidates = []
            for tokens, score, allowed, previous in live:
                logprobs, allowed, previous = run(tokens, allowed, previous)
                best = (logprobs + score).topk(beams)
                candidates += [(float(v), tokens + [int(t)], allowed, previous) for v, t in zip(*best, strict=True)]
            candidates.sort(key=lambda c: -c[0])
            live = [(tokens, score, allowed, previous) for score, tokens, allowed, previous in candidates[:beams]]
    hook.remove()
    return [(tokens, score) for tokens, score, _, _ in live]


@pytest.mark.parametrize("layer, threshold", [(1, 0.9), (1, 0.95), (3, 0.96), (2, 0.9)])
def test_beam_search_follows_each_beam(deep_onevision, layer, threshold):
    """Beam search reorders the cache's rows between steps: each beam compares with its own parent's last row (all
    three final beams and their scores)."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 5)
    video_id = model.config.video_token_id
    placed = _placed(model, inputs, video_id)
    tokens = placed[:-1].view(5, -1, placed.shape[-1])
    kept = reference_merge(tokens, 0.7)
    visual = [tokens[f, torch.tensor(kf, dtype=torch.long)] for f, kf in enumerate(kept)]
    ids, embeds = shortened_prompt(model, inputs["input_ids"], video_id, [torch.cat([*visual, placed[-1:]])])
    span = (ids[0] == video_id).nonzero().squeeze(1).tolist()[:-1]
    expected = reference_beam_search(model, embeds, span, layer, 0.7, threshold, beams=3, steps=5)
    method = vtoken.DyCoke(layer=layer)
    method.threshold = threshold
    with torch.no_grad(), vtoken.patched(model, method):
        out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, num_beams=3, num_return_sequences=3,
                             do_sample=False, length_penalty=0.0, output_scores=True,
                             return_dict_in_generate=True)  # fmt: skip
    assert out.sequences[:, inputs["input_ids"].shape[1] :].tolist() == [tokens for tokens, _ in expected]
    assert (out.sequences_scores - torch.tensor([score for _, score in expected])).abs().max() <= 1e-4


def _pair(processor, side):
    questions = ["what happens?", "describe the video in detail please."]
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in questions]
    clips = [_clip(6, 1), _clip(6, 2)]
    processor.tokenizer.padding_side = side
    try:
        batched = processor(videos=clips, text=prompts, return_tensors="pt", padding=True)
    finally:
        processor.tokenizer.padding_side = "left"
    singles = [processor(videos=[c], text=[q], return_tensors="pt") for c, q in zip(clips, prompts, strict=True)]
    return batched, singles


def test_a_padded_batch_equals_its_rows_alone(deep_onevision):
    """Invariant 5: a left-padded batch generates (greedy tokens, per-step logits, selections; beams) what each row
    does alone; a right-padded forward (generate pads on the left) gives each row's logits alone."""
    model, processor = deep_onevision
    batched, singles = _pair(processor, "left")
    right, _ = _pair(processor, "right")
    method = vtoken.DyCoke(layer=1)
    method.threshold = 0.9966  # some steps select, others do not
    generate = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        out = model.generate(**batched, **generate)
        together = [r.extra["selections"] for r in handle.records if r.stage == "decode.layer1"]
        logits = model(**right).logits
        width = batched["input_ids"].shape[1]
        alone = []
        for row, single in enumerate(singles):
            one = model.generate(**single, **generate)
            alone += [r.extra["selections"] for r in handle.records if r.stage == "decode.layer1"]
            assert torch.equal(out.sequences[row, width:], one.sequences[0, single["input_ids"].shape[1] :])
            diff = max((a[row] - b[0]).abs().max() for a, b in zip(out.logits, one.logits, strict=True))
            assert diff <= 1e-4
            expected = model(**single).logits[0]
            assert (logits[row, : expected.shape[0]] - expected).abs().max() <= 1e-4
        beams = dict(max_new_tokens=4, min_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False)
        beam_out = model.generate(**batched, **beams)
        for row, single in enumerate(singles):
            beam_alone = model.generate(**single, **beams)
            assert torch.equal(beam_out[2 * row : 2 * row + 2, width:], beam_alone[:, single["input_ids"].shape[1] :])
    assert together == alone and max(alone) > 1


def test_expanded_rows_select_on_their_own(deep_onevision):
    """num_return_sequences expands the rows before the prefill: each copy keeps its own state (top_k=1 sampling
    is greedy, so every copy decodes what greedy decoding does)."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 6)
    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=2)) as handle:
        greedy = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        copies = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=True, top_k=1,
                                num_return_sequences=3)  # fmt: skip
        decode = [r for r in handle.records if r.stage == "decode.layer2"]
    assert all(torch.equal(row, greedy[0]) for row in copies) and [r.image for r in decode] == [0, 1, 2]


def test_use_cache_false_threads_and_two_calls_give_the_same(deep_onevision):
    """use_cache=False runs with the cache (the selection is defined on it); the state resets at every generate
    call (the official carries the last row over: a second call's first step would compare with it)."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 6)
    generate = dict(max_new_tokens=STEPS, do_sample=False)
    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=2)) as handle:
        first = model.generate(**inputs, **generate)
        records = [(r.stage, r.extra, None if r.kept is None else r.kept.tolist()) for r in handle.records]
        second = model.generate(**inputs, **generate)
        assert [(r.stage, r.extra, None if r.kept is None else r.kept.tolist()) for r in handle.records] == records
        assert torch.equal(model.generate(**inputs, **generate, use_cache=False), first)
        results = [None] * 3

        def run(index):
            torch.set_num_threads(1)
            with torch.no_grad():
                results[index] = model.generate(**inputs, **generate)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert torch.equal(first, second) and all(torch.equal(r, first) for r in results)


def test_a_manual_decoding_loop_equals_generate(deep_onevision):
    """model(...) on the prompt, then one token at a time on the cache it returned: the selection state travels with
    the cache, so the loop decodes what generate does."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 6)
    method = vtoken.DyCoke(layer=1)
    method.threshold = 0.9966
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        expected = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        selections = [r.extra["selections"] for r in handle.records if r.stage == "decode.layer1"]
        out = model(**inputs)
        tokens, mask = [out.logits[:, -1].argmax(-1)], inputs["attention_mask"]
        for _ in range(STEPS - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=tokens[-1][:, None], attention_mask=mask, **hf.cache_kwargs(hf.cache_out(out)))
            tokens.append(out.logits[:, -1].argmax(-1))
        (decode,) = [r for r in handle.records if r.stage == "decode.layer1"]
    assert torch.equal(torch.stack(tokens, 1), expected[:, inputs["input_ids"].shape[1] :])
    assert [decode.extra["selections"]] == selections and decode.extra["steps"] == STEPS - 1 and selections[0] > 1


def test_a_copied_cache_continues_as_the_original(deep_onevision):
    """Branching a conversation (a deep copy of the cache, after two steps) copies the selection state: both
    branches decode alike (with the previous row lost, the copy's next step would select as a first step)."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 6)

    def steps(cache, token, mask, count):
        logits = []
        for _ in range(count):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, **hf.cache_kwargs(cache))
            token = out.logits[:, -1].argmax(-1)
            logits.append(out.logits[:, -1])
        return token, mask, torch.cat(logits)

    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=1)) as handle:
        out = model(**inputs)
        cache = hf.cache_out(out)
        token, mask, _ = steps(cache, out.logits[:, -1].argmax(-1), inputs["attention_mask"], 2)
        branch = copy.deepcopy(cache)
        _, _, original = steps(cache, token, mask, 3)
        (decode,) = [r for r in handle.records if r.stage == "decode.layer1"]
        _, _, copied = steps(branch, token, mask, 3)
    assert torch.equal(original, copied) and decode.extra == {"steps": 5, "selections": 1}


def test_a_second_generate_call_on_the_cache_starts_afresh(deep_onevision):
    """A chat's next turn continues from the cache: its first one-token step selects again."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 4)
    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=2)) as handle:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        ids = torch.cat([out.sequences, inputs["input_ids"][:, -3:]], dim=1)
        more = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf.cache_kwargs(hf.cache_out(out)),
                              max_new_tokens=3, do_sample=False)  # fmt: skip
        (decode,) = [r for r in handle.records if r.stage == "decode.layer2"]
    assert more.shape[1] == ids.shape[1] + 3
    assert decode.extra == {"steps": 2, "selections": 1}  # the new turn's first one-token step selects again


def test_it_composes_with_sparse_prefill(deep_onevision):
    """Sparse prefill changes the prefill's attention only: run dense (a prompt below its min_length) it changes
    nothing; run sparse, both stages record and the decoding steps still select."""
    model, processor = deep_onevision
    inputs = video_inputs(processor, 4)
    generate = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        with vtoken.patched(model, vtoken.DyCoke(layer=2)):
            alone = model.generate(**inputs, **generate)
        with vtoken.patched(model, [vtoken.DyCoke(layer=2), vtoken.SparsePrefill(min_length=10**6)]):
            dense = model.generate(**inputs, **generate)
        with vtoken.patched(model, [vtoken.DyCoke(layer=2), vtoken.SparsePrefill(min_length=1)]) as handle:
            model.generate(**inputs, **generate)
            stages = {r.stage.split(".")[0] for r in handle.records}
            (decode,) = [r for r in handle.records if r.stage == "decode.layer2"]
    assert torch.equal(alone.sequences, dense.sequences)
    assert max((a - b).abs().max() for a, b in zip(alone.logits, dense.logits, strict=True)) <= 1e-5
    assert stages == {"encoder", "decode", "sparse"} and decode.extra["steps"] == 3 and decode.extra["selections"]


# --------------------------------------------------------------------------- families and errors
@pytest.mark.parametrize("name", VIDEO_FAMILIES + ["tiny-qwen3.5"])
def test_every_video_family_fits_its_layer_and_keeps_its_frame_counts(name):
    """layer 1 reads layer 0 (Qwen3.5's hybrid LLM: layer 2 reads layer 1, its first full-attention layer); the
    frames keep DyCoke's counts and decoding re-selects. (Identity, batches, refusals: tests/test_contract.py.)"""
    model, processor = TINY_MODELS[name]()
    layer = 2 if name == "tiny-qwen3.5" else 1
    assert applicable_methods(model)["dycoke"] is None  # with the layer fitted to the LLM: 3 where it has 4 layers
    assert fitting_params(model, "dycoke") == {"layer": {"tiny-qwen3.5": 2, "tiny-qwen3-vl": 3}.get(name, 1)}
    inputs = video_inputs(processor, 4)
    with torch.no_grad(), vtoken.patched(model, vtoken.DyCoke(layer=layer)) as handle:
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        encoder = [r for r in handle.records if r.stage == "encoder"]
        (decode,) = [r for r in handle.records if r.stage.startswith("decode")]
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    assert [r.tokens_out for r in encoder] == frame_counts(len(encoder), encoder[0].tokens_in, 0.7)
    assert decode.extra["steps"] == 2 and decode.extra["selections"] >= 1


def test_clear_errors(deep_onevision):
    model, processor = deep_onevision
    with pytest.raises(vtoken.VTokenError, match="layer=4 is beyond this LLM's 4 layers"):
        vtoken.patch(model, "dycoke", layer=4)
    with pytest.raises(vtoken.VTokenError, match="layer"):
        vtoken.DyCoke(layer=0)
    for bad in (dict(k=1.5), dict(p=-0.1), dict(k="0.7"), dict(p=float("nan"))):
        with pytest.raises(vtoken.VTokenError):
            vtoken.DyCoke(**bad)
    hybrid, _ = TINY_MODELS["tiny-qwen3.5"]()
    with pytest.raises(vtoken.VTokenError, match=r"layer=1 reads the attention row of layer 0.*read one: \[2\]"):
        vtoken.patch(hybrid, vtoken.DyCoke(layer=1))
    assert vtoken.handle_of(hybrid) is None
    with pytest.raises(vtoken.VTokenError, match="act inside the LLM"):
        vtoken.patch(model, [vtoken.DyCoke(layer=2), vtoken.FastV(layer=1)])
    with pytest.raises(vtoken.VTokenError, match="encoder stage"):
        vtoken.patch(model, [vtoken.Random(), vtoken.DyCoke(layer=2)])
    assert vtoken.handle_of(model) is None
    inputs = video_inputs(processor, 4)
    with vtoken.patched(model, vtoken.DyCoke(layer=2)):
        with pytest.raises(vtoken.InputError, match="DynamicCache.*static"):  # it reads each layer's cache whole
            model.generate(**inputs, max_new_tokens=2, cache_implementation="static")
    assert vtoken.handle_of(model) is None
