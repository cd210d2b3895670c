"""Contract tests: one per assumption `vtoken.adapters.hf` makes about transformers' internals, checked against the
installed transformers by running it (tiny random models), not by reading hf.py back. Each failure names the
assumption and the release that changed it, so a new release's break reads as one line here instead of dozens of
failures across the adapter and LLM-stage tests."""

import inspect
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import inputs_for, make_image
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import vtoken
from vtoken.adapters import hf
from vtoken.zoo import tiny_qwen2_5_vl, tiny_qwen2_vl, tiny_qwen3_vl

VERSION = f"transformers {hf.INSTALLED}"


def broken(assumption: str, change: str = "") -> str:
    """The failure message of a contract: the installed release, what vtoken assumes, and what changed before."""
    return f"{VERSION}: {assumption}" + (f" ({change})" if change else "")


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama LM (3 layers, GQA), fp32, eager attention, so masks come back as 4-D float tensors."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llava_inputs(llava):
    model, processor = llava
    return inputs_for(processor, [make_image(300, 200), make_image(200, 300, seed=1)], ["what is it?", "and here?"])


def layer_calls(model, run):
    """The keyword arguments every decoder layer of `model` received during `run()`."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True)
             for layer in model.model.layers]  # fmt: skip
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- the tested range
def test_tested_range_warning(llava, monkeypatch):
    """`vtoken.patch` warns once per process outside MIN_TESTED..MAX_TESTED, and never inside it."""
    model, _ = llava
    assert hf.tested(hf.Version(hf.MIN_TESTED)) and hf.tested(hf.Version(hf.MAX_TESTED))
    assert not hf.tested(hf.Version("5.18.0")) and not hf.tested(hf.Version("5.26.0"))
    for outside in ("5.18.2", "5.26.0.dev0"):
        monkeypatch.setattr(hf, "_warned", False)
        monkeypatch.setattr(hf, "INSTALLED", hf.Version(outside))
        expected = rf"tested with transformers 5\.19\.0 to 5\.25\.0; transformers {outside} is installed"
        with pytest.warns(UserWarning, match=expected), vtoken.patched(model, "random", budget=0.5):
            pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with vtoken.patched(model, "random", budget=0.5):  # once only
                pass
    monkeypatch.setattr(hf, "_warned", False)
    monkeypatch.setattr(hf, "INSTALLED", hf.Version("5.21.1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with vtoken.patched(model, "random", budget=0.5):
            pass


def test_only_hf_knows_the_version():
    """No module of the package but vtoken/adapters/hf.py reads the transformers version (so none branches on it)."""
    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"transformers\.__version__|version\(\s*[\"']transformers[\"']|INSTALLED\.release")
    readers = [str(path.relative_to(root)) for path in sorted((root / "vtoken").rglob("*.py"))
               if pattern.search(path.read_text())]  # fmt: skip
    assert readers == ["vtoken/adapters/hf.py"], f"only vtoken/adapters/hf.py may read the version; found {readers}"


# ----------------------------------------------------------------- the cache: kwarg and output field
def test_decoder_layers_get_the_cache_under_its_name(llama):
    """The LLM stages read each layer's cache from the layer's keywords (hf.cache_in)."""
    calls = layer_calls(llama, lambda: llama(ids(5), use_cache=True))
    names = sorted(calls[0])
    assert hf.CACHE_KWARG in calls[0] and isinstance(calls[0][hf.CACHE_KWARG], DynamicCache), broken(
        f"decoder layers should receive the KV cache as `{hf.CACHE_KWARG}`; they received {names}",
        "5.24 renamed the decoder layers' `past_key_values` kwarg to `cache`",
    )
    assert hf.cache_in(calls[0]) is calls[0][hf.CACHE_KWARG]


def test_model_forward_takes_the_cache_under_its_name(llama):
    """A decoding step fed the cache as `hf.cache_kwargs(cache)` continues the prompt, with no deprecation."""
    prompt = ids(6)
    with torch.no_grad():
        full = llama(prompt).logits[:, -1]
        cache = hf.cache_out(llama(prompt[:, :5], use_cache=True))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            try:
                step = llama(prompt[:, 5:], **hf.cache_kwargs(cache), use_cache=True).logits[:, -1]
            except FutureWarning as deprecated:
                pytest.fail(broken(f"`{hf.CACHE_KWARG}` is deprecated as the forward's cache kwarg: {deprecated}"))
    assert (step - full).abs().max() <= 1e-5, broken(
        f"a model forward ignored the cache passed as `{hf.CACHE_KWARG}`",
        "5.24 renamed the model forwards' `past_key_values` kwarg to `cache`",
    )


def test_outputs_carry_the_cache_under_its_name(llama):
    with torch.no_grad():
        out = llama(ids(4), use_cache=True)
    assert hf.CACHE_KWARG in out.keys() and isinstance(hf.cache_out(out), DynamicCache), broken(
        f"model outputs should hold the KV cache in the field `{hf.CACHE_KWARG}`; fields: {list(out.keys())}",
        "5.24 renamed the outputs' `past_key_values` field to `cache`",
    )


def test_no_cache_position(llama):
    """vtoken passes positions as `position_ids` and lets the cache length place new tokens: layers take no
    `cache_position` (removed from the decoder stack before 5.19)."""
    calls = layer_calls(llama, lambda: llama(ids(4), use_cache=True))
    forward = inspect.signature(type(llama.model).forward).parameters
    assert "cache_position" not in calls[0] and "cache_position" not in forward, broken(
        "the decoder stack takes `cache_position` again; vtoken's decode positions ignore it"
    )


def test_per_layer_caches_and_the_length_read_from_layer_0(llama):
    """The LLM stages cut one layer's keys/values in place (hf.cache_layers); transformers reads the cache length
    (next position, mask width) from the first layer only."""
    with torch.no_grad():
        cache = hf.cache_out(llama(ids(7), use_cache=True))
    layers = hf.cache_layers(cache)
    assert layers is not None and len(layers) == 3, broken(
        "a DynamicCache should hold one cache per layer in `.layers`"
    )
    keys = layers[1].keys
    assert keys.shape == (1, 2, 7, 8), broken(f"a layer cache's `keys` should be [B, Hkv, S, d]; got {keys.shape}")
    layers[1].keys, layers[1].values = keys[:, :, :4], layers[1].values[:, :, :4]
    assert cache.get_seq_length() == 7 and cache.get_seq_length(1) == 4, broken(
        "the cache length should be read from layer 0 (a cut in a later layer leaves it)"
    )


def test_static_cache_names():
    names = hf.static_cache_implementations()
    assert "static" in names and "dynamic" not in names, broken(
        f"generation's static cache implementations should include 'static' but not 'dynamic'; got {sorted(names)}"
    )


# ----------------------------------------------------------------- masks and attention functions
def test_causal_mask_takes_the_cache(llama):
    """With a cache of P tokens, a step of q tokens gets a [B, 1, q, P + q] mask: the cache reached the builder."""
    with torch.no_grad():
        cache = hf.cache_out(llama(ids(5), use_cache=True))
    embeds = torch.zeros(1, 2, 32)
    mask = torch.ones(1, 7, dtype=torch.long)
    try:
        built = hf.causal_mask(llama.config, embeds, mask, cache, torch.tensor([[5, 6]]), 0)
    except TypeError as error:
        pytest.fail(broken(f"create_causal_mask refused its cache as `{hf.CACHE_KWARG}`: {error}", "renamed in 5.24"))
    assert built is not None and tuple(built.shape) == (1, 1, 2, 7), broken(
        f"create_causal_mask should give an eager [1, 1, 2, 7] mask after 5 cached tokens; got "
        f"{None if built is None else tuple(built.shape)}"
    )
    allowed = built[0, 0] == 0
    assert allowed.tolist() == [[True] * 6 + [False], [True] * 7], broken("create_causal_mask's mask is not causal")


def test_recurrent_mask_takes_the_cache(llama):
    padded = torch.tensor([[0, 1, 1, 1]])
    try:
        built = hf.recurrent_mask(llama.config, torch.zeros(1, 4, 32), padded, None)
    except TypeError as error:
        pytest.fail(broken(f"create_recurrent_attention_mask refused `{hf.CACHE_KWARG}`: {error}", "renamed in 5.24"))
    assert built is not None and built.tolist() == padded.tolist(), broken(
        f"create_recurrent_attention_mask should return the 2-D padding mask of a padded prefill; got {built}"
    )


def test_registered_attention_runs_with_its_mask(llava, llava_inputs):
    """An attention function registered with a mask builder (hf.register_attention) and switched on for the LLM
    only (hf.set_text_attention) runs in every LLM layer with a 4-D mask; the vision tower keeps its own; the
    stored implementations are put back exactly."""
    model, _ = llava
    original = hf.attention_implementation(model.model.language_model)
    masks = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return hf.attention_function(original, module)(module, query, key, value, attention_mask, **kwargs)

    stored = hf.stored_attention(model)
    tower = hf.attention_implementation(model.model.vision_tower)
    with torch.no_grad():
        ref = model(**llava_inputs).logits
        hf.register_attention("vtoken_contract", recording, like=original)
        hf.set_text_attention(model, "vtoken_contract")
        try:
            assert hf.attention_implementation(model.model.language_model) == "vtoken_contract", broken(
                "set_attn_implementation({'text_config': name}) did not switch the language model"
            )
            assert hf.attention_implementation(model.model.vision_tower) == tower, broken(
                "set_attn_implementation({'text_config': name}) switched the vision tower too"
            )
            logits = model(**llava_inputs).logits
        finally:
            hf.set_text_attention(model, original)
            hf.restore_attention(stored)
    layers = len(model.model.language_model.layers)
    assert len(masks) == layers, broken(f"the registered attention ran in {len(masks)} of {layers} LLM layers")
    assert all(m is not None and m.dim() == 4 for m in masks), broken(
        "a registered attention function got no 4-D mask: AttentionMaskInterface.register no longer supplies the "
        "mask builder by the same name"
    )
    assert (logits - ref).abs().max() <= 1e-5
    assert [c.__dict__.get("_attn_implementation_internal") for c, _ in stored] == [s for _, s in stored], broken(
        "configs no longer store their attention implementation in `_attn_implementation_internal`"
    )


def test_the_mask_builder_says_how_it_was_asked(llama):
    """`hf.register_attention(..., on_mask=...)` sees every mask `create_causal_mask` builds under the registered
    name, and `hf.plain_causal` tells the plain causal + padding request (sparse prefill's only case) from one with
    an extra mask function (a sliding window, chunks or packed sequences are built that way): how sparse prefill
    knows a layer's mask without reading it."""
    seen = []
    hf.register_attention("vtoken_contract_mask", lambda *a, **k: None, like="sdpa",
                          on_mask=lambda mask, plain: seen.append((mask, plain)))  # fmt: skip
    config = LlamaConfig(**llama.config.to_dict())
    config._attn_implementation = "vtoken_contract_mask"  # (5.25's config __init__ ignores the private keyword)
    embeds = torch.zeros(2, 6, config.hidden_size)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    built = hf.causal_mask(config, embeds, padding, DynamicCache(config=config), torch.arange(6)[None], 0)
    assert len(seen) == 1 and seen[0][0] is built and seen[0][1] is True, broken(
        "the registered mask builder was not called by create_causal_mask with keyword arguments naming the plain "
        "causal mask function"
    )
    assert built.shape == (2, 1, 6, 6) and torch.equal(built[:, 0, -1], padding.bool()), broken(
        "the built mask's last row is no longer each row's key padding"
    )
    from transformers.masking_utils import create_causal_mask

    cache = hf.cache_kwargs(DynamicCache(config=config))
    create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=padding, position_ids=torch.arange(6)[None],
                       and_mask_function=lambda b, h, q, kv: kv >= 0, **cache)  # fmt: skip
    assert len(seen) == 2 and seen[1][1] is False, broken("an extra mask function no longer wraps the causal one")


