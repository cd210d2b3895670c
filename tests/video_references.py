"""Plain references of FastVID and HoliTom written from METHODS-3-video.md, one video at a time: loops over
frames, segments, windows, anchors and tokens, float64 arithmetic, no code shared with vtoken. Each returns, per
frame, the (position, feature) pairs that reach the LLM in their order."""

import math

import torch

NEIGHBOURS = 4


def noise_table(seed, frames, tokens):
    """The tie-breaking noise vtoken draws: noise[f][j] for token j of frame f."""
    return torch.rand(frames, tokens, generator=torch.Generator().manual_seed(seed)).double()


def unit(v):
    return v / v.norm()


def dpc_scores(features, members, k, noise):
    """{token: score} of DPC-kNN over `members` (token ids) of `features` [N, D] (float64), noise {token: u}."""
    dim = features.shape[1]
    dist = {(i, j): float((features[i] - features[j]).norm()) / math.sqrt(dim) for i in members for j in members}
    density = {}
    for i in members:
        nearest = sorted(dist[i, j] for j in members)[:k]
        density[i] = math.exp(-sum(v * v for v in nearest) / len(nearest)) + float(noise[i]) * 1e-6
    largest = max(dist.values())
    score = {}
    for i in members:
        higher = [dist[i, j] for j in members if density[j] > density[i]]
        score[i] = (min(higher) if higher else largest) * density[i]
    return score, dist


def top(keys, value, count):
    """The `count` keys with the highest value (ties: the lower key first), in that order."""
    return sorted(keys, key=lambda j: (-value[j], j))[:count]


def segments(global_features, c, tau):
    """FastVID's DySeg: [(first, last)] frames of each segment."""
    frames = global_features.shape[0]
    g = [unit(v.double()) for v in global_features]
    sims = [float(g[f] @ g[f + 1]) for f in range(frames - 1)]
    smallest = sorted(range(frames - 1), key=lambda f: (sims[f], f))[: min(c - 1, frames - 1)]
    cuts = [f for f in range(frames - 1) if f in smallest or sims[f] < tau]
    bounds, first = [], 0
    for f in cuts + [frames - 1]:
        bounds.append((first, f))
        first = f + 1
    return bounds, sims


def merge_into(x, targets, tokens, beta, values=None):
    """{target: merged feature}: every (frame, position) in `tokens` goes to its most cosine-similar target (the
    first in `targets`' order on ties); w = max(1 / (n + 1), beta). `values` (default x): what is averaged."""
    values = x if values is None else values
    members = {t: [] for t in targets}
    for token in tokens:
        sims = [float(unit(x[token]) @ unit(x[t])) for t in targets]
        members[targets[sims.index(max(sims))]].append(token)
    merged = {}
    for t in targets:
        n = len(members[t])
        if n == 0:
            merged[t] = values[t]
            continue
        w = max(1 / (n + 1), beta)
        merged[t] = w * values[t] + (1 - w) * sum(values[m] for m in members[t]) / n
    return merged


def fastvid_onevision(x, attention, global_features, budget=0.1, c=8, tau=0.9, d=0.4, p=4, beta=0.6, seed=0):
    """x [F, T, D], attention [F, T], global_features [F, G] -> per frame [(position, feature)] ascending."""
    frames, tokens, _ = x.shape
    x = {(f, j): x[f, j].double() for f in range(frames) for j in range(tokens)}
    keep = int(tokens * budget) if isinstance(budget, float) else min(budget, tokens)
    salient = keep - int(keep * d)
    context = keep - salient
    noise = noise_table(seed, frames, tokens)
    bounds, _ = segments(global_features, c, tau)
    quota, kind = {}, {}
    for first, last in bounds:
        length = last - first + 1
        anchors = [f for f in range(first, last + 1) if (last - f) % p == 0]
        for f in range(first, last + 1):
            raw = (context * length) // len(anchors) if f in anchors else 0
            quota[f] = min(raw, tokens - salient)
            kind[f] = "own" if raw == context and raw > 0 else ("segment" if raw > context else None)
    kept, rest, score = {}, {}, {}
    for f in range(frames):
        a = {j: float(attention[f, j]) for j in range(tokens)}
        kept[f] = {j: x[f, j] for j in top(range(tokens), a, salient)}
        rest[f] = [j for j in range(tokens) if j not in kept[f]]
        features = torch.stack([x[f, j] for j in range(tokens)])
        score[f], _ = dpc_scores(features, rest[f], min(NEIGHBOURS, len(rest[f])), noise[f])
    for first, last in bounds:
        for f in range(first, last + 1):
            if kind[f] is None:
                continue
            targets = [(f, j) for j in top(rest[f], score[f], quota[f])]
            frames_merged = [f] if kind[f] == "own" else range(first, last + 1)
            merged = merge_into(x, targets, [(g, j) for g in frames_merged for j in rest[g]], beta)
            for (_, j), feature in merged.items():
                kept[f][j] = feature
    return [sorted(kept[f].items()) for f in range(frames)]


