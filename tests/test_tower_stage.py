"""The tower stage through `vtoken.patch` (issue 41, METHODS-4-tower.md): ToMe merging inside LLaVA's CLIP tower
and PixelPrune dropping units before the tower, on the unpatched model's inputs. Against independent references:
the unpatched model (keep-all identity), the bare language model fed by hand the tower's kept or merged tokens at
the positions the spec says (ToMe and PixelPrune on LLaVA: renumbered; PixelPrune on Qwen: the original M-RoPE
positions with the dropped groups deleted, decoding after the full prompt's largest position), a padded batch
against its rows alone, the records (composed with an encoder method), the refusals at `patch` (the model left
intact) and at a call's start, and what a patched forward adds on a GPU's host (counted on CPU)."""

import copy

import numpy as np
import pytest
import torch
from conftest import assert_batch_equals_one_by_one, assert_greedy_matches, assert_identity, feed_language_model, greedy
from PIL import Image

import vtoken
from vtoken.adapters import hf
from vtoken.adapters.tower import KeptPatches, ToMeTower, qwen_pruned_tower, tower_shape
from vtoken.applicability import fitting_params
from vtoken.errors import InputError, MissingSignalError, VTokenError
from vtoken.launches import count_launches
from vtoken.zoo import TINY_MODELS, build_prompt


def page(width: int = 300, height: int = 220, seed: int = 0) -> Image.Image:
    """A document-like image: white paper, dark text-like bars, a coloured block and a noisy stamp (unique pixels),
    so that PixelPrune drops the flat regions and keeps the rest."""
    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 3), 255, dtype=np.uint8)
    for row in range(30, height - 60, 28):
        pixels[row : row + 9, 20 : width - 40 - 10 * (row % 3)] = 20
    pixels[height - 50 : height - 20, 30:110] = (200, 40, 30)
    pixels[20:60, width - 70 : width - 20] = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def qwen25():
    return TINY_MODELS["tiny-qwen2.5-vl"]()


def qwen_inputs(processor, images, questions=None):
    questions = questions or ["what does the page say?"] * len(images)
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}], add_generation_prompt=True
        )
        for q in questions
    ]
    return processor(images=images, text=prompts, return_tensors="pt", padding=True)


def llava_inputs(processor, image):
    return processor(images=[image], text=[build_prompt(processor, "what does the page say?")], return_tensors="pt")


