"""The LLM engine's support for the video methods of issue 43, through `vtoken.patch` + generate: PruneVid's cut
inside the LLM (the encoder stage's groups handed to the drop, the plain attention of the rows after the video, the
caches of layers 0..K cut, layer 0's included) and FrameFusion's mid-layer call points (call 0 on the LLM's input,
call c after layer c - 1's attention and residual, before its MLP; merges, the prune, caches holding what each
layer saw).

The reference is the unpatched LLM of a tiny LLaVA-OneVision run by hand, one decoder layer at a time with eager
attention, on Python lists of prompt columns: it splits each layer at its residual itself, applies the spec's rules
with the plain references of `video_references.py` and loops, cuts caches physically (layer 0 too) and decodes
greedily at the unpruned prompt's positions; a second chat turn continues from its own cache.
"""

import copy
import pickle

import pytest
import torch
from conftest import assert_batch_equals_one_by_one, captured_llm_input
from test_fastvid import sharpened_onevision
from test_prunevid import naive_plain_attention, naive_quota_keep
from test_vidcom2 import _clip, _placed
from transformers import DynamicCache
from video_references import framefusion_merge, framefusion_prune, framefusion_ratio, prunevid

import vtoken
from vtoken.adapters import hf
from vtoken.launches import count_launches
from vtoken.zoo import TINY_MODELS, build_prompt

LAYERS = 4
STEPS = 4


@pytest.fixture(scope="module")
def onevision():
    """The tiny LLaVA-OneVision with a 4-layer LLM (features that tell tokens apart) and an eager copy of its
    language model and head (attention maps)."""
    model, processor = sharpened_onevision(text_layers=LAYERS)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return model, processor, (eager.model.language_model, eager.lm_head)


def clip_inputs(processor, frames=4, question="what happens?", seed=0):
    return processor(videos=[_clip(frames, seed)], text=[build_prompt(processor, question, 0, 1)], return_tensors="pt")


