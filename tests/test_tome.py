"""ToMe in the vision tower (METHODS-4-tower.md): its schedules, and a CLIP / SigLIP tower under `ToMeTower` against an
independent reference written here from the spec text (per crop, token by token: eager attention with the
log-size bias, the bipartite matching with a stable ranking, weighted or plain merges, sources), keep-all
identity and exact removal, batch = crops alone, LLaVA-1.5's 577 -> 208 at r = 16, refusals, launch counts."""

import math

import pytest
import torch
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

import vtoken
from vtoken.adapters import hf
from vtoken.adapters.tower import ToMeTower, tower_shape
from vtoken.errors import VTokenError
from vtoken.launches import count_launches
from vtoken.methods.base import TowerShape
from vtoken.methods.tome import bipartite_matching

WIDTH, HEADS = 32, 4


def clip_tower(layers: int, image: int = 112, siglip: bool = False, seed: int = 0) -> torch.nn.Module:
    """A random-weight CLIP (or SigLIP) vision tower, fp32, SDPA."""
    torch.manual_seed(seed)
    widths = dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=HEADS)
    if siglip:
        config = SiglipVisionConfig(image_size=image, patch_size=14, **widths)
        return SiglipVisionModel(config).eval()
    return CLIPVisionModel(CLIPVisionConfig(image_size=image, patch_size=14, **widths)).eval()


