"""LLaVA-1.5 with fastervlm, random and pool on the tiny offline model: equivalence with the language model fed by
hand, exact budgets for every image size, beams and sampling, rows with different numbers of images, manual decoding
loops, positional arguments (the identity, batch and restore invariants are tests/test_contract.py's rows)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import inputs_for, make_image

import vtoken
from vtoken.adapters import hf
from vtoken.zoo import build_prompt

METHODS = ["fastervlm", "random", "pool"]
N = 576


@pytest.fixture
def batch(llava, photos):
    """Two prompts of different lengths (left padding) with two real photos."""
    return inputs_for(
        llava[1],
        [photos["astronaut"], photos["coffee"]],
        ["what is in the image?", "describe the image in detail. how many shapes are there?"],
    )


def _llm_embeddings(model, inputs, image_embeds_per_image, budget_k):
    """Hand-built reference: prompt with k placeholders per image, embeddings filled in, contiguous positions."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    rows = []
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        row = ids[r][keep]
        ph = (row == model.config.image_token_id).nonzero().squeeze(1)
        row = torch.cat([row[: ph[0] + budget_k], row[ph[-1] + 1 :]])
        rows.append(row)
    width = max(len(r) for r in rows)
    new_ids = torch.stack([F.pad(r, (width - len(r), 0), value=0) for r in rows])
    new_mask = torch.stack([F.pad(torch.ones_like(r), (width - len(r), 0), value=0) for r in rows])
    embeds = model.get_input_embeddings()(new_ids)
    placeholder = new_ids == model.config.image_token_id
    embeds[placeholder] = torch.cat(image_embeds_per_image)
    positions = (new_mask.cumsum(1) - 1).clamp(min=0)
    return embeds, new_mask, positions


@pytest.mark.parametrize("method", METHODS)
def test_pruned_run_equals_language_model_fed_by_hand(llava, batch, method):
    model, _ = llava
    k = 144
    with torch.no_grad(), vtoken.patched(model, method, budget=k) as handle:
        logits = model(**batch).logits
        records = handle.records
    assert [r.tokens_out for r in records] == [k, k]

    # independent reference: vision tower -> layer -2 patch tokens -> method's choice -> projector
    with torch.no_grad():
        hidden = model.model.vision_tower(batch["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        if method == "pool":  # 144 = 12 x 12: plain adaptive average pooling of the 24 x 24 grid
            grid = hidden.view(2, 24, 24, -1).permute(0, 3, 1, 2)
            chosen = F.adaptive_avg_pool2d(grid, 12).flatten(2).transpose(1, 2)
            assert all(r.kept is None for r in records)
        else:
            chosen = torch.stack([hidden[i, r.kept] for i, r in enumerate(records)])
        image_embeds = list(model.model.multi_modal_projector(chosen))
        embeds, mask, positions = _llm_embeddings(model, batch, image_embeds, k)
        out = model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions)
        ref_logits = model.lm_head(out.last_hidden_state)
    assert logits.shape == ref_logits.shape
    valid = mask.bool()
    assert (logits[valid] - ref_logits[valid]).abs().max() <= 1e-5


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget, k", [(0.5, 288), (0.25, 144), (0.1, 58), (0.05, 29), (7, 7)])
def test_exact_budget_for_every_image_size(llava, method, budget, k):
    model, processor = llava
    sizes = [(20, 20), (336, 336), (640, 120), (90, 700), (1000, 750)]
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
            for i, (w, h) in enumerate(sizes):
                inputs = inputs_for(processor, [make_image(w, h, seed=i)], ["what is in the image?"])
                model(**inputs)
                assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(N, k)]
                assert seen[-1] == inputs["input_ids"].shape[1] - (N - k)
                if handle.records[0].kept is not None:
                    kept = handle.records[0].kept
                    assert len(kept) == k and torch.equal(kept, kept.sort().values) and kept.unique().numel() == k
    finally:
        hook.remove()


def test_count_budget_at_least_n_keeps_everything(llava, batch):
    model, _ = llava
    with torch.no_grad():
        ref = model.generate(**batch, max_new_tokens=4, do_sample=False)
        with vtoken.patched(model, "fastervlm", budget=10_000) as handle:
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
            assert all(r.tokens_out == r.tokens_in == N for r in handle.records)
            assert all(torch.equal(r.kept, torch.arange(N)) for r in handle.records)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("method", METHODS)
