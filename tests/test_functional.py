"""`vtoken.encode` / `vtoken.select` on timm, open_clip and transformers towers, against each tower's own outputs
and eager recomputations of the [CLS] row."""

import copy

import pytest
import torch
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer

import vtoken
from vtoken.methods.pool import pool_anchors, pool_weights

IMAGE = 32  # 8 x 8 patches of 4 px


def timm_vit():
    """timm ViT with a class token and 2 register tokens, QK-norm on (q_norm/k_norm are real LayerNorms)."""
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=IMAGE, patch_size=4, embed_dim=32, depth=3, num_heads=4, reg_tokens=2, qk_norm=True, num_classes=0
    ).eval()


def timm_eva():
    """timm Eva with a class token, a register token and 2-D RoPE (biased qkv: its path calls F.linear)."""
    torch.manual_seed(1)
    return Eva(
        img_size=IMAGE, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_reg_tokens=1, use_rot_pos_emb=True,
        qkv_bias=True, num_classes=0,
    ).eval()  # fmt: skip


def timm_pe_gqa():
    """timm Eva as the Perception Encoder builds it (AttentionRope), with grouped-query attention (2 kv heads for
    4 query heads, separate q/k/v projections), QK-norm, RoPE with rotate-half, a pre-transformer norm."""
    torch.manual_seed(4)
    return Eva(
        img_size=IMAGE, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_kv_heads=2, attn_type="rope",
        qkv_fused=False, qk_norm=True, use_rot_pos_emb=True, rope_rotate_half=True, use_pre_transformer_norm=True,
        use_abs_pos_emb=False, global_pool="", num_classes=0,
    ).eval()  # fmt: skip


def open_clip_vit():
    from open_clip.transformer import VisionTransformer as OpenClipViT

    torch.manual_seed(2)
    return OpenClipViT(image_size=IMAGE, patch_size=4, width=32, layers=3, heads=4, mlp_ratio=2.0, output_dim=16).eval()


def hf_clip():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(3)
    config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE, patch_size=4
    )
    return CLIPVisionModel(config).eval()


TOWERS = {
    "timm-vit": timm_vit,
    "timm-eva": timm_eva,
    "timm-pe-gqa": timm_pe_gqa,
    "open_clip": open_clip_vit,
    "hf-clip": hf_clip,
}


def pixels(batch=2, seed=0):
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


def own_block_output(name, tower, x, block):
    """Patch tokens of block `block`'s output, as the tower's own API gives them."""
    with torch.no_grad():
        if name.startswith("timm"):
            return tower.forward_intermediates(x, indices=[block], output_fmt="NLC", intermediates_only=True)[0]
        if name == "open_clip":
            out = tower.forward_intermediates(x, indices=[block], output_fmt="NLC", intermediates_only=True)
            return out["image_intermediates"][0]
        return tower(x, output_hidden_states=True).hidden_states[block + 1][:, 1:]


def eager_cls_row(name, tower, x, block):
    """[B, N] head-mean [CLS] attention to the patch keys in block `block`, from an eager computation of the
    full attention map (prefix keys in the softmax, then dropped)."""
    tower = copy.deepcopy(tower)
    maps = []
    with torch.no_grad():
        if name.startswith("timm"):  # unfused timm attention: attn_drop receives the post-softmax map
            attention = tower.blocks[block].attn
            attention.fused_attn = False
            handle = attention.attn_drop.register_forward_hook(lambda m, a, out: maps.append(out))
            tower.forward_features(x)
            handle.remove()
            return maps[0][:, :, 0, tower.num_prefix_tokens :].mean(1)
        if name == "open_clip":  # torch's own MultiheadAttention asked for per-head weights
            attention = tower.transformer.resblocks[block].attn

            def weights(module, args, kwargs):
                q = args[0]
                maps.append(module.forward(q, q, q, need_weights=True, average_attn_weights=False)[1])

            handle = attention.register_forward_pre_hook(weights, with_kwargs=True)
            tower(x)
            handle.remove()
            return maps[0][:, :, 0, 1:].mean(1)
        tower.set_attn_implementation("eager")
        return tower(x, output_attentions=True).attentions[block][:, :, 0, 1:].mean(1)


