"""DART, PyramidDrop and SparseVLM (issue 26) against an independent layer-by-layer reference, and their
invariants: keep-all identities, padded batches (both sides) and beams equal to rows alone, use_cache, threads,
restore, records per drop layer, spec parity on hand-made inputs and clear errors.

The reference runs the tiny LLaVA's language model one decoder layer at a time with eager attention, on Python
lists of token labels: it reads each method's signals where the spec says (attention maps from the eager layers,
post-RoPE keys from the layer's cache, the next layer's attention recomputed by its own eager module, the final
norm), applies the method's rule with loops, inserts recycled tokens, renumbers positions and decodes greedily.
"""

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEEP_LAYERS,
    OTHER_TINY_MODELS,
    assert_identity,
    captured_llm_input,
    inputs_for,
    video_inputs,
)
from near_ties import greedy_steps_agreeing
from transformers import DynamicCache

import vtoken
from vtoken.adapters import hf
from vtoken.methods.dart import dart_pick
from vtoken.methods.sparsevlm import dpc_knn_merge, rater_mask
from vtoken.zoo import TINY_MODELS, build_prompt

LAYERS = DEEP_LAYERS
STEPS = 6


# --------------------------------------------------------------------------- the reference
def causal(n, dtype):
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def reference_generate(lm, head, embeds, visual, rule, drop_layers, renumber, steps=STEPS):
    """One prompt, no padding. rule(ctx) -> (kept visual labels, list of merged [D] tokens) at each drop layer.

    Returns per-step logits, the kept labels after every drop and the number of tokens merged there.
    """
    length = embeds.shape[1]
    labels, positions, visual = list(range(length)), list(range(length)), set(visual)
    held, kept_after, merged_after = [], [], []
    cache, weights = DynamicCache(config=lm.config), {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: weights.__setitem__(i, out[1]))
             for i, layer in enumerate(lm.layers)]  # fmt: skip
    hidden = embeds
    with torch.no_grad():
        for i, layer in enumerate(lm.layers):
            held.append(len(labels))
            pos = torch.tensor([positions])
            mask, rotary = causal(len(labels), hidden.dtype), lm.rotary_emb(hidden, pos)
            hidden = layer(hidden, attention_mask=mask, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                           position_embeddings=rotary)  # fmt: skip
            if i not in drop_layers:
                continue
            ctx = dict(layer=i, hidden=hidden[0], weights=weights[i][0], keys=hf.cache_layers(cache)[i].keys[0],
                       labels=labels, positions=positions, visual=visual)  # fmt: skip
            keep, merged = rule(ctx)
            kept_after.append(keep)
            merged_after.append(len(merged))
            last_visual = max(s for s, c in enumerate(labels) if c in visual)
            rows, new_labels, new_positions = [], [], []
            for s, c in enumerate(labels):
                if c not in visual or c in keep:
                    rows.append(hidden[0, s])
                    new_labels.append(c)
                    new_positions.append(positions[s])
                if s == last_visual:
                    for j, token in enumerate(merged):
                        rows.append(token.to(hidden.dtype))
                        new_labels.append(("merged", i, j))
                        visual.add(("merged", i, j))
            hidden = torch.stack(rows)[None]
            labels = new_labels
            positions = list(range(len(labels))) if renumber else new_positions
        logits = [head(lm.norm(hidden[:, -1]))]
        for step in range(steps - 1):
            hidden = lm.embed_tokens(logits[-1].argmax(-1))[:, None]
            for i, layer in enumerate(lm.layers):
                pos = torch.tensor([[(held[i] if renumber else length) + step]])  # right after its own prompt
                hidden = layer(hidden, attention_mask=None, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                               position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
            logits.append(head(lm.norm(hidden[:, -1])))
    for hook in hooks:
        hook.remove()
    return torch.cat(logits), kept_after, merged_after


def top(scores: dict, count: int) -> set:
    """The `count` labels of highest score (ties: first listed)."""
    return set(sorted(scores, key=lambda c: -scores[c])[:count])


def pyramiddrop_rule(lm, received, ratios, drop_layers):
    def rule(ctx):
        """Layer i + 1's own eager attention module on its normed input: the last row, head mean."""
        i, labels = ctx["layer"], ctx["labels"]
        nxt = lm.layers[i + 1]
        x = nxt.input_layernorm(ctx["hidden"][None])
        pos = torch.tensor([ctx["positions"]])
        _, attention = nxt.self_attn(x, position_embeddings=lm.rotary_emb(x, pos),
                                     attention_mask=causal(len(labels), x.dtype))  # fmt: skip
        row = attention[0].float().mean(0)[-1]
        scores = {c: float(row[s]) for s, c in enumerate(labels) if c in ctx["visual"]}
        return top(scores, int(received * ratios[drop_layers.index(i)])), []

    return rule


def dart_rule(lm, per_pivot, image_pivots=4, text_pivots=4):
    def rule(ctx):
        """Post-RoPE keys from the layer's cache (kv heads repeated), hidden states through the final norm."""
        labels, visual = ctx["labels"], ctx["visual"]
        keys = ctx["keys"]  # [Hkv, n, d]
        keys = keys.repeat_interleave(lm.config.num_attention_heads // keys.shape[0], dim=0)
        keys = keys.permute(1, 0, 2).reshape(len(labels), -1)
        normed = lm.norm(ctx["hidden"])
        first = min(s for s, c in enumerate(labels) if c in visual)
        image = [s for s, c in enumerate(labels) if c in visual]
        text = [s for s, c in enumerate(labels) if c not in visual and s > first]
        norm = {s: float(keys[s].abs().sum()) for s in image + text}
        image_pivots_ = sorted(image, key=lambda s: -norm[s])[:image_pivots]
        text_pivots_ = sorted(text, key=lambda s: -norm[s])[:text_pivots]
        pool = [s for s in image if s not in image_pivots_]
        kept = set(image_pivots_)
        for pivot in list(set(image_pivots_ + text_pivots_)):  # the official visiting order
            similarity = {s: float(F.cosine_similarity(normed[pivot], normed[s], dim=0)) for s in pool}
            taken = sorted(pool, key=lambda s: similarity[s])[:per_pivot]
            kept |= set(taken)
            pool = [s for s in pool if s not in taken]
        return {labels[s] for s in kept}, []

    return rule


def loop_dpc(x, clusters, noise):
    """DPC-kNN merge by loops: [(merged token, centre index)] in centre order."""
    n = len(x)
    dist = [[float((x[i] - x[j]).norm()) / math.sqrt(x.shape[1]) for j in range(n)] for i in range(n)]
    density = [math.exp(-sum(d * d for d in sorted(dist[i])[:clusters]) / clusters) + float(noise[i])
               for i in range(n)]  # fmt: skip
    biggest = max(max(row) for row in dist)
    parent = [min([dist[i][j] for j in range(n) if density[j] > density[i]] or [biggest]) for i in range(n)]
    centres = sorted(range(n), key=lambda i: -parent[i] * density[i])[:clusters]
    members = {c: [] for c in centres}
    for t in range(n):
        owner = t if t in members else min(centres, key=lambda c: dist[c][t])
        members[owner].append(t)
    return [(sum(x[t] for t in members[c]) / (len(members[c]) + 1e-6), c) for c in centres]


def sparsevlm_rule(embeds, visual, keep, layers, seed=0):
    """SparseVLM: raters from the input embeddings, attention rows of the layer, recycling by DPC-kNN."""
    cols = sorted(visual)
    after = [c for c in range(cols[0], embeds.shape[1]) if c not in visual]
    v, t = embeds[0, cols].float(), embeds[0, after].float()
    m = [0.0] * len(after)
    for i in range(len(cols)):
        row = (v[i] @ t.T).softmax(-1)
        for j in range(len(after)):
            m[j] += float(row[j]) / len(cols)
    mean = sum(m) / len(m)
    raters = {after[j] for j in range(len(after)) if m[j] > mean}

    def rule(ctx):
        labels, vis = ctx["labels"], ctx["visual"]
        attention = ctx["weights"].float().mean(0)
        rows = [s for s, c in enumerate(labels) if c in raters]
        scores = {c: sum(float(attention[r, s]) for r in rows) / len(rows) for s, c in enumerate(labels) if c in vis}
        k = min(keep[layers.index(ctx["layer"])], len(scores) - 1)
        kept = top(scores, k)
        dropped = [c for c in labels if c in vis and c not in kept]
        recycled = sorted(dropped, key=lambda c: -scores[c])[: int(len(dropped) * 0.3) + 1]
        x = torch.stack([ctx["hidden"][labels.index(c)].float() for c in recycled])
        noise = torch.rand(len(recycled), generator=torch.Generator().manual_seed(seed)) * 1e-6
        merged = [token for token, _ in loop_dpc(x, len(recycled) // 10 + 1, noise)]
        return kept, merged

    return rule, raters


def patched_generate(model, inputs, method):
    with vtoken.patched(model, method) as handle, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        return torch.cat(out.logits), handle.records


CASES = {
    "dart": lambda: vtoken.DART(layer=2, keep=0.222),
    "dart-count-renumber": lambda: vtoken.DART(layer=3, keep=64, image_pivots=3, text_pivots=2, positions="renumber"),
    "pyramiddrop": lambda: vtoken.PyramidDrop(layers=(2, 4, 5), ratios=(0.5, 0.25, 0.125)),
    "pyramiddrop-original": lambda: vtoken.PyramidDrop(layers=(1, 3), ratios=(0.4, 0.4), positions="original"),
    "sparsevlm": lambda: vtoken.SparseVLM(keep=(300, 200, 110), layers=(1, 2, 4)),
    "sparsevlm-small": lambda: vtoken.SparseVLM(keep=(60, 20, 5), layers=(0, 3, 4), seed=7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_method_matches_the_layer_by_layer_reference(deep_llava, eager_lm, single, case):
    """Invariant 2: per-step logits of 6 greedy tokens, the kept tokens after every drop and the recycled
    token counts equal the reference's."""
    model, _ = deep_llava
    method = CASES[case]()
    logits, records = patched_generate(model, single, method)
    embeds = captured_llm_input(model, single)  # unpatched: no encoder-stage method here
    ids = single["input_ids"][0]
    visual = set((ids == model.config.image_token_id).nonzero().squeeze(1).tolist())
    lm, head = eager_lm
    drop_layers = method.drop_layers(LAYERS)
    if method.name == "dart":
        rule = dart_rule(lm, method.per_pivot(len(visual)), method.image_pivots, method.text_pivots)
    elif method.name == "pyramiddrop":
        rule = pyramiddrop_rule(lm, len(visual), method.ratios, drop_layers)
    else:
        rule, raters = sparsevlm_rule(embeds, visual, method.keep, method.layers, method.seed)
        assert 0 < len(raters) < len(ids) - max(visual) - 1  # some text tokens rate, not all
    ref_logits, kept_after, merged_after = reference_generate(
        lm, head, embeds, visual, rule, drop_layers, method.positions == "renumber"
    )
    prefill = [r for r in records if r.stage.startswith("prefill")]
    assert [r.stage for r in prefill] == [f"prefill.layer{k}" for k in drop_layers]
    start = min(visual)
    for record, kept, merged in zip(prefill, kept_after, merged_after, strict=True):
        original = sorted(c for c in kept if isinstance(c, int))  # recycled tokens are not the LLM's own
        assert (record.kept + start).tolist() == original
        assert record.tokens_out == len(kept) + merged
        assert record.extra.get("merged", 0) == merged
    assert prefill[-1].tokens_out < len(visual)
    assert (logits - ref_logits).abs().max() <= 1e-4
    if method.name == "dart":  # every pivot found a full share
        pivots = method.image_pivots + method.text_pivots
        assert prefill[0].tokens_out == method.image_pivots + pivots * method.per_pivot(len(visual))
    held = [len(visual)] + [r.tokens_out for r in prefill]
    average = sum(held[sum(k < i for k in drop_layers)] for i in range(LAYERS)) / LAYERS
    assert prefill[0].extra["layer_average"] == pytest.approx(average)


# --------------------------------------------------------------------------- spec parity on hand-made inputs
def test_dart_visits_pivots_in_pythons_set_order():
    """Pool tokens A, B, C; the image pivot finds them least similar in the order A, B, C, the text pivot A, C, B.
    With the image pivot at index 2 and the text pivot at 9, `list(set([2, 9]))` is [9, 2]: the text pivot picks
    first (A), the image pivot then B. At 9 and 2 the image pivot picks first (A) and the text pivot C."""
    assert list(set([2, 9])) == [9, 2] == list(set([9, 2]))  # noqa: C405 - the official visiting order
    keys = torch.tensor([[5.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # token 0: the image pivot
    normed = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    text_keys, text_normed = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    text_first = dart_pick(keys, normed, [2, 3, 4, 5], text_keys, text_normed, [9], 1, 1, per_pivot=1)
    assert text_first == [0, 1, 2]  # visiting in list order (image first) would keep [0, 1, 3]
    image_first = dart_pick(keys, normed, [9, 3, 4, 5], text_keys, text_normed, [2], 1, 1, per_pivot=1)
    assert image_first == [0, 1, 3]
    everything = dart_pick(keys, normed, [2, 3, 4, 5], text_keys, text_normed, [9], 1, 1, per_pivot=5)
    assert everything == [0, 1, 2, 3]  # picks stop at the pool's size


def test_rater_mask_by_hand():
    visual = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    text = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [0.0, 3.0], [9.0, 9.0]]])
    text_valid = torch.tensor([[True, True, True, False]])
    m = torch.zeros(3)
    for v in visual[0]:
        m += torch.softmax(text[0, :3] @ v, 0) / 2
    expected = (m > m.mean()).tolist() + [False]
    assert rater_mask(visual, torch.ones(1, 2, dtype=torch.bool), text, text_valid)[0].tolist() == expected
    alike = rater_mask(visual, torch.ones(1, 2, dtype=torch.bool), text[:, :1], text_valid[:, :1])
    assert alike.tolist() == [[True]]  # a single text token: it is the rater


@pytest.mark.parametrize("n,clusters", [(1, 1), (5, 1), (40, 4), (120, 12)])
def test_dpc_knn_merge_matches_loops(n, clusters):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n)) * 0.01  # small, close: densities near 1
    noise = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 1e-6
    merged, centres = dpc_knn_merge(x, clusters, noise)
    expected = loop_dpc(x.double(), clusters, noise.double())
    assert centres.tolist() == [c for _, c in expected]
    assert torch.allclose(merged, torch.stack([t for t, _ in expected]).float(), atol=1e-7)


def test_pyramiddrop_counts_on_the_tokens_the_row_brought():
    method = vtoken.PyramidDrop(layers=(1, 2, 3), ratios=(0.5, 0.3, 0.3))
    attention = torch.rand(2, 1, 10)
    valid = torch.tensor([[True] * 10, [True] * 7 + [False] * 3])
    tokens = vtoken.LayerTokens(0, attention, torch.ones(2, 1, dtype=torch.bool), valid, received=[20, 7])
    assert method.keep_counts(tokens) == [10, 3]  # the first stage (before layer 1): int(N * 0.5)
    later = vtoken.LayerTokens(1, attention, torch.ones(2, 1, dtype=torch.bool), valid, received=[20, 7])
    assert method.keep_counts(later) == [6, 2]  # before layer 2: int(20 * 0.3), int(7 * 0.3)
    kept = method.keep_mask(tokens)
    for row, count in enumerate([10, 3]):
        scores = attention[row, 0, : int(valid[row].sum())]
        assert kept[row].nonzero().squeeze(1).tolist() == sorted(scores.topk(count).indices.tolist())


# --------------------------------------------------------------------------- invariants
MAKERS = {
    "dart": lambda: vtoken.DART(layer=2, keep=0.222),
    "pyramiddrop": lambda: vtoken.PyramidDrop(layers=(1, 3, 5), ratios=(0.5, 0.25, 0.125)),
    "sparsevlm": lambda: vtoken.SparseVLM(keep=(300, 200, 110), layers=(1, 2, 4)),
}


@pytest.mark.parametrize(
    "method",
    [
        vtoken.DART(layer=1, keep=1.0),
        vtoken.DART(layer=3, keep=10**6, positions="renumber"),
        vtoken.PyramidDrop(layers=(1, 4), ratios=(1.0, 1.0)),
        vtoken.PyramidDrop(layers=(2,), ratios=(1.0,), positions="original"),
    ],
    ids=["dart", "dart-count-renumber", "pyramiddrop", "pyramiddrop-original"],
)
def test_keeping_everything_is_the_identity(deep_llava, photos, method):
    """Invariant 1: DART at keep=1.0 (or a count >= V) and PyramidDrop at ratio 1.0 give the unpatched logits and
    greedy tokens on a padded batch (SparseVLM always drops one token: it has no such setting)."""
    model, processor = deep_llava
    inputs = inputs_for(processor, [photos["astronaut"], photos["coffee"]], ["what is this?", "describe it please."])
    with torch.no_grad():
        ref = model(**inputs).logits
        with vtoken.patched(model, method) as handle:
            logits = model(**inputs).logits
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    prefill = [r for r in handle.records if r.stage.startswith("prefill")]
    assert len(prefill) == 2 * len(method.drop_layers(LAYERS)) and all(r.tokens_out == r.tokens_in for r in prefill)
    assert_identity(model, method, inputs)


def two_rows(processor, photos, side):
    images = [photos["astronaut"], photos["coffee"]]
    questions = ["what is this?", "describe the image in detail. how many shapes are there?"]
    texts = [build_prompt(processor, q) for q in questions]
    batched = processor(images=images, text=texts, return_tensors="pt", padding=True, padding_side=side)
    singles = [processor(images=[i], text=[t], return_tensors="pt") for i, t in zip(images, texts, strict=True)]
    return batched, singles


def prefill_summary(records, row=None):
    return [(r.stage, r.tokens_in, r.tokens_out, r.kept.tolist(), r.extra.get("merged"))
            for r in records if r.stage.startswith("prefill") and (row is None or r.image == row)]  # fmt: skip


@pytest.mark.parametrize("name", list(MAKERS))
def test_padded_batches_and_beams_equal_rows_alone(deep_llava, photos, name):
    """Invariant 5: a left-padded batch generates (12 greedy tokens, per-step logits within 1e-4: equal ids up to a
    near-tie, after 6 steps at least; tests/near_ties.py) and beam-searches (with num_return_sequences) exactly what
    each row does alone; left- and right-padded forwards give each row's logits
    and records alone, the left-padded one also numbered from its padding (a plain `model(**inputs)`: RoPE moves
    every key, which DART's key norms must not see)."""
    model, processor = deep_llava
    left, singles = two_rows(processor, photos, "left")
    right, _ = two_rows(processor, photos, "right")
    width = left["input_ids"].shape[1]
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    beams = dict(max_new_tokens=4, min_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    with vtoken.patched(model, MAKERS[name]()) as handle, torch.no_grad():
        out = model.generate(**left, **greedy)
        beam_out = model.generate(**left, **beams)
        alone = []
        for row, one in enumerate(singles):
            own = model.generate(**one, **greedy)
            length = one["input_ids"].shape[1]
            step_logits, own_logits = torch.stack([s[row] for s in out.logits]), torch.cat(own.logits)
            # equal ids up to a near-tie (tests/near_ties.py), and the logits of every step with the same context
            steps = greedy_steps_agreeing(out.sequences[row, width:].tolist(), own.sequences[0, length:].tolist(),
                                          own_logits, 1e-4, step_logits, min_steps=6)  # fmt: skip
            assert (step_logits[: steps + 1] - own_logits[: steps + 1]).abs().max() <= 1e-4
            beam_alone = model.generate(**one, **beams)
            assert torch.equal(beam_out[2 * row : 2 * row + 2, width:], beam_alone[:, length:])
            alone.append((model(**one).logits[0], prefill_summary(handle.records)))
        cases = (("left", left, "generate"), ("left", left, "columns"), ("right", right, "generate"))
        for side, inputs, numbering in cases:
            positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # as generate numbers them
            logits = model(**inputs, **({"position_ids": positions} if numbering == "generate" else {})).logits
            records = handle.records
            for row, (expected, expected_records) in enumerate(alone):
                got = logits[row, : expected.shape[0]] if side == "right" else logits[row, -expected.shape[0] :]
                assert (got - expected).abs().max() <= 1e-4, (side, row)
                assert prefill_summary(records, row) == expected_records, (side, row)
    assert any(r[2] < r[1] for r in alone[0][1])  # tokens were dropped


@pytest.mark.parametrize("name", list(MAKERS))
def test_use_cache_threads_and_restore(deep_llava, single, photos, name):
    """use_cache=False generates what use_cache=True does; two threads calling generate on one patched model get
    what each call gets alone; unpatching removes every hook and gives the unpatched outputs exactly."""
    model, processor = deep_llava
    other = inputs_for(processor, [photos["rocket"]], ["is it day or night?"])

    def hook_count():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    greedy = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        with vtoken.patched(model, MAKERS[name]()):  # transformers adds its own hooks on first use
            model(**single)
        before, hooks = model(**single).logits, hook_count()
        with vtoken.patched(model, MAKERS[name]()) as handle:
            cached = model.generate(**single, **greedy)
            records = prefill_summary(handle.records)
            uncached = model.generate(**single, **greedy, use_cache=False)
            assert prefill_summary(handle.records) == records
            alone = [model.generate(**inputs, max_new_tokens=4, do_sample=False) for inputs in (single, other)]
            results, errors = {}, []

            def work(t):
                try:
                    for round_ in range(2):
                        results[t, round_] = model.generate(**(single, other)[t], max_new_tokens=4, do_sample=False)
                except BaseException as error:  # noqa: BLE001 - re-raised below
                    errors.append(error)

            pool = [threading.Thread(target=work, args=(t,)) for t in range(2)]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join()
            assert hook_count() > hooks
        after = model(**single).logits
    assert not errors and all(torch.equal(tokens, alone[t]) for (t, _), tokens in results.items())
    assert torch.equal(uncached.sequences, cached.sequences)
    assert (torch.cat(uncached.logits) - torch.cat(cached.logits)).abs().max() <= 1e-4
    assert hook_count() == hooks and torch.equal(after, before)


@pytest.mark.parametrize("name", list(MAKERS))
def test_composes_with_an_encoder_method_and_sparse_prefill(deep_llava, single, name):
    """HiRED (encoder) then the method: the LLM receives HiRED's tokens and the method counts on those; an
    all-covering A-shape sparse prefill on top changes nothing."""
    model, _ = deep_llava
    stack = [vtoken.HiRED(budget=0.5), MAKERS[name]()]
    with torch.no_grad():
        with vtoken.patched(model, stack) as handle:
            logits = model(**single).logits
            records = handle.records
        wide = vtoken.SparsePrefill(pattern="a_shape", sink=0, window=10**6, block_size=16, min_length=16)
        with vtoken.patched(model, [*stack, wide]) as handle:
            sparse_logits = model(**single).logits
            sparse_records = handle.records
    encoder = sum(r.tokens_out for r in records if r.stage == "encoder")
    prefill = [r for r in records if r.stage.startswith("prefill")]
    assert encoder == 288 and prefill[0].tokens_in == encoder and prefill[-1].tokens_out < encoder
    assert (sparse_logits - logits).abs().max() <= 1e-5
    assert prefill_summary(sparse_records) == prefill_summary(records)
    assert any(r.stage.startswith("sparse") for r in sparse_records)


def test_bad_parameters_fail_clearly(deep_llava):
    model, _ = deep_llava
    at_patch = [
        (vtoken.DART(layer=6), "at most 5"),
        (vtoken.PyramidDrop(layers=(8, 16, 24)), "at most 5"),
        (vtoken.SparseVLM(), "has 6 layers"),
        ([vtoken.FastV(), vtoken.DART()], "prefill stage"),
    ]
    for method, message in at_patch:
        with pytest.raises(vtoken.VTokenError, match=message):
            vtoken.patch(model, method)
        assert vtoken.handle_of(model) is None
    at_construction = [
        (vtoken.DART, dict(layer=0), "layer=0"),
        (vtoken.DART, dict(keep=0.0), "keep=0.0"),
        (vtoken.DART, dict(image_pivots=0), "image_pivots=0"),
        (vtoken.DART, dict(positions="x"), "accepted"),
        (vtoken.PyramidDrop, dict(ratios=(0.5, 0.6, 0.1)), "non-increasing"),
        (vtoken.PyramidDrop, dict(ratios=(0.5, 0.25)), "3 non-increasing fractions"),
        (vtoken.PyramidDrop, dict(ratios=(1.5, 0.5, 0.1)), r"\(0, 1\]"),
        (vtoken.PyramidDrop, dict(layers=(0, 8)), ">= 1"),
        (vtoken.PyramidDrop, dict(layers=(16, 8, 24)), "ascending"),
        (vtoken.SparseVLM, dict(budget=100), "official settings"),
        (vtoken.SparseVLM, dict(budget=192, keep=(1, 2, 3)), "not both"),
        (vtoken.SparseVLM, dict(keep=(300, 200)), "3 token counts"),
        (vtoken.SparseVLM, dict(keep=(300, 0, 1)), "keep=0"),
        (vtoken.SparseVLM, dict(layers=(2, 6)), "give keep"),
        (vtoken.SparseVLM, dict(seed=-1), "seed=-1"),
    ]
    for cls, params, message in at_construction:
        with pytest.raises(vtoken.VTokenError, match=message):
            cls(**params)
    assert vtoken.make_method("sparsevlm", budget=64).counts == (66, 30, 17)
    assert vtoken.SparseVLM().counts == (300, 200, 110)


# --------------------------------------------------------------------------- every family
MROPE = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"}


def family_method(name: str, family: str):
    """The method at drop points that fit the tiny family's LLM (2 layers; Qwen3.5: 0 and 2 linear attention)."""
    hybrid = family.startswith("tiny-qwen3.5")
    positions = "original" if family in MROPE else "renumber"
    if name == "dart":
        return vtoken.DART(layer=2 if hybrid else 1, keep=0.25, positions=positions)
    if name == "pyramiddrop":
        layers = (3,) if hybrid else (1,)  # Qwen3.5: scored by full-attention layer 3, after layer 1's full cache
        return vtoken.PyramidDrop(layers=layers, ratios=(0.25,), positions=positions)
    return vtoken.SparseVLM(layers=(1 if hybrid else 0,), keep=(20,))


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("family", [n for n in OTHER_TINY_MODELS if n != "tiny-gemma3"])  # Gemma 3: refused
def test_on_every_family(family, name, photos):
    """Each method's counts in its records, on a padded batch (or a clip) of every family with an LLM stage;
    original positions under M-RoPE, where SparseVLM (which renumbers) is refused at patch with the reason.
    (Identity, batches, beams, restore: tests/test_contract.py.)"""
    model, processor = TINY_MODELS[family]()
    if family == "tiny-video-llava":  # its tiny processor feeds the video path
        batched = video_inputs(processor)
    else:
        images, questions = [photos["coffee"], photos["rocket"]], ["what is this?", "describe the image please."]
        batched = inputs_for(processor, images, questions)
    if name == "pyramiddrop" and family.startswith("tiny-qwen3.5"):
        for layers, message in (((1,), "first full-attention layer"), ((2,), "score with a full-attention layer")):
            with pytest.raises(vtoken.VTokenError, match=message):
                vtoken.patch(model, vtoken.PyramidDrop(layers=layers, ratios=(0.5,), positions="original"))
    if name == "sparsevlm" and family in MROPE:
        with pytest.raises(vtoken.VTokenError, match="always renumbers"):
            vtoken.patch(model, family_method(name, family))
        assert vtoken.handle_of(model) is None
        return
    method = family_method(name, family)
    with vtoken.patched(model, method) as handle, torch.no_grad():
        model(**batched)
        records = [r for r in handle.records if r.stage.startswith("prefill")]
    assert len(records) == batched["input_ids"].shape[0]
    for r in records:
        n = r.tokens_in
        if name == "pyramiddrop":
            assert r.tokens_out == int(n * 0.25)
        elif name == "sparsevlm":
            kept = min(20, n - 1)
            assert r.tokens_out == kept + (int((n - kept) * 0.3) + 1) // 10 + 1 == kept + r.extra["merged"]
        else:
            assert len(r.kept) == r.tokens_out < n


def test_dpc_knn_merge_rows_equals_each_row_alone():
    """The batched recycling (rows of different token and cluster counts, padded) gives every row what
    `dpc_knn_merge` gives it alone."""
    from vtoken.methods.sparsevlm import dpc_knn_merge_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, 16, generator=g) * 0.01
    counts, clusters = [40, 23, 7], [4, 3, 1]
    noise = torch.rand(40, generator=torch.Generator().manual_seed(0)) * 1e-6
    merged, centres = dpc_knn_merge_rows(x, counts, clusters, noise)
    for row, (n, k) in enumerate(zip(counts, clusters, strict=True)):
        alone, alone_centres = dpc_knn_merge(x[row, :n], k, noise[:n])
        assert centres[row, :k].tolist() == alone_centres.tolist()
        assert torch.allclose(merged[row, :k], alone, atol=1e-7)