def test_stock_attention_functions(llama):
    """hf.attention_function: (module, q [B, H, S, d], k, v [B, Hkv, S, d], mask) -> ([B, S, H, d], ...), SDPA and
    the modelling module's eager function agreeing."""
    attention = llama.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    causal = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    outs = [hf.attention_function(name, attention)(attention, q, k, v, causal, scaling=8**-0.5)[0]
            for name in ("sdpa", "eager")]  # fmt: skip
    assert outs[0].shape == (1, 5, 4, 8), broken(f"attention functions should return [B, S, H, d]; got {outs[0].shape}")
    assert (outs[0] - outs[1]).abs().max() <= 1e-5, broken("sdpa and eager attention functions disagree")


def test_rotary_function(llama):
    """`apply_rotary_pos_emb(q, k, cos, sin)` of a decoder's modelling module (the LLM stages' query/key probe)."""
    rotary = hf.modeling_function(llama.model.layers[0].self_attn, "apply_rotary_pos_emb")
    assert rotary is not None, broken("modeling_llama has no `apply_rotary_pos_emb`")
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    position = torch.arange(3)[None]
    cos, sin = llama.model.rotary_emb(q, position_ids=position)
    rq, rk = rotary(q, k, cos, sin)
    assert rq.shape == q.shape and torch.allclose(rq[:, :, 0], q[:, :, 0]), broken(
        "apply_rotary_pos_emb(q, k, cos, sin) should rotate q [B, H, S, d] (position 0 unchanged)"
    )
    assert not torch.allclose(rk[:, :, 2], k[:, :, 2])