def causal(n, dtype=torch.float32):
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def decode_by_hand(lm, head, cache, logits, length, steps, then=None):
    """Greedy decoding from a cache whose layers hold what they saw (each attends to all of its own), the first
    token at position `length` (the unpruned prompt's): the logits of `steps` steps (`logits` [1, V] the first);
    with `then` [1, n], a later turn's tokens fed after them (the last generated token first), and its `steps`
    steps' logits too."""

    def step(ids, position):
        n = ids.shape[1]
        hidden = lm.embed_tokens(ids)
        pos = torch.arange(position, position + n)[None]
        for layer in lm.layers:
            past = layer_length(cache, layer)
            mask = torch.zeros(1, 1, n, past + n)
            mask[..., past:] = causal(n)[0, 0]
            hidden = layer(hidden, attention_mask=mask, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                           position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
        return head(lm.norm(hidden[:, -1]))

    with torch.no_grad():
        first, position = [logits], length
        for _ in range(steps - 1):
            first.append(step(first[-1].argmax(-1, keepdim=True), position))
            position += 1
        if then is None:
            return torch.cat(first)
        ids = torch.cat([first[-1].argmax(-1, keepdim=True), then], dim=1)
        second = [step(ids, position)]
        position += ids.shape[1]
        for _ in range(steps - 1):
            second.append(step(second[-1].argmax(-1, keepdim=True), position))
            position += 1
    return torch.cat(first), torch.cat(second)


def layer_length(cache, layer):
    return hf.cache_layers(cache)[layer.self_attn.layer_idx].keys.shape[2]


# --------------------------------------------------------------------------- PruneVid's cut
def prunevid_by_hand(lm, head, embeds, visual, groups, layer, alpha):
    """The spec's steps 8-10 on one prompt: embeds [1, L, D]; visual: its visual columns; groups: {column: group}
    (OneVision's newline in none). Returns (logits [1, V] of the prompt's last token, the cache, kept columns)."""
    length = embeds.shape[1]
    cols, hidden, cache, seen, held = list(range(length)), embeds, DynamicCache(config=lm.config), {}, []
    attention = lm.layers[layer].self_attn
    hooks = [attention.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
             attention.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))]  # fmt: skip
    try:
        with torch.no_grad():
            for i, block in enumerate(lm.layers):
                held.append(list(cols))
                n, pos = len(cols), torch.tensor([cols])  # original positions
                hidden = block(hidden, attention_mask=causal(n), position_ids=pos, **hf.cache_kwargs(cache),
                               use_cache=True, position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
                if i != layer:
                    continue
                d = attention.head_dim
                q, k = seen["q"].view(1, n, -1, d), seen["k"].view(1, n, -1, d)
                rows = [s for s in range(n) if cols[s] > max(visual)]  # every token after the video
                slots = torch.tensor([[cols.index(c) for c in visual]])
                scores = naive_plain_attention(q[:, rows], k, torch.ones(1, n, dtype=torch.bool), slots,
                                               attention.scaling).amax(1)  # fmt: skip
                names = sorted({g for g in groups.values()})
                dense = torch.tensor([[names.index(groups[c]) if c in groups else -1 for c in visual]])
                sizes = [sum(1 for g in groups.values() if g == name) for name in names]
                quotas = torch.tensor([[int(size * alpha) for size in sizes]])
                keep = naive_quota_keep(scores, dense, quotas, torch.ones_like(dense, dtype=torch.bool))[0]
                kept = {c for c, k in zip(visual, keep.tolist(), strict=True) if k}
                slots = [s for s, c in enumerate(cols) if c not in visual or c in kept]
                hidden, cols = hidden[:, slots], [cols[s] for s in slots]
            logits = head(lm.norm(hidden[:, -1]))
    finally:
        for hook in hooks:
            hook.remove()
    for i in range(layer + 1):  # the caches of layers 0..K (layer 0 too) cut to what survived
        index = torch.tensor([held[i].index(c) for c in cols])
        cut = hf.cache_layers(cache)[i]
        cut.keys, cut.values = cut.keys[:, :, index], cut.values[:, :, index]
    return logits, cache, sorted(kept)


def prunevid_reference(model, processor, eager, inputs, frames, settings, layer, then=None):
    """The by-hand run of PruneVid on OneVision: the encoder stage's tokens from the spec's reference (in output
    order, then the newline), the cut after `layer`, decoding (and a later turn `then`)."""
    placed = _placed(model, inputs, model.config.video_token_id)
    tokens = placed[:-1].view(frames, -1, placed.shape[-1])
    expected, _ = prunevid(tokens, **{k: v for k, v in settings.items() if k != "alpha"})
    features = [v for rows in expected for _, v, _ in rows]
    kinds = [(f if kind == "static" else frames + f) for f, rows in enumerate(expected) for _, _, kind in rows]
    ids = inputs["input_ids"][0]
    token = model.config.video_token_id
    run = (ids == token).nonzero().squeeze(1)
    new_ids = torch.cat([ids[: run[0]], torch.full((len(features) + 1,), token), ids[run[-1] + 1 :]])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(new_ids[None])
        embeds[0, new_ids == token] = torch.cat([torch.stack(features).float(), placed[-1:]])
    start = int(run[0])
    visual = list(range(start, start + len(features) + 1))
    groups = {start + j: g for j, g in enumerate(kinds)}
    lm, head = eager
    logits, cache, kept = prunevid_by_hand(lm, head, embeds, visual, groups, layer, settings.get("alpha", 0.4))
    return decode_by_hand(lm, head, cache, logits, len(new_ids), STEPS, then), [c - start for c in kept]


PRUNEVID = [dict(min_tokens=6, tau=0.5, layer=1), dict(min_tokens=6, tau=0.5, alpha=0.25, layer=0)]


@pytest.mark.parametrize("settings", PRUNEVID, ids=["layer1", "layer0"])
def test_prunevid_cut_equals_the_llm_fed_by_hand(onevision, settings):
    """Steps 8-10 after the encoder stage: the rows after the video's newline, the plain attention's max over heads
    and rows, each window's and frame's share kept, layers 0..K's caches cut (layer 0's masked, the length
    transformers reads kept), original positions; greedy logits of 4 steps equal the by-hand run's."""
    model, processor, eager = onevision
    inputs, frames = clip_inputs(processor, 6), 6
    settings = dict(settings)
    layer = settings.pop("layer")
    with vtoken.patched(model, vtoken.PruneVid(layer=layer, **settings)) as handle, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        records = handle.records
        cache = hf.cache_out(out)
    ref_logits, kept = prunevid_reference(model, processor, eager, inputs, frames, settings, layer)
    (cut,) = [r for r in records if r.stage == f"prefill.layer{layer}"]
    assert cut.kept.tolist() == kept and cut.tokens_out == len(kept) < cut.tokens_in
    assert (torch.cat(out.logits) - ref_logits).abs().max() <= 1e-4
    lengths = [cached.keys.shape[2] for cached in hf.cache_layers(cache)]
    assert len(set(lengths[1:])) == 1 and lengths[0] > lengths[1]  # layer 0 keeps the length transformers reads
    (kv,) = [r for r in records if r.stage == "decode.kv"]
    assert len(set(kv.extra["cache_lengths"])) == 1  # what each layer holds: the cut, layer 0's masked


# --------------------------------------------------------------------------- FrameFusion's call points
def framefusion_by_hand(lm, head, embeds, candidates, settings, rows):
    """The spec on one prompt: candidates {column: (video, slot)}; every layer split at its residual by hand (call 0
    before layer 0, call c after layer c - 1's attention, before its MLP). Returns (logits of the prompt's last
    token, the cache (each layer what its attention saw), the log [(what, call, candidates after)], the columns
    that reach the last layer)."""
    layers = len(lm.layers)
    cols, hidden, cache = list(range(embeds.shape[1])), embeds, DynamicCache(config=lm.config)
    alive = {c: (c, *candidates[c]) for c in sorted(candidates)}
    state = {"phase": "merge", "sparsities": [], "log": []}
    cost, threshold, floor = settings["cost"], settings["threshold"], settings["ratio_floor"]

    def keep_only(survivors):
        nonlocal hidden, cols
        slots = [s for s, c in enumerate(cols) if c not in alive or c in survivors]
        for c in list(alive):
            if c not in survivors:
                del alive[c]
        hidden, cols = hidden[:, slots], [cols[s] for s in slots]

    def call(point, weights):
        nonlocal hidden
        if state["phase"] == "done":
            return
        if state["phase"] == "prune":  # the attention of the layer before this call, its last `rows` rows
            ratio = framefusion_ratio(state["sparsities"], layers, cost)
            probs = weights[0].mean(0)[-rows:].mean(0)
            scores = {c: float(probs[cols.index(c)]) for c in alive}
            keep_only(set(framefusion_prune(scores, round(len(alive) * (1 - ratio)))))
            state["log"].append(("prune", point, len(alive)))
            state["phase"] = "done"
            return
        u = framefusion_ratio(state["sparsities"], layers, cost)
        states = {c: hidden[0, cols.index(c)].double() for c in alive}
        merged, r, branch, due = framefusion_merge(list(alive.values()), states, threshold, u, floor)
        for c, value in merged.items():
            hidden[0, cols.index(c)] = value.float()
        keep_only(set(merged))
        state["log"].append((branch, point, len(alive)))
        if branch == "top-k":
            state["phase"] = "done"
        else:
            state["sparsities"].append(r)
            state["phase"] = "done" if point == layers - 1 else "prune" if due else "merge"

    with torch.no_grad():
        hidden = hidden.clone()
        call(0, None)
        for i, block in enumerate(lm.layers):
            n, pos = len(cols), torch.tensor([cols])
            out, weights = block.self_attn(hidden_states=block.input_layernorm(hidden), attention_mask=causal(n),
                                           position_ids=pos, position_embeddings=lm.rotary_emb(hidden, pos),
                                           **hf.cache_kwargs(cache), use_cache=True)  # fmt: skip
            hidden = hidden + out
            if i < layers - 1:
                hidden = hidden.clone()
                call(i + 1, weights)
            hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
        logits = head(lm.norm(hidden[:, -1]))
    return logits, cache, state["log"], cols


def onevision_candidates(inputs, token_id, frames):
    """{column: (0, slot)} of a one-video OneVision prompt: its frames' tokens (the newline after them none)."""
    run = (inputs["input_ids"][0] == token_id).nonzero().squeeze(1).tolist()
    per_frame = (len(run) - 1) // frames
    return {c: (0, j % per_frame) for j, c in enumerate(run[:-1])}


FRAMEFUSION = {  # on the tiny model: what each setting does, the calls that act
    "merges-then-prune": (dict(threshold=0.5, cost=0.3, ratio_floor=0.1), ["threshold"] * 3 + ["prune"]),
    "merges-then-top-k": (dict(threshold=0.7, cost=0.6, ratio_floor=0.0), ["threshold"] * 2 + ["top-k"]),
    "top-k-at-the-input": (dict(threshold=0.3, cost=0.3, ratio_floor=0.1), ["top-k"]),
}


def framefusion_log(records, row=0, newline=1):
    """[(branch or "prune", call, candidates after)] of a row's call records (a record counts the row's visual
    tokens: OneVision's `newline` too)."""
    log = []
    for r in records:
        if r.image == row and r.stage.startswith("prefill.merge.c"):
            log.append((r.extra["branch"], int(r.stage.removeprefix("prefill.merge.c")), r.tokens_out - newline))
        elif r.image == row and r.stage.startswith("prefill.prune.layer"):  # scored by the layer before the call
            log.append(("prune", int(r.stage.removeprefix("prefill.prune.layer")) + 1, r.tokens_out - newline))
    return log


@pytest.mark.parametrize("case", list(FRAMEFUSION))
def test_framefusion_equals_the_llm_split_by_hand(onevision, case):
    """Merges at call 0 (the LLM's input) and after layers' attention, the prune reading the attention of the layer
    before its call, caches holding what each layer saw (layer 0's spread back to the prompt's length), original
    positions: the call log, the tokens reaching the last layer and 4 greedy steps' logits equal the by-hand run."""
    model, processor, (lm, head) = onevision
    inputs, frames = clip_inputs(processor, 4), 4
    settings, branches = FRAMEFUSION[case]
    with vtoken.patched(model, vtoken.FrameFusion(**settings)) as handle, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        records = handle.records
    embeds = captured_llm_input(model, inputs)
    candidates = onevision_candidates(inputs, model.config.video_token_id, frames)
    logits, cache, log, cols = framefusion_by_hand(lm, head, embeds, candidates, settings, rows=1)
    assert framefusion_log(records) == log
    assert [what for what, _, _ in log] == branches
    last = [r for r in records if r.stage.startswith("prefill.")][-1]
    first = min(candidates)  # the video's run: its frames' tokens, then the newline (never a candidate)
    visual = len(candidates) + 1
    assert last.kept.tolist() == [c - first for c in cols if 0 <= c - first < visual]  # (the newline last)
    assert last.tokens_out == len(last.kept) and "sparsity" in last.extra and 0 < last.extra["cost"] <= 1
    ref = decode_by_hand(lm, head, cache, logits, embeds.shape[1], STEPS)
    assert (torch.cat(out.logits) - ref).abs().max() <= 1e-4
    assert hf.cache_layers(hf.cache_out(out))[0].keys.shape[2] == out.sequences.shape[1] - 1


# --------------------------------------------------------------------------- both: batches, use_cache, chat
METHODS = {
    "prunevid": lambda: vtoken.PruneVid(layer=1, min_tokens=6, tau=0.5),
    "framefusion": lambda: vtoken.FrameFusion(**FRAMEFUSION["merges-then-prune"][0]),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_padded_batch_equals_rows_alone_and_use_cache(onevision, name):
    model, processor, _ = onevision
    questions = ("what happens?", "describe what the video shows, please.")
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in questions]
    clips = [_clip(4, 1), _clip(4, 2)]
    batched = processor(videos=clips, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(videos=[c], text=[p], return_tensors="pt") for c, p in zip(clips, prompts, strict=True)]
    greedy = dict(max_new_tokens=3, do_sample=False)
    with torch.no_grad(), vtoken.patched(model, METHODS[name]()):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)
        cached = model.generate(**singles[0], **greedy)
        assert torch.equal(model.generate(**singles[0], **greedy, use_cache=False), cached)
        forward = model(**singles[0], use_cache=False).logits[:, -1]
        again = model(**singles[0]).logits[:, -1]
    assert (forward - again).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(METHODS))