def all_hooks(module):
    return [
        (name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for name, m in module.named_modules()
    ]


@pytest.fixture(scope="module", params=list(TOWERS))
def tower(request):
    return request.param, TOWERS[request.param]()


@pytest.mark.parametrize("layer", [0, -2, -1])
def test_features_and_cls_row_match_the_tower_and_an_eager_recomputation(tower, layer):
    name, model = tower
    x = pixels()
    with torch.no_grad():
        features, signals = vtoken.encode(model, x, layer=layer, signals=("cls_attention",))
    block = layer % 3
    reference = own_block_output(name, model, x, block)
    assert features.shape == (2, 64, 32) and torch.allclose(features, reference, atol=1e-6, rtol=0)
    row = signals["cls_attention"]
    assert row.shape == (2, 64) and row.dtype == torch.float32
    assert torch.allclose(row, eager_cls_row(name, model, x, block), atol=1e-6, rtol=0)
    assert (row.sum(1) < 1).all()  # prefix keys took part in the softmax: no renormalisation


def test_other_blocks_signals_and_no_hook_left_and_outputs_unchanged(tower):
    name, model = tower
    x = pixels(seed=1)
    hooks = all_hooks(model)
    with torch.no_grad():
        before = model.forward_features(x) if name.startswith("timm") else model(x)
        features, signals = vtoken.encode(model, x, layer=0, signals=("cls_attention@-1", "cls_attention"))
        after = model.forward_features(x) if name.startswith("timm") else model(x)
    assert all_hooks(model) == hooks
    before, after = (before, after) if isinstance(before, torch.Tensor) else (before[0], after[0])
    assert torch.equal(before, after)
    assert torch.allclose(signals["cls_attention@-1"], eager_cls_row(name, model, x, 2), atol=1e-6, rtol=0)
    assert torch.allclose(signals["cls_attention"], eager_cls_row(name, model, x, 0), atol=1e-6, rtol=0)
    assert torch.allclose(features, own_block_output(name, model, x, 0), atol=1e-6, rtol=0)


def test_fused_attention_stays_on(tower, monkeypatch):
    """SDPA runs in every block that runs (open_clip: every MultiheadAttention call has need_weights=False)."""
    name, model = tower
    calls = []
    if name == "open_clip":
        forward = torch.nn.MultiheadAttention.forward

        def counting(self, *args, **kwargs):
            calls.append(kwargs.get("need_weights", True))
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.MultiheadAttention, "forward", counting)
    else:
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counting(*args, **kwargs):
            calls.append(False)
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        vtoken.encode(model, pixels(), layer=-2, signals=("cls_attention",))
    assert calls == [False, False]  # blocks 0 and 1 ran, fused; block 2 (after the feature layer) did not


def test_bad_towers_layers_and_signals_are_named(tower):
    _, model = tower
    x = pixels(1)
    with pytest.raises(vtoken.VTokenError, match=r"layer=3 .*\[-3, 2\]"):
        vtoken.encode(model, x, layer=3)
    with pytest.raises(vtoken.VTokenError, match=r"layer=-4"):
        vtoken.encode(model, x, layer=-4)
    with pytest.raises(vtoken.VTokenError, match="unknown signal 'attention'.*cls_attention"):
        vtoken.encode(model, x, signals=("attention",))
    with pytest.raises(vtoken.VTokenError, match=r"signal 'cls_attention@7' reads block 7.*\[-3, 2\]"):
        vtoken.encode(model, x, signals=("cls_attention@7",))
    with pytest.raises(vtoken.InputError, match=r"expected \[B, 3, H, W\]"):
        vtoken.encode(model, x[0])
    hooks = all_hooks(model)
    with pytest.raises(RuntimeError):  # the tower itself fails (one channel): every hook is still removed
        vtoken.encode(model, x[:, :1], signals=("cls_attention",))
    assert all_hooks(model) == hooks == all_hooks(copy.deepcopy(model))


def test_unsupported_towers_and_towers_without_cls():
    from open_clip.model import CLIP
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with pytest.raises(vtoken.UnsupportedModelError, match="accepted: a timm VisionTransformer"):
        vtoken.encode(torch.nn.Linear(3, 3), pixels(1))
    clip = CLIP(16, dict(image_size=IMAGE, patch_size=4, width=32, layers=1, head_width=8),
                dict(context_length=8, vocab_size=64, width=32, heads=4, layers=1))  # fmt: skip
    with pytest.raises(vtoken.UnsupportedModelError, match="pass its vision tower: `model.visual`"):
        vtoken.encode(clip, pixels(1))
    assert vtoken.encode(clip.visual, pixels(1), layer=0)[0].shape == (1, 64, 32)
    torch.manual_seed(0)
    no_cls = VisionTransformer(img_size=IMAGE, patch_size=4, embed_dim=32, depth=2, num_heads=4, class_token=False,
                               global_pool="avg", num_classes=0).eval()  # fmt: skip
    config = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=4
    )
    siglip = SiglipVisionModel(config).eval()
    for model in (no_cls, siglip):
        features, signals = vtoken.encode(model, pixels(1), layer=-1)  # features need no [CLS]
        assert features.shape == (1, 64, 32) and signals == {}
        with pytest.raises(vtoken.MissingSignalError, match="needs a \\[CLS\\] token"):
            vtoken.encode(model, pixels(1), signals=("cls_attention",))
        assert all_hooks(model) == all_hooks(copy.deepcopy(model))
    with torch.no_grad():
        ref = siglip(pixels(1), output_hidden_states=True).hidden_states[2]
    assert torch.allclose(vtoken.encode(siglip, pixels(1), layer=1)[0], ref, atol=1e-6, rtol=0)