def test_anyres_geometry():
    """LLaVA-NeXT / OneVision's anyres helpers: crop grid of an image, crop count, unpadding of the stitched grid."""
    pinpoints = [[336, 672], [672, 336], [672, 672]]
    for family in ("llava_next", "llava_onevision"):
        grid = hf.modeling_function(family, "get_anyres_image_grid_shape")
        count = hf.modeling_function(family, "image_size_to_num_patches")
        unpad = hf.modeling_function(family, "unpad_image")
        assert None not in (grid, count, unpad), broken(f"modeling_{family} lacks an anyres helper")
        assert tuple(grid((300, 700), pinpoints, 336)) == (1, 2), broken(f"{family}: a wide image's grid is 1 x 2")
        assert count((300, 700), pinpoints, 336) == 3, broken(f"{family}: a 1 x 2 grid is 3 crops with the base")
        assert unpad(torch.zeros(1, 24, 48), (300, 700)).shape == (1, 20, 48), broken(f"{family}: unpad_image")


# ----------------------------------------------------------------- families' own feature plumbing
def test_onevision_packing_and_pooling():
    """OneVision's `pack_image_features` keeps each image's base crop first and unchanged ([side^2, D] rows, which
    the adapter selects on) and packs one tensor per image; `apply_pooling` takes each frame's side x side grid to
    ceil(side / 2)^2 tokens, a constant map staying constant (bilinear)."""
    from vtoken.zoo import TINY_MODELS

    model, _ = TINY_MODELS["tiny-onevision"]()
    inner, config = model.model, model.config
    side = config.vision_config.image_size // config.vision_config.patch_size
    width = config.text_config.hidden_size
    size = config.vision_config.image_size
    image_sizes = torch.tensor([[size, 2 * size], [size, size]])
    count = hf.modeling_function("llava_onevision", "image_size_to_num_patches")
    crops = [count(tuple(s.tolist()), config.image_grid_pinpoints, size) for s in image_sizes]
    features = [torch.randn(n, side * side, width) for n in crops]
    with torch.no_grad():
        packed = hf.pack_anyres_features(inner, features, image_sizes, config.vision_aspect_ratio)
        frames = torch.randn(3, side * side, width)
        pooled = hf.pool_video_frames(inner, frames)
        flat = hf.pool_video_frames(inner, torch.full((1, side * side, width), 0.5))
    assert len(packed) == 2 and all(p.shape[-1] == width for p in packed), broken(
        "pack_image_features: one [N, D] per image"
    )
    for got, crop in zip(packed, features, strict=True):
        assert torch.equal(got[: side * side], crop[0]), broken("pack_image_features: the base crop first, unchanged")
    assert packed[0].shape[0] > side * side, broken("pack_image_features: a 1 x 2 grid adds its stitched crops")
    assert pooled.shape == (3, math.ceil(side / 2) ** 2, width), broken("apply_pooling: [F, ceil(side/2)^2, D]")
    assert torch.allclose(flat, torch.full_like(flat, 0.5)), broken("apply_pooling: bilinear (a constant stays)")


