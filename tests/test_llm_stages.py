"""Prefill and decode stages (FastV, MustDrop) against an independent layer-by-layer reference.

The reference runs the tiny LLaVA's language model one decoder layer at a time with eager attention, on explicit
Python lists of prompt columns: it reads the full attention map, applies each method's rule with loops, drops
hidden states, cuts caches and decodes greedily, so it shares no index arithmetic with `adapters/llm/`.
"""

import math

import pytest
import torch
from conftest import DEEP_LAYERS, OTHER_TINY_MODELS, captured_llm_input, inputs_for
from transformers import DynamicCache

import vtoken
from vtoken.adapters import hf
from vtoken.methods.mustdrop import dual_attention_filter
from vtoken.zoo import TINY_MODELS

LAYERS = DEEP_LAYERS


def fastv_rule(count):
    def decide(attention, cols, visual):
        """attention [n, n] head mean; keep the `count` visual columns the last row attends to most."""
        slots = [s for s, c in enumerate(cols) if c in visual]
        scores = {cols[s]: float(attention[-1, s]) for s in slots}
        return set(sorted(scores, key=lambda c: -scores[c])[:count])

    return decide


def mustdrop_rule(global_thr, individual_thr, protected):
    def decide(attention, cols, visual):
        slots = [s for s, c in enumerate(cols) if c in visual]
        rows = [s for s in range(len(cols)) if cols[s] not in visual and s > slots[0]]
        total = sum(float(attention[t, s]) for t in rows for s in slots)
        kept = set()
        for s in slots:
            column = [float(attention[t, s]) for t in rows]
            dropped = sum(column) < global_thr * total and max(column) < individual_thr
            if not dropped or cols[s] in protected:
                kept.add(cols[s])
        return kept

    return decide