def fastvid_qwen(x, attention, budget=0.27, c=8, tau=0.84, ignore=0.95, d=0.4, p=4, beta=0.6, seed=0, values=None):
    """The Qwen2.5-VL form: x [F, T, D] (temporal patches), attention [F, T]; global feature = the frame mean.
    `values` [F, T, D'] (default x): the features the output is made of, decisions taken on x (DeepStack)."""
    frames, tokens, _ = x.shape
    means = x.double().mean(1)
    bounds, sims = segments(means, c, tau)
    values = x if values is None else values
    values = {(f, j): values[f, j].double() for f in range(frames) for j in range(tokens)}
    x = {(f, j): x[f, j].double() for f in range(frames) for j in range(tokens)}
    retain = int(tokens * budget) if isinstance(budget, float) else min(budget, tokens)
    noise = noise_table(seed, frames, tokens)
    salient_of, context_of = [0] * frames, [0] * frames
    for first, last in bounds:
        length = last - first + 1
        seg_retain = retain * length
        seg_context = max(int(seg_retain * d), 1)
        seg_salient = max(seg_retain - seg_context, 0)
        if length == 1:
            salient_of[first], context_of[first] = seg_salient, seg_context
            continue
        ends = [f for f in range(first, last) if sims[f] < ignore] + [last]  # sub-segments' last frames
        parts = len(ends)
        shares = [seg_salient // parts + (1 if i < seg_salient % parts else 0) for i in range(parts)]
        anchors = (parts + p - 1) // p
        contexts = [seg_context // anchors + (1 if i < seg_context % anchors else 0) for i in range(anchors)]
        for i, f in enumerate(ends):
            from_end = parts - 1 - i
            ctx = min(contexts[from_end // p], tokens // 2) if from_end % p == 0 else 0
            context_of[f] = ctx
            salient_of[f] = min(shares[i], tokens - ctx)
    kept, targets_of = {}, {}
    salient_all = set()
    for f in range(frames):
        a = {j: float(attention[f, j]) for j in range(tokens)}
        chosen = top(range(tokens), a, salient_of[f])
        kept[f] = {j: values[f, j] for j in chosen}
        salient_all |= {(f, j) for j in chosen}
        if context_of[f]:
            others = [j for j in range(tokens) if j not in kept[f]]
            features = torch.stack([x[f, j] for j in range(tokens)])
            score, _ = dpc_scores(features, others, min(NEIGHBOURS, len(others)), noise[f])
            targets_of[f] = sorted(top(others, score, context_of[f]))
    for first, last in bounds:
        for f in range(first, last + 1):
            if f not in targets_of:
                continue
            targets = [(f, j) for j in targets_of[f]]
            pool = [(g, j) for g in range(first, last + 1) for j in range(tokens)
                    if (g, j) not in salient_all and (g, j) not in targets]  # fmt: skip
            for (_, j), feature in merge_into(x, targets, pool, beta, values).items():
                kept[f][j] = feature
    return [sorted(kept[f].items()) for f in range(frames)]


def windows(sims_alike, frames, tokens, max_window=1024):
    """HoliTom's window search from alike[t][j] (frames t, t + 1 at position j): [(s, e)] and tokens removed."""

    def gain(s, e):
        return (e - s) * sum(all(sims_alike[t][j] for t in range(s, e)) for j in range(tokens))

    best, back = [], []
    for i in range(frames):
        value, start = (best[i - 1] if i else 0), i
        for width in range(2, min(i + 1, max_window) + 1):
            j = i - width
            candidate = (best[j] if j >= 0 else 0) + gain(j + 1, i)
            if candidate > value:
                value, start = candidate, j + 1
        best.append(value)
        back.append(start)
    found, i = [], frames - 1
    while i >= 0:
        found.append((back[i], i))
        i = back[i] - 1
    return found[::-1], best[-1]


def holitom(x, attention, budget=0.1, tau=0.8, beta=0.6, k=7, d=0.0, seed=0, max_window=1024, values=None):
    """x [F, T, D], attention [F, T] -> (per frame [(position, feature)] in the order they reach the LLM (a window's
    static centres lead its first frame), the windows). `values` [F, T, D'] (default x): what the output is made
    of, decisions taken on x (DeepStack)."""
    frames, tokens, _ = x.shape
    x = x.double()
    v = x if values is None else values.double()
    noise = noise_table(seed, frames, tokens)
    alike = [[float(unit(x[t, j]) @ unit(x[t + 1, j])) > tau for j in range(tokens)] for t in range(frames - 1)]
    found, removed = windows(alike, frames, tokens, max_window)
    rate = budget if isinstance(budget, float) else min(1.0, budget / tokens)
    total = frames * tokens
    rate = min(rate / ((total - removed) / total), 1)

    def merged(centres, members_of, feature):
        rows = []
        for c in centres:
            members = members_of[c]
            rows.append((c, beta * feature[c] + (1 - beta) * sum(feature[m] for m in members) / len(members)
                         if members else feature[c]))  # fmt: skip
        return rows

    def clusters(features, candidates, count, row_noise):
        """DPC-kNN centres (ascending) among `candidates` and each centre's members (nearest, Euclidean)."""
        score, dist = dpc_scores(features, candidates, min(k, count), row_noise)
        centres = sorted(top(candidates, score, count))
        members = {c: [] for c in centres}
        for j in candidates:
            if j not in centres:
                near = [dist[j, c] for c in centres]
                members[centres[near.index(min(near))]].append(j)
        return centres, members

    out = []
    for s, e in found:
        static = [j for j in range(tokens) if e > s and all(alike[t][j] for t in range(s, e))]
        first = []
        count = round(len(static) * rate)
        if static and count:
            means = torch.zeros(tokens, x.shape[2], dtype=torch.float64)
            out_means = {j: v[s : e + 1, j].mean(0) for j in static}
            for j in static:
                means[j] = x[s : e + 1, j].mean(0)
            centres, members = clusters(means, static, count, noise[s])
            first = merged(centres, members, out_means)
        for f in range(s, e + 1):
            dynamic = [j for j in range(tokens) if j not in static]
            keep = math.ceil(len(dynamic) * rate)
            dominant = round(keep * (1 - d))
            a = {j: float(attention[f, j]) for j in dynamic}
            picked = sorted(top(dynamic, a, dominant))
            rows = [(j, v[f, j]) for j in picked]
            if keep - dominant:
                rest = [j for j in dynamic if j not in picked]
                centres, members = clusters(x[f], rest, keep - dominant, noise[f])
                rows += merged(centres, members, {j: v[f, j] for j in rest})
            out.append((first if f == s else []) + rows)
    return out, found


def prunevid_noise_table(seed, frames, tokens):
    """The noise vtoken's PruneVid draws: ([F] for the frames, [F][T] for the tokens), in that order."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(frames, generator=g).double(), torch.rand(frames, tokens, generator=g).double()


def prunevid_labels(labels):
    """PruneVid's refinement of frame labels, from the spec: a label keeps its longest runs (at least 2 long, all
    tied ones), every other frame is free; the gaps of free frames, left to right, take the label of the longer
    neighbour block (the left block as already relabelled; ties and a lone left: left; none: 0)."""
    frames = len(labels)
    runs, f = [], 0
    while f < frames:
        g = f
        while g + 1 < frames and labels[g + 1] == labels[f]:
            g += 1
        runs.append((f, g, labels[f]))
        f = g + 1
    longest = {}
    for s, e, label in runs:
        longest[label] = max(longest.get(label, 0), e - s + 1)
    out = [None] * frames
    for s, e, label in runs:
        if e - s + 1 == longest[label] and longest[label] >= 2:
            for f in range(s, e + 1):
                out[f] = label
    f = 0
    while f < frames:
        if out[f] is not None:
            f += 1
            continue
        a = f
        while f < frames and out[f] is None:
            f += 1
        b = f - 1
        left = right = 0
        if a > 0:
            i = a - 1
            while i >= 0 and out[i] == out[a - 1]:
                i -= 1
            left = a - 1 - i
        if b < frames - 1:
            i = b + 1
            while i < frames and out[i] == out[b + 1]:
                i += 1
            right = i - b - 1
        if left == 0 and right == 0:
            label = 0
        elif left >= right:
            label = out[a - 1]
        else:
            label = out[b + 1]
        for g in range(a, b + 1):
            out[g] = label
    return out


def prunevid(x, tau=0.8, segment_ratio=0.25, cluster_ratio=0.5, k=7, min_tokens=14, seed=0, values=None):
    """PruneVid's encoder stage from the spec on one video x [F, T, D]: (per frame [(position, feature, group)] in
    output order, group "static" or "dynamic", the windows [(first, last)]). `values` [F, T, D'] (default x): what
    the output is made of, decisions taken on x (DeepStack)."""
    frames, tokens, _ = x.shape
    x = x.double()
    v = x if values is None else values.double()
    frame_noise, token_noise = prunevid_noise_table(seed, frames, tokens)
    means = x.mean(1)
    centres = max(1, int(frames * segment_ratio))
    score, dist = dpc_scores(means, list(range(frames)), min(k, frames), frame_noise)
    ranked = top(range(frames), score, centres)
    labels = [ranked.index(f) if f in ranked else min(range(centres), key=lambda r: (dist[f, ranked[r]], r))
              for f in range(frames)]  # fmt: skip
    refined = prunevid_labels(labels)
    found, f = [], 0
    while f < frames:
        g = f
        while g + 1 < frames and refined[g + 1] == refined[f]:
            g += 1
        found.append((f, g))
        f = g + 1

    def clustered(features, members, value, row_noise):
        """[(position, feature)]: the members as they are (few), or their clusters' means in centre-rank order."""
        if len(members) <= min_tokens:
            return [(j, value[j]) for j in members]
        count = max(1, int(len(members) * cluster_ratio))
        score, dist = dpc_scores(features, members, min(k, len(members)), row_noise)
        centres = top(members, score, count)
        groups = {c: [c] for c in centres}
        for j in members:
            if j not in groups:
                groups[min(centres, key=lambda c: (dist[j, c], centres.index(c)))].append(j)
        return [(c, sum(value[m] for m in groups[c]) / len(groups[c])) for c in centres]

    out = []
    for s, e in found:
        length = e - s + 1
        static = []
        if length >= 2:
            for j in range(tokens):
                u = [unit(x[f, j]) for f in range(s, e + 1)]
                total = sum(float(u[a] @ u[b]) for a in range(length) for b in range(length) if a != b)
                if total / (length * (length - 1)) > tau:
                    static.append(j)
        window_means = torch.zeros(tokens, x.shape[2], dtype=torch.float64)
        window_values = {}
        for j in static:
            window_means[j] = x[s : e + 1, j].mean(0)
            window_values[j] = v[s : e + 1, j].mean(0)
        first = [(j, feature, "static") for j, feature in clustered(window_means, static, window_values,
                                                                     token_noise[s])]  # fmt: skip
        dynamic = [j for j in range(tokens) if j not in static]
        for f in range(s, e + 1):
            rows = clustered(x[f], dynamic, {j: v[f, j] for j in dynamic}, token_noise[f])
            out.append((first if f == s else []) + [(j, feature, "dynamic") for j, feature in rows])
    return out, found


def framefusion_ratio(sparsities, layers, cost):
    """FrameFusion's P(list), from the spec's formula."""
    n = len(sparsities)
    f = [1.0]
    for s in sparsities:
        f.append(f[-1] * (1 - s))
    left = layers * cost - sum(f[1:])
    if left < 0:  # the official raises; vtoken: no later layer keeps any
        return 1.0
    need = left / ((layers - n) * f[n])
    return 0.0 if need > 1 else 1 - need


def framefusion_merge(tokens, states, threshold, u, ratio_floor):
    """One merge call on one row, from the spec: tokens [(sequence index, video, slot)] (the candidates alive),
    states {sequence index: fp64 vector}. Returns (survivors {sequence index: new state}, r, branch, ends merging,
    prune due)."""
    order = sorted(tokens, key=lambda t: (t[1], t[2], t[0]))
    sims = []
    for i, (seq, video, slot) in enumerate(order):
        if i and order[i - 1][1:] == (video, slot):
            sims.append(float(unit(states[order[i - 1][0]]) @ unit(states[seq])))
        else:
            sims.append(-2.0)
    flags = [s >= threshold for s in sims]
    n = len(order)
    r = sum(flags) / n if n else 0.0
    if r < u:
        branch, prune_due = "threshold", r < ratio_floor
    else:
        count = int(u * n)
        eligible = sorted((i for i in range(n) if sims[i] > -2), key=lambda i: (-sims[i], i))[:count]
        flags = [i in eligible for i in range(n)]
        branch, prune_due = "top-k", False
    heads = {}
    for i, (seq, _, _) in enumerate(order):
        if not flags[i]:
            heads[seq] = [seq]
            last = seq
        else:
            heads[last].append(seq)
    merged = {h: sum(states[m] for m in members) / len(members) for h, members in heads.items()}
    return merged, r, branch, prune_due


def framefusion_prune(scores, count):
    """The `count` best of {sequence index: score} (ties: the lower index)."""
    return sorted(sorted(scores, key=lambda j: (-scores[j], j))[:count])