def test_internvl_pixel_shuffle_permutes_a_tile():
    """InternVL's `pixel_shuffle` of a [T, S, S, D] patch grid is [T, S/2, S/2, 4D] holding the same values (a
    rearrangement, which the adapter applies to keys and scores alike)."""
    from vtoken.zoo import TINY_MODELS

    model, _ = TINY_MODELS["tiny-internvl"]()
    grid = torch.randn(2, 8, 8, 6)
    shuffled = hf.pixel_shuffle(model.model, grid, model.config.downsample_ratio)
    assert shuffled.shape == (2, 4, 4, 24), broken("pixel_shuffle(scale 0.5): [T, S/2, S/2, 4D]")
    assert torch.equal(shuffled.flatten().sort().values, grid.flatten().sort().values), broken(
        "pixel_shuffle: a permutation"
    )


# ----------------------------------------------------------------- encoders
def test_selected_hidden_states(llava):
    """hf.hidden_states returns the requested entries of the full `hidden_states` tuple (negative indices too)."""
    tower = llava[0].model.vision_tower
    pixels = torch.randn(2, 3, 336, 336)
    with torch.no_grad():
        every = tower(pixels, output_hidden_states=True).hidden_states
        picked = hf.hidden_states(tower, [-2, 0], pixels)
    wanted = (every[-2], every[0])
    same = [isinstance(got, torch.Tensor) and torch.equal(got, want) for got, want in zip(picked, wanted, strict=True)]
    assert all(same), broken(
        "hf.hidden_states([-2, 0]) does not return hidden_states[-2] and [0]",
        "5.23 made `output_hidden_states` take a list of hidden-state indices; before, a list meant layer outputs",
    )
    if hf.INSTALLED.release[:2] >= (5, 23):  # the selective form keeps only what was asked
        with torch.no_grad():
            selective = tower(pixels, output_hidden_states=[-2]).hidden_states
        assert len(selective) == len(every) and selective[0] is None and selective[-2] is not None, broken(
            "output_hidden_states=[i] should keep only hidden_states[i] (None elsewhere)", "added in 5.23"
        )