def test_a_second_chat_turn_continues_the_cache(onevision, name):
    """Turn 2 (text) on the cache a pruned turn 1 left equals the by-hand run continued on its own cache."""
    model, processor, eager = onevision
    inputs = clip_inputs(processor, 4)
    content = [{"type": "text", "text": "and then?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    new_ids = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    greedy = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    with vtoken.patched(model, METHODS[name]()), torch.no_grad():
        out1 = model.generate(**inputs, **greedy)
        ids = torch.cat([out1.sequences, new_ids], dim=1)
        out2 = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy,
                              **hf.cache_kwargs(hf.cache_out(out1)))  # fmt: skip
    if name == "prunevid":
        settings = dict(min_tokens=6, tau=0.5)
        (first, second), _ = prunevid_reference(model, processor, eager, inputs, 4, settings, 1, then=new_ids)
    else:
        lm, head = eager
        embeds = captured_llm_input(model, inputs)
        candidates = onevision_candidates(inputs, model.config.video_token_id, 4)
        logits, cache, _, _ = framefusion_by_hand(lm, head, embeds, candidates, FRAMEFUSION["merges-then-prune"][0], 1)
        first, second = decode_by_hand(lm, head, cache, logits, embeds.shape[1], STEPS, then=new_ids)
    assert (torch.cat(out1.logits) - first).abs().max() <= 1e-4
    assert (torch.cat(out2.logits) - second).abs().max() <= 1e-4


# --------------------------------------------------------------------------- other families, copies, refusals
@pytest.mark.parametrize("family", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-internvl", "tiny-video-llava",
                                    "tiny-llava-next-video"])  # fmt: skip