def test_select_keeps_the_budget_in_ascending_order_by_the_methods_rule():
    model = timm_vit()
    with torch.no_grad():
        features, signals = vtoken.encode(model, pixels(3), layer=-2, signals=("cls_attention",))
    for budget in (0.25, 0.05, 10, 1.0):
        k = vtoken.tokens_to_keep(budget, 64)
        kept, index = vtoken.select(vtoken.FasterVLM(budget=budget), features, grid=(8, 8), signals=signals)
        top = signals["cls_attention"].topk(k, dim=1).indices.sort(1).values
        assert kept.shape == (3, k, 32) and torch.equal(index, top)
        assert torch.equal(kept, torch.stack([features[b, top[b]] for b in range(3)]))
    # HiRED single crop: the top int(N * rate) by the feature layer's [CLS] row
    kept, index = vtoken.select(vtoken.HiRED(budget=0.2), features, signals=signals)
    assert torch.equal(index, signals["cls_attention"].topk(12, dim=1).indices.sort(1).values)
    # random: the method's own seeded subset, the same for every image
    kept, index = vtoken.select(vtoken.Random(budget=16, seed=3), features)
    noise = torch.rand(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(index, noise.topk(16).indices.sort().values.expand(3, -1))


def test_select_merging_methods_and_mmtok():
    features = torch.randn(2, 48, 8, generator=torch.Generator().manual_seed(0))
    kept, anchors = vtoken.select(vtoken.Pool(budget=12), features, grid=(6, 8))
    assert torch.allclose(kept, torch.einsum("kn,bnd->bkd", pool_weights(6, 8, 12), features), atol=1e-6)
    assert torch.equal(anchors, pool_anchors(6, 8, 12).expand(2, -1))
    kept, index = vtoken.select(vtoken.FourierDCT(budget=0.25), features, grid=(6, 8))
    assert kept.shape == (2, 12, 8) and index is None  # a 3 x 4 grid in raster order
    # DC term: the mean of the grid scaled by sqrt(HW / hw) at every output token of a constant grid
    flat = torch.ones(1, 48, 8)
    assert torch.allclose(vtoken.select(vtoken.FourierDCT(budget=0.25), flat, grid=(6, 8))[0], flat[:, :12] * 2)
    # MMTok with given text embeddings and a projector: equals the method on hand-built VisualTokens
    projector = torch.nn.Linear(8, 16)
    text = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    kept, index = vtoken.select(vtoken.MMTok(budget=6), features, grid=(6, 8), text=text, project=projector)
    query = vtoken.TextQuery(["q", "q"], "custom", lambda q: text)
    tokens = vtoken.VisualTokens(features, (6, 8), {"projected": projector(features), "vision_features": features},
                                 torch.arange(2), question=query)  # fmt: skip
    assert torch.equal(index, vtoken.MMTok(budget=6).select(tokens).kept) and kept.shape == (2, 6, 8)
    # one text per image: image 1 alone gives the same as in the batch
    texts = [text, text[:2]]
    _, both = vtoken.select(vtoken.MMTok(budget=6), features, grid=(6, 8), text=texts, project=projector)
    _, second = vtoken.select(vtoken.MMTok(budget=6), features[1:], grid=(6, 8), text=texts[1:], project=projector)
    assert torch.equal(both[1:], second)


def test_select_errors_name_what_is_accepted():
    features = torch.randn(1, 16, 4)
    with pytest.raises(vtoken.MissingSignalError, match=r"fastervlm needs the signal\(s\) \['cls_attention'\]"):
        vtoken.select(vtoken.FasterVLM(), features)
    with pytest.raises(vtoken.MissingSignalError, match="text="):
        vtoken.select(vtoken.MMTok(budget=4), features)
    with pytest.raises(vtoken.InputError, match=r"grid=\(3, 5\)"):
        vtoken.select(vtoken.Random(), features, grid=(3, 5))
    with pytest.raises(vtoken.InputError, match="not a square grid"):
        vtoken.select(vtoken.Random(), torch.randn(1, 12, 4))
    with pytest.raises(vtoken.InputError, match=r"expected \[B, N, D\]"):
        vtoken.select(vtoken.Random(), torch.randn(16, 4))
    with pytest.raises(vtoken.InputError, match="cls_attention"):
        vtoken.select(vtoken.FasterVLM(), features, signals={"cls_attention": torch.rand(1, 15)})
    for method in (vtoken.FastV(), vtoken.MustDrop()):
        with pytest.raises(vtoken.VTokenError, match="encoder-stage methods"):
            vtoken.select(method, features)