def untouched(model) -> dict:
    """What a refused `patch` must leave as it was: parameters, hooks and instance attributes of every module."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()],
        "forwards": [n for n, m in model.named_modules() if "forward" in m.__dict__],
        "generate": "generate" in model.__dict__,
    }


def assert_untouched(model, before: dict) -> None:
    after = untouched(model)
    assert vtoken.handle_of(model) is None
    assert after["hooks"] == before["hooks"] and after["forwards"] == before["forwards"]
    assert after["generate"] == before["generate"]
    assert all(torch.equal(v, after["state"][k]) for k, v in before["state"].items())


# ----------------------------------------------------------------- identity (invariant 1)
@pytest.mark.parametrize(
    "family, method",
    [("tiny-llava", vtoken.ToMe(r=0)), ("tiny-llava", vtoken.PixelPrune(threshold=-1.0)),
     ("tiny-qwen2.5-vl", vtoken.PixelPrune(threshold=-1.0)), ("tiny-qwen3-vl", vtoken.PixelPrune(threshold=-1.0))],
)  # fmt: skip
def test_keeping_everything_is_the_unpatched_model(family, method, llava, qwen25):
    model, processor = {"tiny-llava": llava, "tiny-qwen2.5-vl": qwen25}.get(family) or TINY_MODELS[family]()
    inputs = llava_inputs(processor, page()) if family == "tiny-llava" else qwen_inputs(processor, [page()])
    assert_identity(model, method, inputs)


# ----------------------------------------------------------------- equivalence (invariant 2)
def test_tome_is_the_llm_fed_the_merged_tokens_renumbered(llava):
    model, processor = llava
    inputs = llava_inputs(processor, page())
    method = vtoken.ToMe(r=5)
    tower = copy.deepcopy(model.model.vision_tower)  # the model side on its own (tests/test_tome.py checks it)
    shape = tower_shape(model, "llava-1.5")
    merging = ToMeTower(method, tower.encoder.layers, shape, hf.attention_implementation(tower))
    merging.install()
    with torch.no_grad():
        (states,) = hf.hidden_states(tower, [model.config.vision_feature_layer], inputs["pixel_values"])
        visual = model.model.multi_modal_projector(states[:, 1:])[0]
        reference = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
        with vtoken.patched(model, method) as handle:
            logits = model(**inputs).logits
    (record,) = handle.records
    assert (record.stage, record.tokens_in, record.tokens_out) == ("tower", 576, visual.shape[0])
    assert record.extra["r"] == merging.last().done and record.kept is None
    assert torch.equal(record.extra["sources"], merging.last().patch_sources()[0])
    assert logits.shape == reference.shape and (logits - reference).abs().max() <= 1e-5


def test_pixelprune_on_llava_is_the_llm_fed_the_kept_patches(llava):
    model, processor = llava
    inputs = llava_inputs(processor, page())
    tower = model.model.vision_tower
    shape = tower_shape(model, "llava-1.5")
    selected = vtoken.PixelPrune().select_input(inputs["pixel_values"], [(24, 24)], shape)
    assert 0 < selected.counts[0] < 576
    with torch.no_grad():
        with KeptPatches(tower.encoder, selected, True, "sdpa", "cpu"):
            (states,) = hf.hidden_states(tower, [model.config.vision_feature_layer], inputs["pixel_values"])
        visual = model.model.multi_modal_projector(states[:, 1:])[0]
        reference = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
        with vtoken.patched(model, "pixelprune") as handle:
            logits = model(**inputs).logits
    (record,) = handle.records
    assert record.tokens_out == selected.counts[0] and torch.equal(record.kept, torch.from_numpy(selected.kept))
    assert (logits - reference).abs().max() <= 1e-5


def qwen_reference(model, inputs, kept: list[torch.Tensor], embeds: torch.Tensor, steps: int):
    """The bare language model fed `embeds` [K, D] at the kept placeholders (`kept`: per image its ascending kept
    offsets in its run) of row 0, at the ORIGINAL M-RoPE positions of the unpruned prompt (the text row contiguous),
    decoding after the full prompt's largest position: (prefill logits, greedy ids, per-step logits)."""
    inner = model.model
    ids = inputs["input_ids"]
    rope, _ = inner.get_rope_index(ids, mm_token_type_ids=inputs["mm_token_type_ids"],
                                   image_grid_thw=inputs["image_grid_thw"])  # fmt: skip
    placeholders = (ids[0] == model.config.image_token_id).nonzero().squeeze(1)
    runs = placeholders.split([int(t * h * w) // 4 for t, h, w in inputs["image_grid_thw"].tolist()])
    keep = torch.ones_like(ids[0], dtype=torch.bool)
    keep[placeholders] = False
    for run, offsets in zip(runs, kept, strict=True):
        keep[run[offsets]] = True
    columns = keep.nonzero().squeeze(1)
    short, positions = ids[:, columns], rope[:, :, columns]
    following = int(rope.max()) + 1  # the full prompt's: dropped groups do not move decoding
    with torch.no_grad():
        hidden = model.get_input_embeddings()(short)
        hidden[short == model.config.image_token_id] = embeds
        text = torch.arange(short.shape[1])[None, None]
        out = inner.language_model(inputs_embeds=hidden, position_ids=torch.cat([text, positions]), use_cache=True)
        logits = model.lm_head(out.last_hidden_state)
        cache, step_logits, tokens = hf.cache_out(out), [logits[:, -1]], []
        token = logits[:, -1].argmax(-1, keepdim=True)
        for step in range(steps):
            tokens.append(token)
            if step == steps - 1:
                break
            where = torch.cat([torch.full((1, 1, 1), short.shape[1] + step), torch.full((3, 1, 1), following + step)])
            out = inner.language_model(inputs_embeds=model.get_input_embeddings()(token), position_ids=where,
                                       use_cache=True, **hf.cache_kwargs(cache))  # fmt: skip
            step_logits.append(model.lm_head(out.last_hidden_state)[:, -1])
            token = step_logits[-1].argmax(-1, keepdim=True)
    return logits, torch.cat(tokens, dim=1), torch.stack(step_logits)


def test_pixelprune_on_qwen_keeps_the_original_positions_with_holes_deleted(qwen25):
    model, processor = qwen25
    inputs = qwen_inputs(processor, [page()])
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    selected = vtoken.PixelPrune().select_input(inputs["pixel_values"], grids, tower_shape(model, "qwen2.5-vl"))
    units = grids[0][1] * grids[0][2] // 4
    assert 0 < selected.counts[0] < units and selected.kept[-1] < units - 1  # the last groups (white) dropped
    with torch.no_grad():
        embeds = qwen_pruned_tower(model.model.visual, inputs["pixel_values"], grids, selected).pooler_output
        with vtoken.patched(model, "pixelprune") as handle:
            logits = model(**inputs).logits
            generated = greedy(model, inputs, 5)
    kept = [torch.from_numpy(selected.kept_of(0))]
    ref_logits, *ref_greedy = qwen_reference(model, inputs, kept, embeds, steps=5)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)
    (record,) = handle.records
    assert (record.stage, record.tokens_in, record.tokens_out) == ("tower", units, selected.counts[0])
    assert torch.equal(record.kept, kept[0]) and record.extra["patches_out"] == 4 * selected.counts[0]


# ----------------------------------------------------------------- batches (invariant 5)
def test_a_padded_batch_is_its_rows_alone(qwen25):
    model, processor = qwen25
    images = [page(300, 220, 0), page(180, 260, 1)]
    questions = ["what does the page say?", "read it"]
    batched = qwen_inputs(processor, images, questions)
    singles = [qwen_inputs(processor, [image], [q]) for image, q in zip(images, questions, strict=True)]
    with torch.no_grad(), vtoken.patched(model, "pixelprune") as handle:
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=4)
        model(**batched)
        counts = [r.tokens_out for r in handle.records]
    assert len(set(counts)) == 2  # the rows keep different numbers: the batch is re-padded