def encoder_input(tower: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """[C, T, D] what the tower's block 0 gets (after the embeddings and CLIP's pre-norm)."""
    seen = {}

    def grab(module, args):
        seen["x"] = args[0]

    hook = tower.encoder.layers[0].register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            tower(pixels)
    finally:
        hook.remove()
    return seen["x"]


# ----------------------------------------------------------------- the reference, from the spec text
def ref_parse_r(layers, r):
    if isinstance(r, list):
        return r + [0] * (layers - len(r))
    inflection = 0.0
    if isinstance(r, tuple):
        r, inflection = r
    low = int(r * (1 - inflection))
    high = 2 * r - low
    return [int(low + (high - low) / (layers - 1) * layer) for layer in range(layers)]


def ref_attention(layer, x, bias):
    """Eager multi-head attention of one crop x [T, D], + bias [T] on every query's logits."""
    attn = layer.self_attn
    tokens = x.shape[0]
    q = attn.q_proj(x).view(tokens, HEADS, -1).transpose(0, 1)
    k = attn.k_proj(x).view(tokens, HEADS, -1).transpose(0, 1)
    v = attn.v_proj(x).view(tokens, HEADS, -1).transpose(0, 1)
    logits = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5 + bias
    out = (logits.softmax(-1) @ v).transpose(0, 1).reshape(tokens, -1)
    return attn.out_proj(out), attn.k_proj(x)


def ref_tome(layers, x, schedule, cls, prop_attn, weighted, order):
    """One crop x [T, D] through blocks 0..len(schedule)-1 with ToMe: (output [T', D], r' per block, sources: for
    every output token the list of input tokens it holds)."""
    tokens = x.shape[0]
    sizes = [1.0] * tokens
    groups = [[t] for t in range(tokens)]
    merged_yet, done = False, []
    for block, r in enumerate(schedule):
        layer = layers[block]
        tokens = x.shape[0]
        bias = torch.tensor([math.log(s) for s in sizes]) if prop_attn and merged_yet else torch.zeros(tokens)
        attended, keys = ref_attention(layer, layer.layer_norm1(x), bias)
        h = x + attended
        r = max(0, min(r, (tokens - int(cls)) // 2))
        done.append(r)
        if r > 0:
            merged_yet = True
            metric = keys.view(tokens, HEADS, -1).mean(1)
            metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            a, b = list(range(0, tokens, 2)), list(range(1, tokens, 2))
            scores = metric[a] @ metric[b].T
            if cls:
                scores[0] = float("-inf")
            best = scores.max(dim=1).values.tolist()
            target = [row.index(max(row)) for row in scores.tolist()]  # the first maximum
            ranked = sorted(range(len(a)), key=lambda i: (-best[i], i))  # stable: ties by position
            merging, staying = ranked[:r], sorted(ranked[r:])
            new_h, new_sizes, new_groups = [], [], []
            for i in staying:
                new_h.append(h[a[i]])
                new_sizes.append(sizes[a[i]])
                new_groups.append(groups[a[i]])
            for j, token in enumerate(b):
                sources = [a[i] for i in merging if target[i] == j]
                weights = sizes if weighted else [1.0] * tokens
                total = h[token].float() * weights[token] + sum(
                    (h[s].float() * weights[s] for s in sources), torch.zeros(WIDTH)
                )
                new_h.append((total / (weights[token] + sum(weights[s] for s in sources))).to(h.dtype))
                new_sizes.append(sizes[token] + sum(sizes[s] for s in sources))
                new_groups.append(sorted(groups[token] + [t for s in sources for t in groups[s]]))
            h, sizes, groups = torch.stack(new_h), new_sizes, new_groups
        x = h + layer.mlp(layer.layer_norm2(h))
    if order == "raster":
        order_ = sorted(range(len(groups)), key=lambda t: min(groups[t]))
        x, groups = x[order_], [groups[t] for t in order_]
    return x, done, groups


def run_tome(tower, method, shape, pixels):
    patch = ToMeTower(method, tower.encoder.layers, shape, hf.attention_implementation(tower))
    patch.install()
    try:
        with torch.no_grad():
            (states,) = hf.hidden_states(tower, [shape.feature_block + 1], pixels)
        return states, patch.last()
    finally:
        patch.remove()


# ----------------------------------------------------------------- schedules
def test_schedules_follow_parse_r_and_the_front_loaded_budget():
    shape = TowerShape("llava-1.5", cls=True, feature_block=22)
    assert vtoken.ToMe(r=16).schedule(577, shape) == [16] * 23
    assert vtoken.ToMe(r=(16, -1.0)).schedule(577, shape) == ref_parse_r(23, (16, -1.0))  # 32 down to 0
    assert vtoken.ToMe(r=(16, -1.0)).schedule(577, shape)[0] == 32
    assert vtoken.ToMe(r=(8, 0.5)).schedule(577, shape) == ref_parse_r(23, (8, 0.5))
    assert vtoken.ToMe(r=[5, 7]).schedule(577, shape) == [5, 7] + [0] * 21
    # budget 64 of 576: R = 512 over 23 blocks, ceil(R_left / blocks left): 23 six times, then 22
    assert vtoken.ToMe(budget=64).schedule(577, shape) == [23] * 6 + [22] * 17
    for budget in (64, 0.25, 200, 576):
        kept = vtoken.tokens_to_keep(budget, 576)
        assert vtoken.ToMe(budget=budget).count_before_encoding([(24, 24)], tower=shape) == [kept]
    # a budget the caps cannot reach (each block merges at most (T - 1) // 2): as close as they allow
    assert vtoken.ToMe(budget=1).count_before_encoding([(24, 24)], tower=shape) == [13]
    with pytest.raises(VTokenError, match="r has 24 entries.*blocks 0..22"):
        vtoken.ToMe(r=[1] * 24).schedule(577, shape)


def test_parameters_are_checked_at_construction():
    for bad in (dict(r=-1), dict(r=[1, -2]), dict(r=(1, 2, 3)), dict(r=1.5), dict(r=True), dict(order="spatial"),
                dict(prop_attn=1), dict(weighted="no"), dict(budget=0), dict(budget=1.5)):  # fmt: skip
        with pytest.raises(VTokenError, match="tome"):
            vtoken.ToMe(**bad)
    assert vtoken.ToMe(r=(16, -1)).r == (16, -1.0)


def test_refusals_name_why_and_the_method_that_applies():
    method = vtoken.ToMe()
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5"):
        with pytest.raises(VTokenError, match="(?s)2x2 patch merger.*pixelprune"):
            method.check_family(family)
    for family, why in (("internvl", "pixel shuffle"), ("gemma3", "4x4"), ("perception-lm", "2x2"),
                        ("fastvlm", "convolutional")):  # fmt: skip
        with pytest.raises(VTokenError, match=why):
            method.check_family(family)
    for family in ("llava-1.5", "llava-next", "video-llava", "llava-onevision"):
        method.check_family(family)


# ----------------------------------------------------------------- the tower against the reference
@pytest.mark.parametrize(
    "params, siglip",
    [
        (dict(r=8), False),  # the official: proportional attention, size-weighted merges
        (dict(r=40), False),  # above the cap: (T - 1) // 2 per block
        (dict(r=(6, -1.0), order="raster"), False),
        (dict(r=8, prop_attn=False, weighted=False), False),  # LightCompress
        (dict(r=[10, 3, 7], prop_attn=True, weighted=False), True),  # SigLIP: no [CLS]
        (dict(r=12, order="raster"), True),  # SigLIP, the official merges (LLaVA-OneVision's tower)
        (dict(r=40), True),  # SigLIP above the cap: T // 2 per block (p = 0)
    ],
)
def test_tower_matches_the_reference(params, siglip):
    tower = clip_tower(4, siglip=siglip)
    shape = TowerShape("llava-onevision" if siglip else "llava-1.5", cls=not siglip, feature_block=2)
    pixels = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(1))
    method = vtoken.ToMe(**params)
    got, state = run_tome(tower, method, shape, pixels)
    x = encoder_input(tower, pixels)
    schedule = method.schedule(x.shape[1], shape)
    assert state.done == schedule
    sources = state.patch_sources()
    for crop in range(3):
        with torch.no_grad():
            want, done, groups = ref_tome(tower.encoder.layers, x[crop], schedule, shape.cls, method.prop_attn,
                                          method.weighted, method.order)  # fmt: skip
        assert done == schedule
        torch.testing.assert_close(got[crop], want, rtol=1e-4, atol=1e-5)
        p = int(shape.cls)
        expected = torch.empty(x.shape[1] - p, dtype=torch.long)
        for token, held in enumerate(groups):
            for original in held:
                if original >= p:
                    expected[original - p] = token - p
        assert torch.equal(sources[crop], expected)
    n_out = x.shape[1] - sum(schedule)
    assert got.shape[1] == n_out
    assert method.count_before_encoding([(8, 8)], tower=shape) == [n_out - int(shape.cls)]


def test_keep_all_is_the_unpatched_tower_and_removal_restores_it():
    tower = clip_tower(3)
    shape = TowerShape("llava-1.5", cls=True, feature_block=1)
    pixels = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(2))
    state_dict = {k: v.clone() for k, v in tower.state_dict().items()}
    with torch.no_grad():
        want = hf.hidden_states(tower, [0, 1, 2, 3], pixels)
    patch = ToMeTower(vtoken.ToMe(r=0), tower.encoder.layers, shape, "sdpa")
    patch.install()
    with torch.no_grad():
        got = hf.hidden_states(tower, [0, 1, 2, 3], pixels)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert patch.last().done == [0, 0]
    with pytest.raises(VTokenError, match="already have a forward"):
        ToMeTower(vtoken.ToMe(), tower.encoder.layers, shape, "sdpa").install()
    patch.remove()
    patch = ToMeTower(vtoken.ToMe(r=16), tower.encoder.layers, shape, "sdpa")
    patch.install()
    patch.remove()
    with torch.no_grad():
        again = hf.hidden_states(tower, [0, 1, 2, 3], pixels)
    assert all(torch.equal(a, b) for a, b in zip(again, want, strict=True))
    for layer in tower.encoder.layers:
        assert "forward" not in layer.__dict__ and not layer.self_attn.k_proj._forward_hooks
    assert all(torch.equal(v, state_dict[k]) for k, v in tower.state_dict().items())


def test_a_batch_of_crops_equals_each_crop_alone():
    tower = clip_tower(3)
    shape = TowerShape("llava-1.5", cls=True, feature_block=1)
    pixels = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(3))
    method = vtoken.ToMe(r=12, order="raster")
    together, state = run_tome(tower, method, shape, pixels)
    for crop in range(3):
        alone, alone_state = run_tome(tower, method, shape, pixels[crop : crop + 1])
        torch.testing.assert_close(together[crop : crop + 1], alone, rtol=1e-5, atol=1e-6)
        assert torch.equal(state.patch_sources()[crop : crop + 1], alone_state.patch_sources())