def reference_generate(lm, head, embeds, visual, decide, drop_layers, renumber, cut_layers, steps):
    """One prompt, no padding: per-step logits, the kept visual columns after each drop, each layer's cache length.

    visual: set of prompt columns holding visual tokens; decide(attention [n, n], cols, visual) -> kept visual cols.
    """
    length = embeds.shape[1]
    cols, positions = list(range(length)), list(range(length))
    held, kept_after, cache, weights = [], [], DynamicCache(config=lm.config), {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: weights.__setitem__(i, out[1]))
             for i, layer in enumerate(lm.layers)]  # fmt: skip
    hidden = embeds
    with torch.no_grad():
        for i, layer in enumerate(lm.layers):
            held.append((list(cols), list(positions)))
            n = len(cols)
            pos = torch.tensor([positions])
            causal = torch.full((n, n), torch.finfo(hidden.dtype).min).triu(1)[None, None]
            hidden = layer(hidden, attention_mask=causal, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                           position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
            if i in drop_layers:
                keep_visual = decide(weights[i][0].mean(0), cols, visual)
                kept_after.append(sorted(keep_visual))
                slots = [s for s, c in enumerate(cols) if c not in visual or c in keep_visual]
                hidden = hidden[:, slots]
                cols = [cols[s] for s in slots]
                positions = list(range(len(cols))) if renumber else [positions[s] for s in slots]
        logits = [head(lm.norm(hidden[:, -1]))]
        final = cols
        for i in cut_layers:  # the output-aware cut: keep what survived every drop
            layer_cache = cache.layers[i]
            index = torch.tensor([held[i][0].index(c) for c in final])
            layer_cache.keys, layer_cache.values = layer_cache.keys[:, :, index], layer_cache.values[:, :, index]
        lengths = [cache.layers[i].keys.shape[2] for i in range(len(lm.layers))]
        for step in range(steps - 1):
            token = logits[-1].argmax(-1)
            hidden = lm.embed_tokens(token)[:, None]
            for i, layer in enumerate(lm.layers):
                numbered = max(held[i][1]) + 1 if renumber else length  # right after its last prompt position
                pos = torch.tensor([[numbered + step]])
                hidden = layer(hidden, attention_mask=None, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                               position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
            logits.append(head(lm.norm(hidden[:, -1])))
    for hook in hooks:
        hook.remove()
    return torch.cat(logits), kept_after, lengths


def patched_generate(model, inputs, method, steps):
    with vtoken.patched(model, method) as handle, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        return torch.cat(out.logits), handle.records, handle.adapter.calls.state.protected


CASES = {
    "fastv-original": (lambda: vtoken.FastV(layer=1, keep=0.25), "original"),
    "fastv-renumber": (lambda: vtoken.FastV(layer=2, keep=100, positions="renumber"), "renumber"),
    "mustdrop": (lambda: vtoken.MustDrop(layers=(1, 3), global_thr=0.0025, individual_thr=0.02), "renumber"),
    "mustdrop-original": (
        lambda: vtoken.MustDrop(layers=(0, 2, 3), global_thr=0.0025, individual_thr=0.02, positions="original"),
        "original",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_drop_and_decode_match_the_reference(deep_llava, eager_lm, single, case):
    """Invariant 2 for the LLM stages: per-step logits of 6 greedy tokens, the kept tokens after every drop and
    every layer's KV-cache length equal the layer-by-layer reference."""
    model, _ = deep_llava
    make, policy = CASES[case]
    method = make()
    logits, records, protected = patched_generate(model, single, method, steps=6)
    with vtoken.patched(model, make()):
        embeds = captured_llm_input(model, single)  # what the LLM received (MustDrop: merged tokens)
    ids = single["input_ids"][0]
    if method.name == "mustdrop":  # the prompt shrank to the merged run
        placeholders = sum(r.tokens_out for r in records if r.stage == "encoder.merge")
        start = int((ids == model.config.image_token_id).nonzero()[0])
        visual = set(range(start, start + placeholders))
        keys = set(protected[0].nonzero().squeeze(1).tolist())
        assert len(keys) == math.ceil(0.08 * placeholders)
        decide = mustdrop_rule(method.global_thr, method.individual_thr, keys)
    else:
        visual = set((ids == model.config.image_token_id).nonzero().squeeze(1).tolist())
        decide = fastv_rule(vtoken.tokens_to_keep(method.keep, len(visual)))
    drop_layers = method.drop_layers(LAYERS)
    cut = list(method.cut_layers(drop_layers))  # layer 0's too (the engine masks it, keeping the length)
    lm, head = eager_lm
    ref_logits, kept_after, lengths = reference_generate(
        lm, head, embeds, visual, decide, drop_layers, policy == "renumber", cut, steps=6
    )
    start = min(visual)
    prefill = [r for r in records if r.stage.startswith("prefill")]
    assert [r.stage for r in prefill] == [f"prefill.layer{k}" for k in drop_layers]
    for record, ref_kept in zip(prefill, kept_after, strict=True):
        assert record.tokens_out == len(ref_kept)
    assert sum(len(k) for k in kept_after) < len(visual) * len(kept_after)  # something was dropped
    # kept indices of the first drop are into the LLM's visual run
    assert (prefill[0].kept + start).tolist() == kept_after[0]
    assert (logits - ref_logits).abs().max() <= 1e-4
    if method.name == "mustdrop":
        (kv,) = [r for r in records if r.stage == "decode.kv"]
        assert kv.extra["cache_lengths"] == lengths
        assert prefill[-1].extra["layer_average"] == pytest.approx(
            sum(len([c for c in held_visual(visual, kept_after, drop_layers, i)]) for i in range(LAYERS)) / LAYERS
        )


def held_visual(visual, kept_after, drop_layers, layer):
    """Visual columns layer `layer` runs on in the reference's prefill."""
    done = [k for k in drop_layers if k < layer]
    return kept_after[len(done) - 1] if done else sorted(visual)


def test_dual_attention_filter_matches_loops():
    """Spec parity on hand-made attention maps with padded rows and tokens."""
    torch.manual_seed(0)
    attention = torch.rand(2, 4, 7) ** 4
    row_valid = torch.tensor([[True] * 4, [True, True, False, False]])
    valid = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    attention = attention * row_valid[:, :, None] * valid[:, None, :]
    tokens = vtoken.LayerTokens(2, attention, row_valid, valid)
    for global_thr, individual_thr in [(1.0, 0.0), (0.1, 0.5), (0.2, 0.3), (0.0, 1.0)]:
        kept = dual_attention_filter(tokens, global_thr, individual_thr)
        for b in range(2):
            rows = [r for r in range(4) if row_valid[b, r]]
            cols = [j for j in range(7) if valid[b, j]]
            total = sum(float(attention[b, r, j]) for r in rows for j in cols)
            for j in range(7):
                column = [float(attention[b, r, j]) for r in rows]
                expected = j in cols and not (sum(column) < global_thr * total and max(column) < individual_thr)
                assert bool(kept[b, j]) == expected


def test_fastv_keeps_the_last_rows_top_tokens():
    attention = torch.zeros(2, 1, 6)
    attention[0, 0] = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.0, 0.05])
    attention[1, 0, :4] = torch.tensor([0.4, 0.1, 0.3, 0.2])
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    tokens = vtoken.LayerTokens(2, attention, torch.ones(2, 1, dtype=torch.bool), valid)
    kept = vtoken.FastV(keep=0.5).keep_mask(tokens)
    assert kept[0].nonzero().squeeze(1).tolist() == [0, 1, 3]
    assert kept[1].nonzero().squeeze(1).tolist() == [0, 2]  # half of the row's 4 valid tokens


@pytest.mark.parametrize(
    "method",
    [
        vtoken.FastV(layer=1, keep=1.0),
        vtoken.FastV(layer=0, keep=1.0, positions="renumber"),
        vtoken.MustDrop(merge_threshold=1.01, layers=(1, 3)),
    ],  # fmt: skip
    ids=["fastv", "fastv-renumber", "mustdrop"],
)
def test_keeping_everything_is_the_identity(deep_llava, photos, method):
    """Invariant 1: keep-all FastV and MustDrop with no merge and its default thresholds give the unpatched
    logits and greedy tokens, on a padded batch."""
    from conftest import assert_identity

    model, processor = deep_llava
    inputs = inputs_for(processor, [photos["astronaut"], photos["coffee"]], ["what is this?", "describe it please."])
    with torch.no_grad():
        ref = model(**inputs).logits
        with vtoken.patched(model, method) as handle:
            logits = model(**inputs).logits
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    assert all(r.tokens_out == r.tokens_in for r in handle.records if r.stage.startswith("prefill"))
    assert_identity(model, method, inputs)


@pytest.mark.parametrize(
    "make",
    [
        lambda: vtoken.FastV(layer=1, keep=0.25),
        lambda: vtoken.MustDrop(layers=(1, 3), global_thr=0.0025, individual_thr=0.02),
    ],  # fmt: skip
    ids=["fastv", "mustdrop"],
)
def test_padded_batch_and_beams_equal_one_by_one(deep_llava, photos, make):
    """Invariant 5 with the LLM stages: 20 greedy tokens of a left-padded batch of 2, and beam search with
    num_return_sequences, equal each sample run alone."""
    model, processor = deep_llava
    questions = ["what is this?", "describe the image in detail. how many shapes are there?"]
    images = [photos["astronaut"], photos["coffee"]]
    batched = inputs_for(processor, images, questions)
    singles = [inputs_for(processor, [image], [q]) for image, q in zip(images, questions, strict=True)]
    width = batched["input_ids"].shape[1]
    beams = dict(max_new_tokens=4, min_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    greedy = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True)
    greedy["return_dict_in_generate"] = True
    with vtoken.patched(model, make()) as handle, torch.no_grad():
        out = model.generate(**batched, **greedy)
        kept = [r.tokens_out for r in handle.records if r.stage.startswith("prefill")]
        beam_out = model.generate(**batched, **beams)
        for row, one in enumerate(singles):
            alone = model.generate(**one, **greedy)
            assert torch.equal(out.sequences[row, width:], alone.sequences[0, one["input_ids"].shape[1] :])
            step_logits = torch.stack([s[row] for s in out.logits])
            assert (step_logits - torch.cat(alone.logits)).abs().max() <= 1e-4
            assert kept[row::2] == [r.tokens_out for r in handle.records if r.stage.startswith("prefill")]
            beam_alone = model.generate(**one, **beams)
            assert torch.equal(beam_out[2 * row : 2 * row + 2, width:], beam_alone[:, one["input_ids"].shape[1] :])
    assert min(kept) < 576  # tokens were dropped


def test_prefill_drop_saves_cache_and_composes_with_an_encoder_method(deep_llava, eager_lm, single):
    """HiRED (encoder) + FastV (prefill) together: the LLM receives HiRED's tokens, FastV drops among them as
    the reference does, and later layers' caches really hold fewer tokens."""
    model, _ = deep_llava
    methods = [vtoken.HiRED(budget=0.5), vtoken.FastV(layer=2, keep=0.5)]
    with vtoken.patched(model, methods) as handle, torch.no_grad():
        out = model(**single, use_cache=True)
        embeds = captured_llm_input(model, single)
        stages = [r.stage for r in handle.records]
        lengths = [layer.keys.shape[2] for layer in hf.cache_out(out).layers]
    with vtoken.patched(model, vtoken.HiRED(budget=0.5)):
        assert torch.equal(embeds, captured_llm_input(model, single))
    assert stages == ["encoder", "prefill.layer2"]
    prompt = embeds.shape[1]
    assert lengths == [prompt] * 3 + [prompt - 144] * 3  # 288 HiRED tokens, FastV keeps 144 after layer 2
    lm, head = eager_lm
    start = int((single["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    visual = set(range(start, start + 288))
    ref_logits, _, _ = reference_generate(lm, head, embeds, visual, fastv_rule(144), (2,), False, [], steps=1)
    assert (out.logits[:, -1] - ref_logits).abs().max() <= 1e-4


def test_stage_conflicts_and_bad_parameters_fail_at_patch_time(deep_llava):
    model, _ = deep_llava
    cases = [
        ([vtoken.FastV(), vtoken.MustDrop()], "prefill stage"),
        ([vtoken.HiRED(), vtoken.MustDrop()], "encoder stage"),
        (vtoken.FastV(layer=5), "at most 4"),
        (vtoken.MustDrop(layers=(2, 6, 10, 14)), "has 6 layers"),
    ]
    for method, message in cases:
        with pytest.raises(vtoken.VTokenError, match=message):
            vtoken.patch(model, method)
        assert vtoken.handle_of(model) is None
    for bad, message in [(dict(keep=0), "keep=0"), (dict(layer=-1), "layer=-1"), (dict(positions="x"), "accepted")]:
        with pytest.raises(vtoken.VTokenError, match=message):
            vtoken.FastV(**bad)
    with pytest.raises(vtoken.VTokenError, match="ascending"):
        vtoken.MustDrop(layers=(6, 2))
    with pytest.raises(vtoken.VTokenError, match="unknown parameter"):
        vtoken.patch(model, "mustdrop", budget=0.2)


def reference_merge(crops, side, threshold, window=3):
    """Loop version of MustDrop's merge over one image's crops [C, N, D]: windows row-major, mean pairwise cosine
    similarity over ordered pairs, r = the smallest count over the crops, [merged by score desc, rest ascending]."""
    per_crop = []
    for x in crops:
        scores = {}
        for wy in range(side // window):
            for wx in range(side // window):
                tokens = [(wy * window + dy) * side + wx * window + dx for dy in range(window) for dx in range(window)]
                pairs = [(i, j) for i in tokens for j in tokens if i != j]
                scores[tuple(tokens)] = sum(float(torch.cosine_similarity(x[i], x[j], dim=0)) for i, j in pairs) / len(
                    pairs
                )
        per_crop.append(scores)
    r = min(sum(s >= threshold for s in scores.values()) for scores in per_crop)
    out = []
    for x, scores in zip(crops, per_crop, strict=True):
        merged = sorted(scores, key=lambda w: -scores[w])[:r]
        rest = sorted(set(range(side * side)) - {t for w in merged for t in w})
        out.append(torch.stack([x[list(w)].mean(0) for w in merged] + [x[t] for t in rest]))
    return torch.stack(out)


def test_window_merge_matches_loops_on_hand_made_features():
    torch.manual_seed(0)
    side, dim = 6, 8
    crops = torch.randn(2, side * side, dim)
    windows = [[(wy * 3 + dy) * side + wx * 3 + dx for dy in range(3) for dx in range(3)]
               for wy in range(2) for wx in range(2)]  # fmt: skip
    crops[0, windows[1]] = torch.randn(dim)  # identical tokens: score 1
    crops[0, windows[3]] = torch.randn(dim) + 0.05 * torch.randn(9, dim)  # nearly identical
    crops[1, windows[2]] = torch.randn(dim) + 0.1 * torch.randn(9, dim)
    crops[1, windows[0]] = torch.randn(dim) + 0.02 * torch.randn(9, dim)
    for threshold in (0.8, 0.999, 1.01):
        plan = vtoken.MustDrop(merge_threshold=threshold).plan_merge(crops, (side, side))
        expected = reference_merge(crops, side, threshold)
        assert plan.apply(crops).shape == expected.shape
        assert torch.allclose(plan.apply(crops), expected, atol=1e-6)
    assert vtoken.MustDrop().plan_merge(crops, (side, side)).num_tokens == side * side - 2 * 8  # r = 2


def test_tower_merge_and_key_set_match_an_eager_reference(deep_llava, single):
    """The encoder stage on the real tower: an eager copy merged by the loop reference after layer 0 gives the
    features the LLM receives, and the key set is the top ceil(0.08 N') of its last layer's [CLS] attention."""
    from transformers import CLIPVisionModel

    model, _ = deep_llava
    method = vtoken.MustDrop(layers=(1,))
    with vtoken.patched(model, method) as handle:
        embeds = captured_llm_input(model, single)
        protected = handle.adapter.calls.state.protected[0]
        records = handle.records
    tower = model.model.vision_tower
    config = tower.config.__class__.from_dict(tower.config.to_dict())
    config._attn_implementation = "eager"
    eager = CLIPVisionModel(config).eval()
    eager.load_state_dict(tower.state_dict())

    def merge(module, args, output):
        return torch.cat([output[:, :1], reference_merge(output[:, 1:], 24, method.merge_threshold)], dim=1)

    hook = eager.encoder.layers[0].register_forward_hook(merge)
    with torch.no_grad():
        out = eager(single["pixel_values"], output_attentions=True, output_hidden_states=True)
        features = model.model.multi_modal_projector(out.hidden_states[-2][:, 1:])
    hook.remove()
    count = features.shape[1]
    assert 0 < count < 576  # some windows merged
    assert [(r.stage, r.tokens_in, r.tokens_out) for r in records[:2]] == [
        ("encoder.merge", 576, count),
        ("encoder.keyset", count, math.ceil(0.08 * count)),
    ]
    visual = single["input_ids"][0] == model.config.image_token_id
    start = int(visual.nonzero()[0])
    assert torch.allclose(embeds[0, start : start + count], features[0], atol=1e-5)
    scores = out.attentions[-1][0, :, 0, 1:].mean(0)
    keys = set(scores.topk(math.ceil(0.08 * count)).indices.tolist())
    assert set((protected.nonzero().squeeze(1) - start).tolist()) == keys


@pytest.mark.parametrize("name", [n for n in OTHER_TINY_MODELS if n != "tiny-gemma3"])  # Gemma 3: refused
def test_fastv_on_every_family_keeps_its_count(name, photos):
    """FastV is family-agnostic: on a padded batch (or a clip) at 25 % every row keeps its count (original
    positions; Qwen's M-RoPE positions are kept). (Identity, batches, beams, restore: tests/test_contract.py.)"""
    from conftest import video_inputs

    model, processor = TINY_MODELS[name]()
    layer = 1 if name.startswith("tiny-qwen3.5") else 0  # Qwen3.5's hybrid LLM: layer 1 is its first full one
    video = name == "tiny-video-llava"  # its tiny processor feeds the video path in the tests elsewhere
    if video:
        batched = video_inputs(processor)
    else:
        images, questions = [photos["coffee"], photos["rocket"]], ["what is this?", "describe the image please."]
        batched = inputs_for(processor, images, questions)
    with vtoken.patched(model, vtoken.FastV(layer=layer, keep=0.25)) as handle, torch.no_grad():
        model(**batched)
        for record in handle.records:
            assert record.tokens_out == vtoken.tokens_to_keep(0.25, record.tokens_in)


def test_mustdrop_on_llava_next_official_layout(photos):
    """LLaVA-NeXT (official layout): every crop merged with one r per image, crops concatenated flat; the
    placeholder run, key set and records agree, and a padded batch equals one-by-one runs."""
    from conftest import assert_batch_equals_one_by_one

    model, processor = TINY_MODELS["tiny-llava-next"]()
    images, questions = [photos["coffee"], photos["rocket"]], ["what is this?", "describe the image please."]
    batched = inputs_for(processor, images, questions)
    singles = [inputs_for(processor, [i], [q]) for i, q in zip(images, questions, strict=True)]
    method = vtoken.MustDrop(layers=(0,), global_thr=0.003, individual_thr=0.05)
    with pytest.raises(vtoken.VTokenError, match="layout='official'"):
        vtoken.patch(model, method)
    with vtoken.patched(model, method, layout="official") as handle, torch.no_grad():
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=4)
        model(**batched)
        merged = [r for r in handle.records if r.stage == "encoder.merge"]
        keyset = [r for r in handle.records if r.stage == "encoder.keyset"]
        for image in (0, 1):
            outs = {r.tokens_out for r in merged if r.image == image}
            assert len(outs) == 1  # one r for all crops of an image
            total = sum(r.tokens_out for r in merged if r.image == image)
            assert sum(r.tokens_out for r in keyset if r.image == image) == sum(
                math.ceil(0.08 * r.tokens_out) for r in merged if r.image == image
            )
            placeholders = int((handle.adapter.calls.state.visual[image]).sum())  # the LLM's visual run
            assert placeholders == total
            protected = handle.adapter.calls.state.protected[image]
            assert int(protected.sum()) == sum(r.tokens_out for r in keyset if r.image == image)
        assert all(r.tokens_in == 576 for r in merged)


def test_unpatch_removes_every_llm_hook(deep_llava, single):
    """Invariant 4 for the LLM stages: after unpatching MustDrop, no hook is left on any module and the model
    computes exactly what it did before."""
    model, _ = deep_llava

    def hook_count():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    method = vtoken.MustDrop(layers=(1, 3), global_thr=0.0025, individual_thr=0.02)
    with torch.no_grad():
        with vtoken.patched(model, method):  # transformers adds its own output-recording hooks on first use
            model(**single)
        before, hooks = model(**single).logits, hook_count()
        with vtoken.patched(model, method):
            assert hook_count() > hooks
            pruned = model(**single).logits
        after = model(**single).logits
    assert hook_count() == hooks
    assert pruned.shape[1] < before.shape[1] and torch.equal(after, before)


def test_a_manual_decoding_loop_equals_generate(deep_llava, single):
    """model(...) with the cache it returned, step by step, gives generate's logits after a pruned prefill
    (MustDrop: the prompt shrinks before the LLM, by the merge, and again inside it); a step whose mask does not
    cover the prompt fails clearly."""
    model, _ = deep_llava
    methods = [vtoken.MustDrop(layers=(1, 3), global_thr=0.0025, individual_thr=0.02)]
    with vtoken.patched(model, methods), torch.no_grad():
        want = model.generate(**single, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                              return_dict_in_generate=True).logits  # fmt: skip
        out = model(**single, use_cache=True)
        logits, cache, mask = [out.logits[:, -1]], hf.cache_out(out), single["attention_mask"]
        for _ in range(3):
            token = logits[-1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, **hf.cache_kwargs(cache), use_cache=True)
            logits.append(out.logits[:, -1])
        with pytest.raises(vtoken.InputError, match="attention_mask covering"):
            model(input_ids=token, attention_mask=mask[:, :-3], **hf.cache_kwargs(cache), use_cache=True)
    assert (torch.stack(logits) - torch.stack(want)).abs().max() <= 1e-4