def test_beams_and_return_sequences(llava, batch, method):
    model, _ = llava
    with torch.no_grad():
        ref = model.generate(**batch, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
        with vtoken.patched(model, method, budget=1.0):  # beams at full budget: identical to the stock model
            full = model.generate(**batch, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
        with vtoken.patched(model, method, budget=0.25) as handle:
            out = model.generate(
                **batch,
                max_new_tokens=5,
                num_beams=3,
                num_return_sequences=2,
                do_sample=False,
                return_dict_in_generate=True,
            )
            assert len(handle.records) == 2  # one per image, not per beam
            sampled = model.generate(**batch, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    assert torch.equal(full, ref)
    prompt = batch["input_ids"].repeat_interleave(2, dim=0)
    assert out.sequences.shape[0] == 4 and torch.equal(out.sequences[:, : prompt.shape[1]], prompt)
    assert sampled.shape[0] == 6
    assert torch.equal(sampled[:, : prompt.shape[1]], batch["input_ids"].repeat_interleave(3, dim=0))


def test_max_length_counts_the_callers_prompt(llava, batch):
    model, _ = llava
    width = batch["input_ids"].shape[1]
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.1):
        out = model.generate(**batch, max_length=width + 4, do_sample=False)
    assert out.shape[1] == width + 4


def test_text_only_calls_pass_through_and_clear_records(llava, batch):
    model, processor = llava
    text = processor.tokenizer(["what is in the image?"], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**text, max_new_tokens=4, do_sample=False)
        with vtoken.patched(model, "fastervlm", budget=0.25) as handle:
            model(**batch)
            assert len(handle.records) == 2
            out = model.generate(**text, max_new_tokens=4, do_sample=False)
            assert handle.records == []
    assert torch.equal(out, ref)


def test_positional_arguments_and_dtype_bf16(llava, batch):
    model, _ = llava
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.25) as handle:
        logits = model(batch["input_ids"], batch["pixel_values"], batch["attention_mask"]).logits
        assert logits.shape[1] == batch["input_ids"].shape[1] - (N - 144)
        out = model.generate(
            batch["input_ids"],
            pixel_values=batch["pixel_values"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=3,
            do_sample=False,
        )
        assert out.shape == (2, batch["input_ids"].shape[1] + 3) and len(handle.records) == 2


def test_wrong_pixel_shape_is_named(llava, batch):
    model, _ = llava
    bad = dict(batch, pixel_values=batch["pixel_values"][:, :, :100, :100])
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.5):
        with pytest.raises(vtoken.InputError, match=r"\[num_images, 3, H, W\] with H = W = 336"):
            model(**bad)


@pytest.mark.parametrize("explicit_positions", [False, True])
def test_manual_decoding_loop_after_a_pruned_forward(llava, batch, explicit_positions):
    """A hand-written greedy loop with the cache, using the caller's own (unpruned-length) mask, equals generate."""
    model, _ = llava
    steps = 5
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.1) as handle:
        expected = model.generate(**batch, max_new_tokens=steps, do_sample=False)
        mask = batch["attention_mask"]
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        kwargs = {"position_ids": positions} if explicit_positions else {}
        out = model(**batch, use_cache=True, **kwargs)
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(steps - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if explicit_positions:
                kwargs = {"position_ids": positions[:, -1:] + len(tokens)}
            cache = hf.cache_kwargs(hf.cache_out(out))
            out = model(input_ids=tokens[-1], attention_mask=mask, **cache, use_cache=True, **kwargs)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        assert len(handle.records) == 2  # decoding steps of the same call keep its records
    assert torch.equal(torch.cat(tokens, dim=1), expected[:, batch["input_ids"].shape[1] :])


@pytest.mark.parametrize("method", METHODS)
def test_rows_with_different_numbers_of_images(llava, photos, method):
    """Two images in one prompt next to one image in another: rows lose different numbers of tokens."""
    model, processor = llava
    two = build_prompt(processor, "compare the two images.", num_images=2)
    one = build_prompt(processor, "what is in the image?")
    images = [photos["astronaut"], photos["rocket"], photos["chelsea"]]
    with torch.no_grad(), vtoken.patched(model, method, budget=0.1) as handle:
        batched = processor(images=images, text=[two, one], return_tensors="pt", padding=True)
        out = model.generate(**batched, max_new_tokens=6, do_sample=False)
        assert [r.tokens_out for r in handle.records] == [58, 58, 58] and [r.image for r in handle.records] == [0, 1, 2]
        width = batched["input_ids"].shape[1]
        for text, imgs, row in [(two, images[:2], 0), (one, images[2:], 1)]:
            single = processor(images=imgs, text=[text], return_tensors="pt")
            ref = model.generate(**single, max_new_tokens=6, do_sample=False)
            assert torch.equal(out[row, width:], ref[0, single["input_ids"].shape[1] :])