def test_encoder_outputs_fill_the_placeholders(llava, llava_inputs):
    """`generate` encodes pixels into `mm_encoder_outputs` (one entry per image) before the first forward, which
    gets no pixels; given such features instead of pixels, generate expands them for beams and the forward
    scatters their `pooler_output` into the placeholders: same tokens as with the pixels."""
    model, _ = llava
    seen = {}

    def capture(module, args, kwargs):
        seen.setdefault("outputs", kwargs.get(hf.ENCODER_OUTPUTS))
        seen.setdefault("pixels", kwargs.get("pixel_values"))

    hook = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model.generate(**llava_inputs, max_new_tokens=1, do_sample=False)
    finally:
        hook.remove()
    assert seen["pixels"] is None and "image" in (seen["outputs"] or {}), broken(
        f"generate should encode images into `{hf.ENCODER_OUTPUTS}['image']` before the first forward (which then "
        f"gets no pixel_values); got {seen}"
    )
    features = list(seen["outputs"]["image"].pooler_output)
    assert [f.shape[0] for f in features] == [576, 576], broken("one [tokens, D] feature tensor per image expected")
    text = {k: v for k, v in llava_inputs.items() if k != "pixel_values"}
    settings = dict(max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**llava_inputs, **settings)
        given = model.generate(**text, **{hf.ENCODER_OUTPUTS: {"image": hf.encoder_output(features)}}, **settings)
    assert torch.equal(given, ref), broken(
        f"generate with pre-encoded `{hf.ENCODER_OUTPUTS}` and beams differs from generate with the pixels"
    )


def test_placeholder_count_must_match_the_features(llava, llava_inputs):
    """vtoken shrinks the placeholder runs with the features: the stock forward refuses a mismatch rather than
    silently misplacing features (get_placeholder_mask)."""
    model, _ = llava
    text = {k: v for k, v in llava_inputs.items() if k != "pixel_values"}
    width = model.config.text_config.hidden_size
    features = [torch.zeros(576, width), torch.zeros(575, width)]
    with pytest.raises(ValueError, match="(?i)image features and image tokens do not match"), torch.no_grad():
        model(**text, **{hf.ENCODER_OUTPUTS: {"image": hf.encoder_output(features)}})


