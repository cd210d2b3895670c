"""DART, PyramidDrop and SparseVLM (issue 26) against an independent layer-by-layer reference, and their
invariants: keep-all identities, padded batches (both sides) and beams equal to rows alone, use_cache, threads,
restore, records per drop layer, spec parity on hand-made inputs and clear errors.

The reference runs the tiny LLaVA's language model one decoder layer at a time with eager attention, on Python
lists of token labels: it reads each method's signals where the spec says (attention maps from the eager layers,
post-RoPE keys from the layer's cache, the next layer's attention recomputed by its own eager module, the final
norm), applies the method's rule with loops, inserts recycled tokens, renumbers positions and decodes greedily.
"""

import copy
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_identity, inputs_for
from test_llm_stages import captured_llm_input
from transformers import DynamicCache

import vtoken
from vtoken.methods.dart import dart_pick
from vtoken.methods.sparsevlm import dpc_knn_merge, rater_mask
from vtoken.zoo import build_prompt, tiny_llava

LAYERS = 6
STEPS = 6


@pytest.fixture(scope="module")
def deep_llava():
    """The tiny LLaVA-1.5 with a 6-layer LLM (4 query heads, 2 key/value heads: GQA)."""
    return tiny_llava(text_layers=LAYERS)


@pytest.fixture(scope="module")
def eager_lm(deep_llava):
    model = copy.deepcopy(deep_llava[0])
    model.set_attn_implementation("eager")
    return model.model.language_model, model.lm_head


@pytest.fixture
def single(deep_llava, photos):
    return inputs_for(deep_llava[1], [photos["astronaut"]], ["what is in the image? answer with one word."])


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
            hidden = layer(hidden, attention_mask=causal(len(labels), hidden.dtype), position_ids=pos,
                           past_key_values=cache, use_cache=True, position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
            if i not in drop_layers:
                continue
            ctx = dict(layer=i, hidden=hidden[0], weights=weights[i][0], keys=cache.layers[i].keys[0],
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
                hidden = layer(hidden, attention_mask=None, position_ids=pos, past_key_values=cache, use_cache=True,
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