# ----------------------------------------------------------------- records and composition
def test_records_compose_with_an_encoder_method(llava, qwen25):
    model, processor = qwen25
    inputs = qwen_inputs(processor, [page()])
    with torch.no_grad(), vtoken.patched(model, ["pixelprune", vtoken.Random(budget=0.5)]) as handle:
        model(**inputs)
    tower, encoder = handle.records
    assert (tower.stage, encoder.stage) == ("tower", "encoder")
    assert encoder.tokens_in == tower.tokens_out and encoder.tokens_out == (tower.tokens_out + 1) // 2
    # the encoder chose among the tower's kept groups, on the image's grid: final kept = tower.kept[j]
    position = torch.searchsorted(tower.kept, encoder.kept)
    assert torch.equal(tower.kept[position], encoder.kept)

    model, processor = llava
    inputs = llava_inputs(processor, page())
    with torch.no_grad(), vtoken.patched(model, [vtoken.ToMe(r=4), vtoken.Random(budget=0.5)]) as handle:
        model(**inputs)
    tower, encoder = handle.records
    assert encoder.tokens_in == tower.tokens_out == 576 - sum(tower.extra["r"])
    assert encoder.kept.max() < tower.tokens_out and tower.extra["sources"].max() == tower.tokens_out - 1


def test_composes_with_an_encoder_and_an_llm_stage(deep_llava):
    model, processor = deep_llava
    inputs = llava_inputs(processor, page())
    methods = [vtoken.PixelPrune(), vtoken.FasterVLM(budget=0.5), vtoken.FastV(layer=2, keep=0.5)]
    with torch.no_grad(), vtoken.patched(model, methods) as handle:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    stages = [r.stage for r in handle.records]
    assert stages[:2] == ["tower", "encoder"] and "prefill.layer2" in stages
    tower, encoder = handle.records[:2]
    assert encoder.tokens_in == tower.tokens_out and set(encoder.kept.tolist()) <= set(tower.kept.tolist())
    prefill = next(r for r in handle.records if r.stage == "prefill.layer2")
    assert prefill.tokens_in == encoder.tokens_out and out.shape[1] == inputs["input_ids"].shape[1] + 3