def test_llava_1_5_at_r_16_leaves_208_tokens_at_the_feature_layer():
    tower = clip_tower(24, image=336)  # CLIP-L/14 at 336 px's grid and depth (narrow)
    shape = TowerShape("llava-1.5", cls=True, feature_block=22)  # vision_feature_layer = -2
    states, state = run_tome(tower, vtoken.ToMe(r=16), shape, torch.randn(1, 3, 336, 336))
    assert states.shape == (1, 209, WIDTH)  # [CLS] + 208
    assert state.done == [16] * 23
    assert vtoken.ToMe(r=16).count_before_encoding([(24, 24)], tower=shape) == [208]
    assert sorted(state.patch_sources().unique().tolist()) == list(range(208))  # every output token holds patches


def test_tower_shape_of_tiny_llava_and_onevision():
    from vtoken.zoo import tiny_llava, tiny_onevision

    llava = tower_shape(tiny_llava()[0], "llava-1.5")
    assert (llava.cls, llava.feature_block, llava.patch) == (True, 1, 14)  # 3 blocks, vision_feature_layer -2
    onevision = tower_shape(tiny_onevision()[0], "llava-onevision")
    assert (onevision.cls, onevision.feature_block) == (False, 2)  # SigLIP, vision_feature_layer -1


def test_ties_rank_the_earlier_token_first():
    # every key alike: every A token ties at the same best score, its best B token is the first
    metric = torch.ones(2, 9, 4)
    matching = bipartite_matching(metric, 3, cls=True)
    assert matching.merged.tolist() == [[1, 2, 3]] * 2  # A tokens 2, 4, 6 ([CLS], A token 0, never merges)
    assert matching.targets.tolist() == [[0, 0, 0]] * 2
    assert matching.unmerged.tolist() == [[0, 4]] * 2
    assert matching.positions().tolist()[0] == [0, 2, 2, 3, 2, 4, 2, 5, 1]


