"""Gemma 3: pooled SigLIP tokens per crop (pan-and-scan crops are image blocks of their own), token_type_ids
shrinking with the prompt (bidirectional attention inside each block). Its refusals ([CLS] methods, LLM stages),
batches, beams and restore are tests/test_contract.py's rows."""

import pytest
import torch
from conftest import assert_identity, make_image, shortened_prompt

import vtoken
from vtoken.zoo import build_prompt, tiny_gemma3

# (width, height, pan_and_scan) -> crops the processor makes (the image, then its pan-and-scan crops)
CASES = {(800, 300, False): 1, (900, 300, True): 4, (300, 700, True): 3, (400, 400, True): 1, (50, 20, True): 1}


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


def _image(processor, width, height, pan_and_scan=False, seed=0, question="what?"):
    return processor(
        images=[make_image(width, height, seed)],
        text=[build_prompt(processor, question)],
        return_tensors="pt",
        do_pan_and_scan=pan_and_scan,
    )


def reference_logits(model, inputs, kept_per_crop, bidirectional=True):
    """The Gemma 3 model fed by hand: placeholder runs shortened to exactly the kept embeddings, token_type_ids
    rebuilt from the shortened ids (1 on soft tokens), the model's own masks."""
    token = model.config.image_token_id
    new_ids, embeds = shortened_prompt(model, inputs["input_ids"], token, kept_per_crop)
    types = (new_ids == token).long() if bidirectional else None
    with torch.no_grad():
        hidden = model.model(inputs_embeds=embeds, token_type_ids=types).last_hidden_state
        return model.lm_head(hidden)


def test_identity_single_pan_and_scan_and_multi_image(gemma):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = gemma
    assert_identity(model, method, _image(processor, 900, 300, True), max_new_tokens=3)
    two = processor(
        images=[make_image(800, 300), make_image(300, 300, 1)],
        text=[build_prompt(processor, "compare.", 2)],
        return_tensors="pt",
    )
    assert_identity(model, method, two, max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 20])
def test_exact_budget_per_crop_and_equivalence_with_bidirectional_blocks(gemma, budget):
    model, processor = gemma
    for i, ((width, height, pan_and_scan), crops) in enumerate(CASES.items()):
        inputs = _image(processor, width, height, pan_and_scan, i)
        assert inputs["pixel_values"].shape[0] == crops
        with torch.no_grad(), vtoken.patched(model, "random", budget=budget) as handle:
            logits = model(**inputs).logits
        kept = vtoken.tokens_to_keep(budget, 64)
        assert [(r.image, r.tokens_in, r.tokens_out, r.grid) for r in handle.records] == [
            (c, 64, kept, (8, 8)) for c in range(crops)
        ]
        with torch.no_grad():
            stock = model.model.get_image_features(inputs["pixel_values"]).pooler_output  # [crops, 64, D]
        selected = [stock[r.image, r.kept] for r in handle.records]
        ref = reference_logits(model, inputs, selected)
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, (width, height)
        # the image blocks really are bidirectional: a causal-only reference differs
        assert (logits - reference_logits(model, inputs, selected, bidirectional=False)).abs().max() > 1e-4


def test_generation_after_pruning_matches_the_hand_fed_model(gemma):
    """Greedy tokens of the patched model = greedy decoding of the hand-fed reference (masks and positions of
    the decoding steps included)."""
    model, processor = gemma
    inputs = _image(processor, 900, 300, True)
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        stock = model.model.get_image_features(inputs["pixel_values"]).pooler_output
    selected = [stock[r.image, r.kept] for r in handle.records]
    generated = inputs["input_ids"]
    for _ in range(4):  # no cache: every step recomputes the whole (shortened) prompt
        logits = reference_logits(model, dict(inputs, input_ids=generated), selected)
        generated = torch.cat([generated, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, generated)


def test_cli_refuses_a_video_for_a_model_without_video(tmp_path, capsys):
    from vtoken.cli import main
    from vtoken.images import example_clip

    clip = example_clip(3)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    argv = ["run", "--model", "tiny-gemma3", "--video", str(path), "--repeats", "1", "--max-new-tokens", "1"]
    assert main([*argv, "--method", "pool"]) == 2
    assert "takes no video" in capsys.readouterr().err


def test_checkpoint_round_trip_with_pan_and_scan(gemma, tmp_path, monkeypatch):
    from vtoken.zoo import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = gemma
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load(str(tmp_path))
    assert type(loaded) is type(model)
    inputs = _image(loaded_processor, 900, 300, True)
    assert torch.equal(inputs["input_ids"], _image(processor, 900, 300, True)["input_ids"])
    with torch.no_grad():
        with vtoken.patched(model, "mmtok", budget=0.25):
            expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        with vtoken.patched(loaded, "mmtok", budget=0.25) as handle:
            got = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected) and [r.tokens_out for r in handle.records] == [16] * 4


def test_the_tiny_models_images_reach_the_logits(gemma):
    """Regression (found by test_fuzz): transformers zero-initialises the projector's input projection, so every
    image gave the same soft tokens and no pruning changed the logits. Now which tokens are kept matters."""
    model, processor = gemma
    inputs = _image(processor, 300, 300)
    with torch.no_grad():
        logits = []
        for seed in (0, 1):
            with vtoken.patched(model, vtoken.Random(budget=0.1, seed=seed)):
                logits.append(model(**inputs).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-4