def test_framefusion_on_other_families_batches_as_rows_alone(family):
    """FrameFusion on the families the spec lists (Qwen2-VL, Qwen3-VL, InternVL, Video-LLaVA, LLaVA-NeXT-Video):
    a padded batch of two videos equals the rows alone; something merged or pruned."""
    from conftest import video_inputs

    model, processor = TINY_MODELS[family]()
    questions = ("what happens?", "describe the video please.")
    singles = [video_inputs(processor, 4, q) for q in questions]
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in questions]
    from vtoken.images import example_clip

    batched = processor(videos=[example_clip(4)] * 2, text=prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), vtoken.patched(model, vtoken.FrameFusion(threshold=0.5, cost=0.5)) as handle:
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)
        records = [r for r in handle.records if r.stage.startswith("prefill.")]
    assert records and any(r.tokens_out < r.tokens_in for r in records)


def test_framefusion_patch_copies_and_restores():
    """The split layers are this instance's: a deep copy and a pickled copy (made before any call: transformers'
    own first-call hooks do not pickle) are patched on their own; unpatch leaves the class's forward."""
    model, processor = TINY_MODELS["tiny-onevision"](text_layers=3)
    inputs = clip_inputs(processor, 4)
    layers = model.model.language_model.layers
    method = vtoken.FrameFusion(threshold=0.5, cost=0.4)
    vtoken.patch(model, method)
    pickled = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        try:
            assert all("forward" in layer.__dict__ for layer in layers[:-1])
            patched = model(**inputs).logits[:, -1]
            twin = copy.deepcopy(model)
            for other in (twin, pickled):
                assert (other(**inputs).logits[:, -1] - patched).abs().max() <= 1e-6
                assert vtoken.handle_of(other) is not None and [r.stage for r in vtoken.handle_of(other).records]
        finally:
            vtoken.unpatch(model)
        assert not any("forward" in layer.__dict__ for layer in layers)
        assert (model(**inputs).logits[:, -1] - patched).abs().max() > 1e-4  # FrameFusion changed something
        for other in (twin, pickled):
            vtoken.unpatch(other)
            assert torch.equal(other(**inputs).logits, model(**inputs).logits)


