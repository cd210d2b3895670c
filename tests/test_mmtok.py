"""MMTok (METHODS.md): the question read from the prompt, the coverage matrix, greedy max coverage against brute
force, and the method through `vtoken.patch` on every family."""

import itertools

import pytest
import torch
from conftest import inputs_for

import vtoken
from vtoken.methods.mmtok import coverage_matrix, greedy_max_coverage, keywords
from vtoken.question import question_from_prompt
from vtoken.tokens import TextQuery, VisualTokens

SUFFIX = " Answer the question using a single word or phrase."


@pytest.mark.parametrize(
    "prompt, question",
    [
        ("USER: <image>\nwhat is in the image? ASSISTANT:", "what is in the image?"),
        ("<s> USER: <image><image>\nwhat is in the image? ASSISTANT:", "what is in the image?"),
        ("[INST] <image>\nWhat is shown here? [/INST]", "What is shown here?"),
        (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            "<|image_pad|><|image_pad|><|vision_end|>Count the cats.<|im_end|>\n<|im_start|>assistant\n",
            "Count the cats.",
        ),
        ("USER: <image>\nhi ASSISTANT: hello</s>USER: and the colour? ASSISTANT:", "and the colour?"),  # last turn
        ("<image>\nDescribe it.", "Describe it."),  # no chat template: the whole text
    ],
)
def test_question_from_prompt(prompt, question):
    assert question_from_prompt(prompt, ("<image>", "<s>", "</s>")) == question


def test_keywords_drop_lmms_eval_suffixes_and_stop_words():
    assert keywords("What is the colour of the bus?" + SUFFIX) == "colour of bus"
    assert keywords("Is it red? Answer with the option's letter from the given choices directly.") == "red"
    assert keywords("what is it?") == "what is it?"  # nothing survives: the whole text


def _reference_coverage(z, v, u, valid, tau_tv, tau_vv, alpha):
    """One crop, valid tokens only, straight from the formulas: [T + N', N'] over the valid tokens."""

    def unit(x):
        return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-8)

    v, u = v[valid], u[valid]
    p = torch.softmax(unit(z) @ unit(v).T / tau_tv, dim=-1) / len(z)
    q = torch.softmax(unit(u) @ unit(u).T / tau_vv, dim=-1) / len(u)
    return torch.cat([p, alpha * q])


def test_coverage_matrix_equals_the_formulas_per_crop():
    g = torch.Generator().manual_seed(0)
    v, u = torch.randn(2, 9, 6, generator=g), torch.randn(2, 9, 4, generator=g)
    z = torch.randn(2, 3, 6, generator=g)
    text_mask = torch.tensor([[True, True, True], [True, True, False]])  # crop 1's question has 2 tokens
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, [0, 4]] = False
    ours = coverage_matrix(z, text_mask, v, u, valid, 0.02, 0.2, 0.5)
    for crop in range(2):
        ref = _reference_coverage(z[crop, text_mask[crop]], v[crop], u[crop], valid[crop], 0.02, 0.2, 0.5)
        rows = torch.cat([text_mask[crop], valid[crop]])
        torch.testing.assert_close(ours[crop][rows][:, valid[crop]], ref)
        assert (ours[crop][~rows] == 0).all() and (ours[crop][:, ~valid[crop]] == 0).all()


def _coverage_value(c, chosen):
    return sum(max([0.0] + [c[r][j] for j in chosen]) for r in range(len(c)))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_steps_equal_brute_force_gains(seed):
    g = torch.Generator().manual_seed(seed)
    coverage = torch.rand(3, 6, 8, generator=g) ** 3
    coverage[2, :, 5] = coverage[2, :, 1]  # a tie: the first of equal columns is picked
    excluded = torch.zeros(3, 8, dtype=torch.bool)
    excluded[1, 2] = True
    picks = greedy_max_coverage(coverage, 4, excluded)
    for crop in range(3):
        c, chosen = coverage[crop].tolist(), []
        for step in range(4):
            gains = {
                j: _coverage_value(c, chosen + [j]) - _coverage_value(c, chosen)
                for j in range(8)
                if j not in chosen and not excluded[crop, j]
            }
            best = max(gains.values())
            expected = min(j for j, gain in gains.items() if gain >= best - 1e-6)
            assert picks[crop, step] == expected
            chosen.append(expected)
    # greedy max coverage is within (1 - 1/e) of the best subset
    c = coverage[0].tolist()
    optimum = max(_coverage_value(c, list(s)) for s in itertools.combinations(range(8), 4))
    assert _coverage_value(c, picks[0].tolist()) >= (1 - 1 / 2.718281828) * optimum


def _hand_made(n=6, valid=None, question="red"):
    """VisualTokens whose projected token 4 is the question's only embedding."""
    g = torch.Generator().manual_seed(0)
    projected = torch.randn(1, n, 5, generator=g)
    target = projected[0, 4].clone()
    query = TextQuery([question], "llava-1.5", lambda text: target[None])
    signals = {"projected": projected, "vision_features": torch.randn(1, n, 3, generator=g)}
    return VisualTokens(torch.zeros(1, n, 2), (2, 3), signals, torch.zeros(1, dtype=torch.long), valid, question=query)