def test_deepstack_features_output():
    """Qwen3-VL's encoder output carries `deepstack_features` beside `pooler_output`, which the text model adds at
    the visual positions through `_deepstack_process(hidden, visual_pos_masks, visual_embeds)`."""
    out = hf.encoder_output([torch.zeros(2, 4)], deepstack_features=[[torch.ones(2, 4)]])
    assert out.deepstack_features[0][0].sum() == 8 and out.pooler_output[0].shape == (2, 4)
    model, _ = tiny_qwen3_vl()
    process = getattr(type(model.model.language_model), "_deepstack_process", None)
    assert process is not None, broken("Qwen3-VL's text model has no `_deepstack_process`")
    params = list(inspect.signature(process).parameters)[1:]
    assert params == ["hidden_states", "visual_pos_masks", "visual_embeds"], broken(
        f"Qwen3-VL's `_deepstack_process` takes {params}"
    )


# ----------------------------------------------------------------- M-RoPE (Qwen-VL)
@pytest.fixture(scope="module")
def qwen2_vl():
    return tiny_qwen2_vl()


def test_rope_index_and_deltas_place_generate_s_tokens(qwen2_vl):
    """hf.rope_index gives the (t, h, w) rows generate feeds the LLM for the prompt (after the text row), and its
    decoding steps are placed at (text position + `rope_deltas`) on t/h/w: what the adapter sets after shrinking."""
    model, processor = qwen2_vl
    inputs = inputs_for(processor, [make_image(120, 90), make_image(90, 150, seed=1)], ["what?", "and this one?"])
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("position_ids")), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    rope = hf.rope_index(model.model, inputs["input_ids"], inputs["mm_token_type_ids"],
                         image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])  # fmt: skip
    prefill, step = seen
    assert rope.shape == (3, *inputs["input_ids"].shape) and torch.equal(prefill[-3:], rope), broken(
        "get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=, attention_mask=) should give the [3, B, L] "
        "positions generate feeds the language model"
    )
    deltas = hf.rope_deltas(model.model)
    text = inputs["attention_mask"].sum(1)  # the new token's text position: after each row's real tokens
    assert deltas.shape == (2, 1) and torch.equal(step[-3:, :, -1], (text + deltas[:, 0]).expand(3, -1)), broken(
        "generate's decoding steps should be placed at text position + model.rope_deltas on t/h/w"
    )