# ----------------------------------------------------------------- refusals (invariant 8)
def test_refusals_at_patch_leave_the_model_intact(llava, qwen25):
    model, _ = qwen25
    before = untouched(model)
    with pytest.raises(VTokenError, match="pixelprune"):
        vtoken.patch(model, "tome")
    with pytest.raises(VTokenError, match="all act at the tower stage"):
        vtoken.patch(model, [vtoken.PixelPrune(), vtoken.PixelPrune(threshold=0.1)])
    with pytest.raises(MissingSignalError, match="after pixelprune"):  # a grid method: holes are no rectangle
        vtoken.patch(model, ["pixelprune", "pool"])
    assert_untouched(model, before)

    model, _ = llava
    before = untouched(model)
    with pytest.raises(VTokenError, match="merges tokens inside the vision tower"):
        vtoken.patch(model, ["tome", vtoken.make_method("mustdrop", **fitting_params(model, "mustdrop"))])
    with pytest.raises(MissingSignalError, match="cls_attention.*after tome"):
        vtoken.patch(model, ["tome", "fastervlm"])
    config = model.config
    layer, config.vision_feature_layer = config.vision_feature_layer, [-2, -1]
    try:
        with pytest.raises(VTokenError, match="one feature layer"):
            vtoken.patch(model, "tome")
    finally:
        config.vision_feature_layer = layer
    assert_untouched(model, before)

    next_model, _ = TINY_MODELS["tiny-llava-next"]()
    with pytest.raises(VTokenError, match="layout='official'"):
        vtoken.patch(next_model, "tome")
    vtoken.patch(next_model, "tome", layout="official").unpatch()
    flash = copy.deepcopy(llava[0])
    flash.model.vision_tower.config._attn_implementation = "flash_attention_2"  # (only read, never run here)
    with pytest.raises(VTokenError, match="'sdpa' or 'eager'"):
        vtoken.patch(flash, "pixelprune")
    with pytest.raises(VTokenError, match="prop_attn=False"):
        vtoken.patch(flash, "tome")
    vtoken.patch(flash, vtoken.ToMe(prop_attn=False, weighted=False)).unpatch()  # LightCompress's: any attention
    onevision, _ = TINY_MODELS["tiny-onevision"]()
    with pytest.raises(VTokenError, match="native layout stitches.*layout='official'"):  # (test_llava_onevision.py)
        vtoken.patch(onevision, "pixelprune")
    vtoken.patch(onevision, "pixelprune", layout="official").unpatch()


def test_refusals_when_a_call_starts(llava, qwen25):
    from vtoken.images import example_clip

    model, processor = qwen25
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]}],
        add_generation_prompt=True,
    )
    video = processor(videos=[example_clip(4)], text=[prompt], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, "pixelprune"):
        with pytest.raises(InputError, match="image inputs only.*videos"):
            model(**video)
    model, processor = llava
    with torch.no_grad(), vtoken.patched(model, "tome"):
        with pytest.raises(InputError, match="vision_feature_layer=-1"):
            model(**llava_inputs(processor, page()), vision_feature_layer=-1)


def test_unpatch_puts_the_tower_back(llava):
    model, processor = llava
    inputs = llava_inputs(processor, page())
    with torch.no_grad():
        reference = model(**inputs).logits  # (transformers installs its hidden-state capture on a first call)
        before = untouched(model)
        vtoken.patch(model, vtoken.ToMe(r=8))
        assert all("forward" in layer.__dict__ for layer in model.model.vision_tower.encoder.layers)
        merged = model(**inputs).logits
        twin = copy.deepcopy(model)  # patched on its own: its blocks merge with its own weights
        assert torch.equal(twin(**inputs).logits, merged)
        vtoken.unpatch(twin)
        assert torch.equal(twin(**inputs).logits, reference) and torch.equal(model(**inputs).logits, merged)
        vtoken.unpatch(model)
        assert torch.equal(model(**inputs).logits, reference)
    assert_untouched(model, before)


# ----------------------------------------------------------------- a GPU's host (invariant 10)
def _added(model, inputs, method) -> tuple[int, int]:
    """(kernels, syncs) a patched forward adds to the unpatched one."""
    with torch.no_grad():
        model(**inputs)
        with count_launches(sites=False) as plain:
            model(**inputs)
        with vtoken.patched(model, method):
            model(**inputs)
            with count_launches() as patched:
                model(**inputs)
    return patched.kernels - plain.kernels, patched.syncs - plain.syncs