def test_text_coverage_alone_picks_the_token_the_question_matches():
    selection = vtoken.MMTok(budget=1, alpha=0.0).select(_hand_made())
    assert selection.kept_of(0).tolist() == [4]


def test_crops_with_fewer_valid_tokens_than_the_budget_keep_them_all():
    valid = torch.tensor([[True, False, True, False, True, False]])
    selection = vtoken.MMTok(budget=5).select(_hand_made(valid=valid))
    assert selection.kept_of(0).tolist() == [0, 2, 4]


def test_query_text_and_temperature_follow_the_family():
    method = vtoken.MMTok()
    assert method.query("What is the bus?" + SUFFIX, "llava-next") == "bus"
    assert method.query("What is the bus?", "qwen2.5-vl") == "Question: What is the bus?"
    assert vtoken.MMTok(text="question").query("a red bus", "llava-1.5") == "Question: a red bus"


def _reference_llava_kept(model, processor, inputs, question, k):
    """Independent LLaVA-1.5 selection: CLIP hidden_states[-2] patches, projector, question keywords embedded
    without BOS, the formulas above, then greedy by brute-force gains."""
    with torch.no_grad():
        hidden = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2]
        u = hidden[0, 1:]
        v = model.model.multi_modal_projector(u)
        ids = processor.tokenizer(keywords(question), add_special_tokens=False, return_tensors="pt").input_ids[0]
        z = model.get_input_embeddings()(ids)
    c = _reference_coverage(z, v, u, torch.ones(len(u), dtype=torch.bool), 0.02, 0.2, 0.5)
    best, chosen = torch.zeros(len(c)), []
    for _ in range(k):
        gains = torch.stack([(c[:, j] - best).clamp(min=0).sum() for j in range(c.shape[1])])
        gains[chosen] = float("-inf")
        chosen.append(int(gains.argmax()))
        best = torch.maximum(best, c[:, chosen[-1]])
    return sorted(chosen)


def test_llava_selection_equals_an_independent_reference(llava, photos):
    model, processor = llava
    question = "what colour is the object?" + SUFFIX
    inputs = inputs_for(processor, [photos["chelsea"]], [question])
    with torch.no_grad(), vtoken.patched(model, "mmtok", budget=29) as handle:
        model(**inputs)
    assert handle.records[0].kept.tolist() == _reference_llava_kept(model, processor, inputs, question, 29)


def test_llava_excludes_the_pad_to_square_border(llava, photos):
    from transformers import LlavaImageProcessor

    from vtoken.zoo import llava_processor

    model, processor = llava
    padded = llava_processor(processor.tokenizer)
    settings = processor.image_processor.to_dict()
    padded.image_processor = LlavaImageProcessor(
        do_pad=True, **{k: settings[k] for k in ("size", "crop_size", "image_mean", "image_std")}
    )
    image = photos["coffee"]  # 600 x 400: 56 pixel rows of padding above and below, 4 patch rows each, but
    # the resize after padding blends the innermost pad row with the photo: 3 patch rows are wholly pad colour
    inputs = inputs_for(padded, [image], ["what?"])
    pixels = inputs["pixel_values"][0]
    assert (pixels[:, : 3 * 14] == pixels[:, :1, :1]).all() and (pixels[:, -3 * 14 :] == pixels[:, :1, :1]).all()
    assert not (pixels[:, 3 * 14 : 4 * 14] == pixels[:, :1, :1]).all()
    with torch.no_grad(), vtoken.patched(model, "mmtok", budget=1.0) as handle:
        model(**inputs)
    assert handle.records[0].kept.tolist() == list(range(3 * 24, 21 * 24))
    with torch.no_grad(), vtoken.patched(model, "mmtok", budget=1.0) as handle:  # center-cropped: no border
        model(**inputs_for(processor, [image], ["what?"]))
    assert handle.records[0].tokens_in == 576


def test_explicit_question_overrides_the_prompt(llava, photos):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["describe the image in detail."])
    with torch.no_grad():
        with vtoken.patched(model, "mmtok", budget=20, question="what colour is the object?") as handle:
            model(**inputs)
            given = handle.records[0].kept
        with vtoken.patched(model, "mmtok", budget=20) as handle:
            model(**inputs_for(processor, [photos["astronaut"]], ["what colour is the object?"]))
    assert torch.equal(given, handle.records[0].kept)
    with vtoken.patched(model, "mmtok", question=["a", "b"]), pytest.raises(vtoken.InputError, match="2 questions"):
        model(**inputs)


def test_a_model_without_a_known_tokenizer_fails_at_patch_time(llava):
    from transformers import LlavaForConditionalGeneration

    bare = LlavaForConditionalGeneration(llava[0].config)
    with pytest.raises(vtoken.VTokenError, match="needs the model's tokenizer.*remember_tokenizer"):
        vtoken.patch(bare, "mmtok")
    assert vtoken.handle_of(bare) is None
    with pytest.raises(vtoken.VTokenError, match="text='words'"):
        vtoken.MMTok(text="words")