def test_proportional_attention_is_refused_where_a_bias_cannot_go():
    tower = clip_tower(2)
    shape = TowerShape("llava-1.5", cls=True, feature_block=0)
    with pytest.raises(VTokenError, match="(?s)prop_attn=True.*'flash_attention_2'.*sdpa.*prop_attn=False"):
        ToMeTower(vtoken.ToMe(), tower.encoder.layers, shape, "flash_attention_2")
    ToMeTower(vtoken.ToMe(prop_attn=False), tower.encoder.layers, shape, "flash_attention_2")  # any backend
    with pytest.raises(VTokenError, match="block to merge"):
        ToMeTower(vtoken.ToMe(), tower.encoder.layers, TowerShape("llava-1.5", cls=True), "sdpa")


def counted_tower(crops: int, r: int) -> tuple:
    tower = clip_tower(3)
    shape = TowerShape("llava-1.5", cls=True, feature_block=1)
    pixels = torch.randn(crops, 3, 112, 112)
    patch = ToMeTower(vtoken.ToMe(r=r), tower.encoder.layers, shape, "sdpa")
    patch.install()
    try:
        with torch.no_grad(), count_launches() as launches:
            tower(pixels)
    finally:
        patch.remove()
    with torch.no_grad(), count_launches() as stock:
        tower(pixels)
    return launches, stock


def test_merging_is_a_fixed_burst_without_syncs():
    bursts = set()
    for crops, r in ((1, 4), (4, 4), (4, 20)):
        launches, stock = counted_tower(crops, r)
        assert launches.syncs == 0 and stock.syncs == 0, launches.describe()
        bursts.add(launches.kernels - stock.kernels)
    assert len(bursts) == 1, bursts  # the same whatever the crops and r
    assert bursts.pop() <= 2 * 40  # two merging blocks: tens of kernels each


def test_a_patched_tower_deep_copies_and_pickles():
    import copy
    import pickle

    tower = clip_tower(3)
    shape = TowerShape("llava-1.5", cls=True, feature_block=1)
    pixels = torch.randn(1, 3, 112, 112, generator=torch.Generator().manual_seed(4))
    patch = ToMeTower(vtoken.ToMe(r=10), tower.encoder.layers, shape, "sdpa")
    patch.install()
    pickled = pickle.loads(pickle.dumps(tower))  # before a run: transformers' own output hooks do not pickle
    with torch.no_grad():
        want = hf.hidden_states(tower, [2], pixels)[0]
        for twin in (copy.deepcopy(tower), pickled):
            assert torch.equal(hf.hidden_states(twin, [2], pixels)[0], want)
            twin_patch = twin.encoder.layers[0].forward.__self__.owner
            assert twin_patch is not patch and twin_patch.layers is twin.encoder.layers
            twin_patch.remove()  # removes the copy's own forwards and hooks, not the original's
            assert hf.hidden_states(twin, [2], pixels)[0].shape[1] == 65
    assert hf.hidden_states(tower, [2], pixels)[0].shape[1] == 65 - 20
    patch.remove()


def test_records_say_merges_per_block_and_sources():
    from vtoken.adapters.tower import tome_records
    from vtoken.timing import Stopwatch

    tower = clip_tower(3)
    shape = TowerShape("llava-1.5", cls=True, feature_block=1)
    _, state = run_tome(tower, vtoken.ToMe(r=10), shape, torch.randn(2, 3, 112, 112))
    records = list(tome_records(vtoken.ToMe(r=10), state, Stopwatch(torch.device("cpu")).start().stop(), (8, 8),
                                [0, 0], [0, 1]))  # fmt: skip
    assert [(r.stage, r.crop, r.tokens_in, r.tokens_out, r.kept) for r in records] == [
        ("tower", 0, 64, 44, None), ("tower", 1, 64, 44, None)
    ]  # fmt: skip
    assert records[1].extra["r"] == [10, 10] and records[1].extra["sources"].shape == (64,)
    assert records[1].extra["sources"].max() == 43
