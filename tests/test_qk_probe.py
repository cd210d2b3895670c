"""The LLM-stage probe reads queries and keys where the attention finishes them (QK-norm, gated queries, fused
projections, partial rotary); a layer it cannot read is refused at `patch`, leaving no hook behind."""

import pytest
import torch
import transformers as T
from conftest import assert_identity, make_image

import vtoken
from vtoken.adapters.llm import QueryKeyProbe
from vtoken.launches import count_launches
from vtoken.zoo import build_prompt, llava_config, llava_processor, tiny_tokenizer

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
# attention variants: plain (Llama), QK-norm per head before the transpose (Qwen3), after it (Gemma 3), over all
# heads (OLMo 2), fused qkv_proj with partial rotary (Phi-3), gated q_proj with partial rotary (Qwen3.5)
LLMS = {
    "llama": (T.LlamaConfig, {}),
    "qwen3": (T.Qwen3Config, {}),
    "gemma3": (T.Gemma3TextConfig, {"sliding_window": 64, "query_pre_attn_scalar": 8}),
    "olmo2": (T.Olmo2Config, {}),
    "phi3": (T.Phi3Config, {"partial_rotary_factor": 0.5, "head_dim": 8}),
    "qwen3.5": (
        T.Qwen3_5TextConfig,
        {
            "layer_types": ["linear_attention", "full_attention"],
            **dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
}


def _causal_lm(name):
    config_cls, extra = LLMS[name]
    config = config_cls(**{**TEXT, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():  # norm weights start at one (or zero): make every norm matter
        param.data.add_(0.1 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("name", list(LLMS))
@pytest.mark.parametrize("length", [9, 4])  # 4 = the number of query heads: [B, S, H, d] and [B, H, S, d] alike
def test_probe_rows_equal_eager_attention(name, length):
    """Every query row the probe computes equals the eager layer's own softmax(QK^T) (output_attentions)."""
    model = _causal_lm(name)
    layer = 1  # the full-attention layer of the hybrid Qwen3.5
    probe = QueryKeyProbe(model.model.layers[layer].self_attn)
    ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :1] = 0  # a left-padded row
    probe.active = True
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        rows = torch.tensor([[length - 1, 2, 1], [length - 1, 3, 1]])
        got = probe.attention_rows(rows, mask.bool())
    finally:
        probe.remove()
    eager = [a for a in out.attentions if a is not None][-1]  # [B, H, S, S]; Qwen3.5 reports full layers only
    ref = eager.gather(2, rows[:, None, :, None].expand(-1, eager.shape[1], -1, eager.shape[-1]))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert ref.std() > 0.01  # real, non-uniform attention


def _hooks(model):
    return {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for name, m in model.named_modules()}


def _llava_with(text_config):
    tokenizer = tiny_tokenizer()
    base = llava_config(tokenizer, vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, projection_dim=32), text={})  # fmt: skip
    text_config.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    config = T.LlavaConfig(vision_config=base.vision_config.to_dict(), text_config=text_config,
                           image_token_id=base.image_token_id, vision_feature_layer=-2,
                           vision_feature_select_strategy="default", pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, llava_processor(tokenizer)


def test_llava_with_phi3_fused_qkv_runs_fastv():
    """LLaVA on a Phi-3 LLM (fused qkv_proj, as xtuner/llava-phi-3-mini-hf): FastV patches and keeps everything at
    keep=1.0; at keep=0.25 it keeps the visual tokens the last token attends to most in the eager layer."""
    text = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, partial_rotary_factor=0.5)  # fmt: skip
    model, processor = _llava_with(text)
    inputs = processor(images=[make_image(336, 336)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    assert_identity(model, vtoken.FastV(layer=1, keep=1.0), inputs)
    with torch.no_grad(), vtoken.patched(model, "fastv", layer=1, keep=0.25) as handle:
        model(**inputs)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            eager = model(**inputs, output_attentions=True).attentions[1]
    finally:
        model.set_attn_implementation("sdpa")
    visual = inputs["input_ids"][0] == model.config.image_token_id
    scores = eager[0, :, -1, visual].mean(0)
    expected = scores.topk(vtoken.tokens_to_keep(0.25, int(visual.sum()))).indices.sort().values
    assert torch.equal(handle.records[-1].kept, expected)


def test_unreadable_attention_is_refused_at_patch_with_no_hook_left():
    """An attention the probe cannot read (DeepSeek-V3's multi-head latent attention: no k_proj) fails at `patch`
    with a vtoken error naming the class and what it needs; every module's hooks are as before."""
    text = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=3,
                max_position_embeddings=4096)  # fmt: skip
    model, _ = _llava_with(text)
    before = _hooks(model)
    with pytest.raises(vtoken.VTokenError, match=r"DeepseekV3Attention.*k_proj"):
        vtoken.patch(model, "fastv", layer=1, keep=0.5)
    assert vtoken.handle_of(model) is None and "generate" not in model.__dict__
    assert _hooks(model) == before


@pytest.mark.parametrize("name", list(LLMS))
@pytest.mark.parametrize("cached", [False, True], ids=["keys-rotated-here", "keys-from-the-cache"])
def test_probe_visual_attention_equals_eager_attention(name, cached):
    """The drop's read (`QueryKeyProbe.visual_attention`: the rotary applied inside one op where the model's is the
    rotate-half form over the whole head, rotated first otherwise: Phi-3's and Qwen3.5's partial rotary) equals the
    eager layer's head-mean softmax at chosen key slots, with a left-padded row, a missing row and a missing slot;
    keys rotated from the capture or read rotated from the layer's cache."""
    model = _causal_lm(name)
    layer = 1
    attention = model.model.layers[layer].self_attn
    probe = QueryKeyProbe(attention)
    length = 9
    ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    probe.active = True
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=cached)
        rows = torch.tensor([[length - 1, 5, 4], [length - 1, 6, -1]])
        slots = torch.tensor([[1, 2, 3, 4], [2, 3, 4, -1]])
        keys = out.past_key_values.layers[layer].keys if cached else None
        valid = mask.bool()
        with count_launches() as counted:
            got = probe.visual_attention(rows, valid, slots, keys)
    finally:
        probe.remove()
    fused = name not in ("phi3", "qwen3.5")  # partial rotary: rotated first, then `visual_attention`
    assert counted.ops["vtoken::rotary_visual_attention"] == int(fused), counted.describe()
    if fused:
        assert counted.kernels == 1, counted.describe()  # the whole read: one op
    eager = [a for a in out.attentions if a is not None][-1].mean(1)  # [B, S, S], head mean
    ref = eager.gather(1, rows.clamp(min=0)[:, :, None].expand(-1, -1, length))
    ref = ref.gather(2, slots.clamp(min=0)[:, None, :].expand(-1, rows.shape[1], -1))
    ref = ref * (rows >= 0)[:, :, None] * (slots >= 0)[:, None, :]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert ref.std() > 0.01