def test_vision_window_index():
    """Qwen2.5-VL's window permutation of merge groups: a permutation of every group of the image."""
    model, _ = tiny_qwen2_5_vl()
    grid = torch.tensor([[1, 8, 12]])
    index = hf.vision_window_index(grid, model.model.visual)
    assert torch.equal(index.sort().values, torch.arange(8 * 12 // 4)), broken(
        "get_vision_window_index(grid_thw, merge, window, patch)[0] should permute the merge groups"
    )


# ----------------------------------------------------------------- the tower stage
def test_vision_blocks_are_pre_norm_attention_then_mlp(llava):
    """ToMe replaces a CLIP / SigLIP block's forward with `hf`'s parts: the same output as the stock block."""
    from vtoken.zoo import tiny_onevision

    for model in (llava[0], tiny_onevision()[0]):
        tower = model.model.vision_tower
        block = tower.encoder.layers[0]
        assert hf.vision_block_missing(block) == [] and hf.attention_heads(block) == tower.config.num_attention_heads
        x = torch.randn(2, 5, tower.config.hidden_size)
        with torch.no_grad():
            h = x + hf.vision_block_attention(block, hf.vision_block_norm(block, x), None)
            assert torch.allclose(block(x, None), h + hf.vision_block_mlp(block, h), atol=1e-6)
            seen = {}
            handle = hf.key_projection(block).register_forward_hook(lambda m, a, out, seen=seen: seen.update(keys=out))
            assert len(hf.forward_hooks(hf.key_projection(block))) == 1
            block(x, None)
            handle.remove()
        assert seen["keys"].shape == x.shape  # the keys of every token, before the heads are split


def test_the_encoder_gets_the_embeddings_by_keyword(llava, llava_inputs):
    """KeptPatches gathers rows of the encoder's `inputs_embeds` (and gives its key mask as `attention_mask`)."""
    tower, seen = llava[0].model.vision_tower, {}

    def grab(module, args, kwargs):
        embeds, args, rest = hf.encoder_embeddings(args, kwargs)
        seen["embeds"] = embeds
        return hf.encoder_call(args, rest, embeds[:, :3], None)

    handle = tower.encoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = tower(llava_inputs["pixel_values"], output_hidden_states=True)
    finally:
        handle.remove()
    assert seen["embeds"].shape[1] == 1 + 24 * 24 and out.last_hidden_state.shape[1] == 3


def test_qwen_towers_take_precomputed_tables():
    """Every table vtoken hands a Qwen-VL tower is read from its kwargs by `vision_utils` (else it would be built
    from the whole grid, silently)."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen25
    import transformers.utils.generic as generic
    import transformers.vision_utils as vision_utils

    source = "".join(inspect.getsource(m) for m in (vision_utils, generic, qwen25))  # the readers of the kwargs
    for name in hf.QWEN_VISION_TABLES:
        assert f'"{name}"' in source, name
    assert hf.has_window_attention(tiny_qwen2_5_vl()[0].model.visual)
    assert hf.has_learned_position_embedding(tiny_qwen3_vl()[0].model.visual)
    with pytest.raises(TypeError, match="no precomputed"):
        hf.qwen_vision_forward(None, torch.zeros(1, 1), torch.zeros(1, 3), rope=None)


def test_a_checkpoint_s_image_processor_is_read_locally(tmp_path):
    assert hf.local_image_processor(str(tmp_path)) is None  # nothing saved there: no network either
    from vtoken.zoo import tiny_llava

    tiny_llava()[1].image_processor.save_pretrained(tmp_path)
    assert hf.local_image_processor(str(tmp_path)).image_mean == tiny_llava()[1].image_processor.image_mean


def _text_layer(kind: str):
    """(decoder layer 0, its language model) of a tiny LLM whose layers are `kind` (a `hf.PRE_NORM_LAYERS` name)."""
    import transformers

    vl = {"Qwen2VLDecoderLayer": tiny_qwen2_vl, "Qwen2_5_VLDecoderLayer": tiny_qwen2_5_vl,
          "Qwen3VLTextDecoderLayer": tiny_qwen3_vl}  # fmt: skip
    if kind in vl:
        lm = vl[kind]()[0].model.language_model
    elif kind == "Qwen3VLMoeTextDecoderLayer":
        from vtoken.zoo import tiny_qwen3_vl_moe

        lm = tiny_qwen3_vl_moe()[0].model.language_model
    else:
        widths = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
        if kind == "Qwen3MoeDecoderLayer":
            widths.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
        name = kind.removesuffix("DecoderLayer")
        torch.manual_seed(0)
        lm = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**widths)).model
    layer = lm.layers[0]
    assert type(layer).__name__ == kind
    return layer, lm.eval()


@pytest.mark.parametrize("kind", sorted(hf.PRE_NORM_LAYERS))
def test_pre_norm_layers_split_at_their_residual(kind):
    """A mid-layer call point (FrameFusion) runs a decoder layer as two halves: attention + residual, then the
    post-attention norm + MLP + residual. For every class vtoken splits, the halves equal the stock forward, bit for
    bit, with the keywords the LLM passes (mask, positions, rotary tables, cache)."""
    layer, lm = _text_layer(kind)
    hidden = torch.randn(2, 7, layer.self_attn.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).expand(2, -1)
    rope = positions[None].expand(3, -1, -1) if "VL" in kind else positions
    kwargs = dict(attention_mask=None, position_ids=positions, position_embeddings=lm.rotary_emb(hidden, rope),
                  use_cache=True)  # fmt: skip
    with torch.no_grad():
        whole = layer(hidden, **kwargs, **hf.cache_kwargs(DynamicCache(config=lm.config)))
        split = hf.split_mlp(layer, hf.split_attention(layer, hidden, **kwargs,
                                                       **hf.cache_kwargs(DynamicCache(config=lm.config))))  # fmt: skip
    whole = whole[0] if isinstance(whole, tuple) else whole
    assert hf.splits_at_residual(layer) and torch.equal(whole, split), broken(
        f"{kind}.forward should be hidden + self_attn(input_layernorm(hidden)), then + mlp(post_attention_layernorm(.))"
    )