def test_refusals_name_why():
    hybrid, _ = TINY_MODELS["tiny-qwen3.5"]()
    with pytest.raises(vtoken.VTokenError, match="linear attention"):
        vtoken.patch(hybrid, "framefusion")
    assert vtoken.handle_of(hybrid) is None
    model, processor = TINY_MODELS["tiny-onevision"]()
    with pytest.raises(vtoken.VTokenError, match="changes which tokens a video's frames hold"):
        vtoken.patch(model, [vtoken.VidCom2(), vtoken.FrameFusion()])
    assert vtoken.handle_of(model) is None
    assert not any("forward" in layer.__dict__ for layer in model.model.language_model.layers)
    from conftest import make_image

    image = processor(images=[make_image(300, 200)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with vtoken.patched(model, "framefusion"), pytest.raises(vtoken.InputError, match="no video frames"):
        model(**image)


# --------------------------------------------------------------------------- GPU cost, counted
def test_launches_per_call_and_per_decoding_step(onevision, monkeypatch):
    """A merge call reads the device once (how many tokens its threshold flags), a prune none; each call is a short
    burst; PruneVid's cut reads nothing; decoding steps add a few kernels and no sync."""
    from vtoken.adapters.llm import midlayer, prefill

    model, processor, _ = onevision
    inputs = clip_inputs(processor, 4)
    seen = []
    call = midlayer.CallPoints.call

    def counting(points, point, hidden):
        with count_launches() as counted:
            out = call(points, point, hidden)
        seen.append((point, counted))
        return out

    monkeypatch.setattr(midlayer.CallPoints, "call", counting)
    with torch.no_grad(), vtoken.patched(model, vtoken.FrameFusion(**FRAMEFUSION["merges-then-prune"][0])) as handle:
        model(**inputs)
        merges = {int(r.stage.split(".c")[1]) for r in handle.records if r.stage.startswith("prefill.merge")}
    assert seen and all(c.syncs == (1 if point in merges else 0) for point, c in seen), [c.describe() for _, c in seen]
    assert all(c.kernels <= 120 for _, c in seen), [c.describe() for _, c in seen]
    drops = []
    drop = prefill.PrefillRun.drop

    def counted_drop(run, layer, hidden):
        with count_launches() as counted:
            out = drop(run, layer, hidden)
        drops.append(counted)
        return out

    monkeypatch.setattr(prefill.PrefillRun, "drop", counted_drop)
    with torch.no_grad(), vtoken.patched(model, vtoken.PruneVid(layer=1, min_tokens=6, tau=0.5)):
        model(**inputs)
    (cut,) = drops
    assert cut.syncs == 0 and cut.kernels <= 120, cut.describe()