def test_no_sync_beyond_pixelprunes_one_read(llava, qwen25):
    model, processor = llava
    inputs = llava_inputs(processor, page())
    merging = [_added(model, inputs, vtoken.ToMe(r=r)) for r in (3, 6)]
    assert [syncs for _, syncs in merging] == [0, 0]
    assert merging[0][0] == merging[1][0]  # the same burst whatever r: shapes from the host
    _, syncs = _added(model, inputs, vtoken.PixelPrune())
    assert syncs <= 1  # the kept mask, read before the tower (none at all where the pixels are on the CPU)
    model, processor = qwen25
    _, syncs = _added(model, qwen_inputs(processor, [page()]), vtoken.PixelPrune())
    assert syncs <= 1


# ----------------------------------------------------------------- the tools
def test_the_tools_know_the_tower_stage(llava, qwen25, capsys):
    from vtoken.applicability import applicable_methods
    from vtoken.cli import main
    from vtoken.eval.sweep import settings

    verdicts = applicable_methods(llava[0])
    assert verdicts["tome"] is None and verdicts["pixelprune"] is None
    assert "pixelprune" in applicable_methods(qwen25[0])["tome"]
    # eval: ToMe's budget replaces r at every budget; PixelPrune has none (the pixels decide): it runs once
    points = [(p.method, p.budget, p.params) for p in settings(["tome", "pixelprune+random"], [0.5, 0.25], {})]
    assert points[1:] == [("tome", 0.5, {"tome.budget": 0.5}), ("tome", 0.25, {"tome.budget": 0.25}),
                          ("pixelprune+random", 0.5, {"random.budget": 0.5}),
                          ("pixelprune+random", 0.25, {"random.budget": 0.25})]  # fmt: skip
    run = ["run", "--repeats", "1", "--max-new-tokens", "1"]
    assert main([*run, "--model", "tiny-llava", "--method", "tome"]) == 0
    out = capsys.readouterr().out
    assert "method:  tome(r=16" in out and "576 -> " in out  # r=16: ToMe's own, no common budget without --budget
    assert main([*run, "--model", "tiny-qwen2.5-vl", "--method", "pixelprune"]) == 0
    assert "kept tokens (16x16 grid" in capsys.readouterr().out  # the tower's kept groups drawn


def test_the_vllm_plugin_serves_tower_methods_where_its_tower_takes_them():
    """PixelPrune on vLLM's Qwen2.5-VL / Qwen3-VL towers and ToMe on LLaVA-1.5's are served (a tower method alone:
    every token it leaves reaches the LLM); elsewhere, and composed with an encoder method, refused naming why
    (tests/test_vllm.py runs them in vLLM)."""
    from vtoken.serving.vllm import ServingConfigError, parse
    from vtoken.serving.vllm.tower import check

    for family, method in (("qwen2.5-vl", "pixelprune"), ("qwen3-vl", "pixelprune"), ("llava-1.5", "tome")):
        config = parse({"method": method})
        assert config.tower.name == method and config.name == method and config.method.name == "keep_all"
        check(config, family)
    refused = {
        ("llava-1.5", "pixelprune"): "MMEncoderAttention.*mask",
        ("llava-next", "pixelprune"): "MMEncoderAttention",
        ("llava-next", "tome"): "flat layout.*served on LLaVA-1.5",
        ("llava-onevision", "tome"): "flat layout.*does not serve LLaVA-OneVision",
        ("llava-onevision", "pixelprune"): "flat layout.*does not serve LLaVA-OneVision",
        ("qwen2.5-vl", "tome"): "2x2.*pixelprune",
        ("qwen3-vl", "tome"): "2x2.*pixelprune",
    }
    for (family, method), why in refused.items():
        with pytest.raises(ServingConfigError, match=f"vtoken.*{method}.*{why}"):
            check(parse({"method": method}), family)
    with pytest.raises(ServingConfigError, match="pixelprune.*alone.*vtoken.patch on transformers"):
        parse({"method": ["pixelprune", "random"]})
    with pytest.raises(ServingConfigError, match="at most one per stage"):
        parse({"method": ["pixelprune", "tome"]})
