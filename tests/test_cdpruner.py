"""CDPruner (METHODS-3-images.md): the conditional DPP against a plain-loop reference written from the spec (the
relevance min-maxed per image over its crops, theta, past the rank of the similarity matrix), a hand-made set whose
answer is known, the CLIP checkpoint as an object and as a directory (a tiny CLIP built here), the method through
`vtoken.patch` on LLaVA-1.5 and LLaVA-NeXT against the bare language model fed by hand, the refusals, and the
launch counts of a selection."""

import math
from dataclasses import dataclass

import pytest
import torch
from conftest import (
    assert_batch_equals_one_by_one,
    assert_identity,
    captured_llm_input,
    feed_language_model,
    inputs_for,
    make_image,
    mask_outside_unpadded,
)

import vtoken
from vtoken.launches import count_launches
from vtoken.methods.cdpruner import EXHAUSTED, clean_question
from vtoken.tokens import TextQuery, VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt, tiny_clip

QUESTION = "what is in the image?"
WIDE = 256  # an LLM width above the official budgets: the similarity's rank (at most the width) is not reached


def wide(builder):
    """`builder`'s tiny model with a 256-wide LLM: its projected tokens have more room than the stock 64 (whose
    greedy gains fall within rounding of the stop rule near pick 55), so more of the official budgets' picks are
    decided clear of rounding and checked exactly."""
    model, processor = builder()
    config = model.config
    config.text_config.hidden_size, config.text_config.intermediate_size = WIDE, 2 * WIDE
    torch.manual_seed(0)
    model = type(model)(config).eval()
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    vtoken.remember_tokenizer(model, processor)
    return model, processor


@pytest.fixture(scope="module")
def wide_llava():
    return wide(TINY_MODELS["tiny-llava"])


@pytest.fixture(scope="module")
def wide_next():
    return wide(TINY_MODELS["tiny-llava-next"])


# Decisions within rounding of a tie: fp32 (the method) and fp64 (the reference) may take them either way (on the
# wide tiny LLaVA at 192 they part at pick 140, where the two best gains are 1.3e-7 apart). Gains are compared with
# this margin (relative to the crop's largest diagonal entry of L), relevances with RELEVANCE_MARGIN.
MARGIN = 2e-6
RELEVANCE_MARGIN = 1e-6


@dataclass
class Reference:
    """Per crop: `kept` (the spec's answer in fp64, ascending), `sure` (the picks no rounding can change) and
    `exact` (every decision was clear of rounding: `kept` is the only right answer)."""

    kept: list[list[int]]
    sure: list[set[int]]
    exact: list[bool]

    def check(self, got: list[list[int]], counts: list[int]) -> None:
        """`got` (the method's kept, per crop) is the answer where every decision was clear, and otherwise holds
        the sure picks, with exactly the budget of distinct tokens."""
        for c, kept in enumerate(got):
            assert len(kept) == len(set(kept)) == counts[c] and kept == sorted(kept), (c, kept)
            if self.exact[c]:
                assert kept == self.kept[c], c
            else:
                assert self.sure[c] <= set(kept), (c, sorted(self.sure[c] - set(kept)))


def reference(projected, embeds, text, counts, theta=None, valid=None) -> Reference:
    """One image, plain loops straight from the spec in fp64: projected [C, N, D] tokens, image embeds [C, N, E],
    text embeds [M, E], the budget of every crop."""
    crops, n = projected.shape[:2]
    valid = torch.ones(crops, n, dtype=torch.bool) if valid is None else valid
    g = embeds.double() / embeds.double().norm(dim=-1, keepdim=True)
    t = text.double() / text.double().norm(dim=-1, keepdim=True)
    raw = -(g @ t.T).mean(-1)  # the mean over the text rows of -cos
    low, high = raw[valid].min(), raw[valid].max()  # one min-max over the image's crops
    r = (raw - low + 1e-6) / (high - low) if high > low else torch.ones_like(raw)
    q = r if theta is None else torch.exp(theta / (2 * (1 - theta)) * r)
    out = Reference([], [], [])
    for c in range(crops):
        candidates = [j for j in range(n) if valid[c, j]]
        unit = projected[c].double() / projected[c].double().norm(dim=-1, keepdim=True)
        kernel = q[c][:, None] * (unit @ unit.T) * q[c][None, :]
        diagonal = kernel.diagonal().tolist()
        tol = MARGIN * max([diagonal[j] for j in candidates], default=0.0)
        gains = {j: diagonal[j] for j in candidates}
        rows, picks, sure, clear = [], [], set(), True
        while len(picks) < counts[c]:
            rest = [j for j in candidates if j not in picks]
            # a gain within rounding of zero (relative to the token's diagonal entry) adds nothing
            adding = [j for j in rest if gains[j] > EXHAUSTED * diagonal[j]]
            maybe = sorted((j for j in rest if gains[j] > EXHAUSTED * diagonal[j] - tol), key=lambda k: (-gains[k], k))
            if not adding:  # past the rank: fill by relevance
                clear = clear and not maybe
                break
            j = max(adding, key=lambda k: (gains[k], -k))  # the first index on ties
            near = maybe[0] != j or gains[j] <= EXHAUSTED * diagonal[j] + tol
            near = near or (len(maybe) > 1 and gains[maybe[0]] - gains[maybe[1]] <= tol)
            clear = clear and not near
            if clear:
                sure.add(j)
            e = kernel[j].clone()
            for row in rows:
                e -= row[j] * row
            e /= math.sqrt(gains[j])
            rows.append(e)
            for k in gains:
                gains[k] -= float(e[k]) ** 2
            picks.append(j)
        rest = sorted((k for k in candidates if k not in picks), key=lambda k: (-float(r[c, k]), k))
        need = counts[c] - len(picks)
        if clear and 0 < need < len(rest):  # the cut between kept and dropped by relevance
            clear = float(r[c, rest[need - 1]] - r[c, rest[need]]) > RELEVANCE_MARGIN
        if clear:
            sure |= set(rest[:need])
        out.kept.append(sorted(picks + rest[:need]))
        out.sure.append(sure)
        out.exact.append(clear)
    return out


def _tokens(projected, text, image=None, valid=None, clip_features=None, question=QUESTION):
    """VisualTokens for `select`: the relevance from `text` [M, E] ("llm" embeds the question as `text`)."""
    crops = projected.shape[0]
    image = torch.zeros(crops, dtype=torch.long) if image is None else image
    questions = [question] * (int(image.max()) + 1)
    signals = {"projected": projected}
    if clip_features is not None:
        signals["clip_features"] = clip_features
    return VisualTokens(projected, (1, projected.shape[1]), signals, image, valid,
                        question=TextQuery(questions, "llava-1.5", lambda s: text))  # fmt: skip


def test_a_hand_made_set_whose_answer_is_known():
    """Tokens 0 and 1 are duplicates, 2 and 3 at right angles to them and to each other. The relevance (negated
    cosine to the question, as the official) favours 0 and 1: r = 1 + 1e-6 against 1e-6 for 2 and 3. The first
    pick is 0 (the first on its tie with 1); its duplicate 1 then adds nothing, so 2 and 3 follow, however little
    relevant, and only past the rank (3) does 1 come back, by relevance."""
    projected = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    text = torch.tensor([[-1.0, 0.0, 0.0]])
    tokens = _tokens(projected, text)
    assert vtoken.CDPruner(budget=1, relevance="llm").select(tokens).kept.tolist() == [[0]]
    assert vtoken.CDPruner(budget=2, relevance="llm").select(tokens).kept.tolist() == [[0, 2]]
    assert vtoken.CDPruner(budget=3, relevance="llm").select(tokens).kept.tolist() == [[0, 2, 3]]
    assert vtoken.CDPruner(budget=4, relevance="llm").select(tokens).kept.tolist() == [[0, 1, 2, 3]]
    assert reference(projected, projected, text, [2]).kept == [[0, 2]]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget, theta", [(5, None), (12, None), (12, 0.5), (30, None), (0.3, 0.8), (1, None)])
def test_random_images_equal_the_reference(seed, budget, theta):
    """Two images of 2 and 3 crops (per-image min-max), 8-dim tokens (rank 8: budgets 12 and 30 pass it), some
    tokens invalid, one exact duplicate."""
    g = torch.Generator().manual_seed(seed)
    projected = torch.randn(5, 40, 8, generator=g)
    projected[1, 7] = projected[1, 3]
    text = torch.randn(2, 8, generator=g)
    image = torch.tensor([0, 0, 1, 1, 1])
    valid = torch.rand(5, 40, generator=g) > 0.15
    sizes = valid.sum(1).tolist()
    tokens = _tokens(projected, text, image, valid)
    tokens.valid_counts = sizes
    selection = vtoken.CDPruner(budget=budget, theta=theta, relevance="llm").select(tokens)
    counts = [vtoken.tokens_to_keep(budget, s) for s in sizes]
    for first, last in [(0, 2), (2, 5)]:
        want = reference(projected[first:last], projected[first:last], text, counts[first:last], theta,
                         valid[first:last])  # fmt: skip
        want.check([selection.kept_of(c).tolist() for c in range(first, last)], counts[first:last])


@pytest.mark.parametrize("budget", [9, 24, 40])
def test_past_the_rank_it_keeps_exactly_the_budget(budget):
    """Rank 4 (4-dim tokens): the official code would take square roots of non-positive numbers and keep fewer."""
    g = torch.Generator().manual_seed(budget)
    projected = torch.randn(2, 40, 4, generator=g)
    selection = vtoken.CDPruner(budget=budget, relevance="llm").select(_tokens(projected, torch.randn(3, 4)))
    for c in range(2):
        kept = selection.kept_of(c)
        assert len(kept) == len(set(kept.tolist())) == budget and bool((kept[1:] > kept[:-1]).all())
        assert 0 <= int(kept.min()) and int(kept.max()) < 40


def test_degenerate_relevance_is_one_everywhere():
    """Every token equally relevant (max = min, where the official code divides by zero): pure diversity."""
    projected = torch.randn(1, 12, 6, generator=torch.Generator().manual_seed(0))
    text = torch.zeros(1, 6)  # every cosine is 0
    kept = vtoken.CDPruner(budget=4, relevance="llm").select(_tokens(projected, text)).kept_of(0).tolist()
    unit = torch.nn.functional.normalize(projected, dim=-1)  # q = 1: the plain greedy DPP on the similarity
    reference(unit, torch.ones(1, 12, 6), torch.ones(1, 6), [4]).check([kept], [4])


def test_keeping_all_is_the_identity_selection():
    projected = torch.randn(2, 10, 4)
    selection = vtoken.CDPruner(budget=1.0, relevance="llm").select(_tokens(projected, torch.randn(1, 4)))
    assert selection.kept.tolist() == [list(range(10))] * 2


def test_question_suffixes_are_removed_as_the_official_scripts_do():
    assert clean_question("what is it? Answer the question using a single word or phrase.") == "what is it?"
    assert clean_question("A or B? Answer with the option's letter from the given choices directly.") == "A or B?"


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(theta=1.0), "theta=1.0"),
        (dict(theta=0), "theta=0"),
        (dict(theta=True), "theta=True"),
        (dict(relevance="text"), "relevance='text'"),
        (dict(clip=3), "clip=int"),
        (dict(clip=""), "clip=''"),
        (dict(question=""), "question=''"),
        (dict(budget=0), "budget=0"),
        (dict(scope="image"), "scope='image'"),
        (dict(clip_tokenizer=5), "clip_tokenizer=int"),
    ],
)
def test_parameters_are_checked_at_construction(params, match):
    with pytest.raises(vtoken.VTokenError, match=match):
        vtoken.CDPruner(**params)


def test_a_loaded_clip_needs_its_tokenizer(llava):
    clip, _ = tiny_clip(*llava)
    with pytest.raises(vtoken.VTokenError, match="clip_tokenizer="):
        vtoken.CDPruner(clip=clip)


# --------------------------------------------------------------------------- through vtoken.patch
def _clip_reference_inputs(model, clip, tokenizer, pixel_values, question=QUESTION):
    """Independent signals: the tower's patches at the feature layer, their projection, CLIP image embeds (the
    tower's post_layernorm, then the checkpoint's visual_projection) and the question's CLIP text embeds (rows of
    the text tower's length, zero-padded)."""
    tower = model.model.vision_tower
    with torch.no_grad():
        hidden = tower(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        projected = model.model.multi_modal_projector(hidden)
        embeds = clip.visual_projection(tower.post_layernorm(hidden))
        ids = tokenizer(clean_question(question))["input_ids"]
        segment = clip.config.text_config.max_position_embeddings
        rows = (len(ids) - 1) // segment + 1
        pad = rows * segment - len(ids)
        input_ids = torch.tensor(ids + [0] * pad).view(rows, segment)
        mask = torch.tensor([1] * len(ids) + [0] * pad).view(rows, segment)
        text = clip.text_projection(clip.text_model(input_ids=input_ids, attention_mask=mask).pooler_output)
    return hidden, projected, embeds, text


@pytest.mark.parametrize("budget", [64, 128, 192])
@pytest.mark.parametrize("form", ["object", "directory"])
def test_llava_equals_the_reference_and_the_language_model_fed_by_hand(wide_llava, photos, tmp_path, budget, form):
    """The official budgets on LLaVA-1.5."""
    model, processor = wide_llava
    clip, tokenizer = tiny_clip(model, processor)
    if form == "directory":
        clip.save_pretrained(tmp_path / "clip")
        tokenizer.save_pretrained(tmp_path / "clip")
        method = vtoken.CDPruner(budget=budget, clip=str(tmp_path / "clip"))
    else:
        method = vtoken.CDPruner(budget=budget, clip=clip, clip_tokenizer=tokenizer)
    inputs = inputs_for(processor, [photos["astronaut"]], [QUESTION])
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        logits = model(**inputs).logits
    _, projected, embeds, text = _clip_reference_inputs(model, clip, tokenizer, inputs["pixel_values"])
    kept = handle.records[0].kept.tolist()
    reference(projected, embeds, text, [budget]).check([kept], [budget])
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, projected[0, kept])
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_a_given_question_and_one_longer_than_the_text_tower(wide_llava, photos):
    """`question=` replaces the prompt's; a question longer than the text tower's 8 positions is cut into rows."""
    model, processor = wide_llava
    clip, tokenizer = tiny_clip(model, processor, positions=8)
    question = "is the person in the image wearing a white space suit with a helmet and gloves?"
    assert len(tokenizer(question)["input_ids"]) > 16  # several rows
    inputs = inputs_for(processor, [photos["astronaut"]], [QUESTION])
    method = vtoken.CDPruner(budget=40, theta=0.5, clip=clip, clip_tokenizer=tokenizer, question=question)
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        model(**inputs)
    _, projected, embeds, text = _clip_reference_inputs(model, clip, tokenizer, inputs["pixel_values"], question)
    assert text.shape[0] > 2
    reference(projected, embeds, text, [40], theta=0.5).check([handle.records[0].kept.tolist()], [40])


def test_past_the_rank_of_a_tiny_model_it_keeps_exactly_the_budget(llava, photos):
    """The stock tiny LLaVA's tokens are 64 wide: at 128 and 192 the official code would keep fewer (NaN gains);
    here exactly the budget, distinct, ascending, and the LLM gets finite embeddings."""
    model, processor = llava
    clip, tokenizer = tiny_clip(model, processor)
    inputs = inputs_for(processor, [photos["astronaut"]], [QUESTION])
    for budget in (128, 192):
        method = vtoken.CDPruner(budget=budget, clip=clip, clip_tokenizer=tokenizer)
        with torch.no_grad(), vtoken.patched(model, method) as handle:
            seen = captured_llm_input(model, inputs)
        kept = handle.records[0].kept
        assert len(kept) == len(set(kept.tolist())) == budget and bool((kept[1:] > kept[:-1]).all())
        assert bool(torch.isfinite(seen).all()) and seen.shape[1] == inputs["input_ids"].shape[1] - 576 + budget


def test_llava_identity_batch_beams_and_restore(wide_llava, photos):
    model, processor = wide_llava
    clip, tokenizer = tiny_clip(model, processor)
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is it?"])
    assert_identity(model, vtoken.CDPruner(budget=1.0, clip=clip, clip_tokenizer=tokenizer), inputs)
    questions = ["what is in the image?", "describe the image in detail."]
    batched = inputs_for(processor, [photos["coffee"], photos["rocket"]], questions)
    singles = [inputs_for(processor, [photos[p]], [q]) for p, q in zip(("coffee", "rocket"), questions, strict=True)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generate = dict(max_new_tokens=3, num_beams=2, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**batched, **generate)
        with vtoken.patched(model, vtoken.CDPruner(budget=0.25, clip=clip, clip_tokenizer=tokenizer)):
            assert_batch_equals_one_by_one(model, batched, singles)
            beams = model.generate(**batched, **generate, num_return_sequences=2)
        after = model.generate(**batched, **generate)
    assert beams.shape[0] == 4 and torch.equal(after, ref)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _next_signals(model, crops, clip):
    tower = model.model.vision_tower
    with torch.no_grad():
        hidden = tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:]
        return model.model.multi_modal_projector(hidden), clip.visual_projection(tower.post_layernorm(hidden))


@pytest.mark.parametrize("layout", ["native", "official"])
@pytest.mark.parametrize("budget", [32, 64, 128])
def test_llava_next_keeps_its_budget_per_crop_with_one_relevance_per_image(wide_next, layout, budget):
    """The official per-crop budgets on LLaVA-NeXT; relevance min-maxed once over every crop of the image (over
    the valid tokens in the native layout, where the unpadded border is never picked)."""
    model, processor = wide_next
    clip, tokenizer = tiny_clip(model, processor)
    inputs = processor(images=[make_image(800, 300)], text=[build_prompt(processor, QUESTION)], return_tensors="pt")
    method = vtoken.CDPruner(budget=budget, clip=clip, clip_tokenizer=tokenizer)
    with torch.no_grad(), vtoken.patched(model, method, layout=layout) as handle:
        logits = model(**inputs).logits
    crop_layout = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : crop_layout.num_crops]
    projected, embeds = _next_signals(model, crops, clip)
    _, _, _, text = _clip_reference_inputs(model, clip, tokenizer, crops[:1])
    valid = None
    if layout == "native":
        ones = torch.zeros(len(crops), 576)
        valid = torch.stack([mask_outside_unpadded(ones[c], c, crop_layout) > -math.inf for c in range(len(crops))])
    sizes = [576] * len(crops) if valid is None else valid.sum(1).tolist()
    counts = [vtoken.tokens_to_keep(budget, s) for s in sizes]
    kept = [r.kept.tolist() for r in handle.records]
    reference(projected, embeds, text, counts, valid=valid).check(kept, counts)
    if layout == "official":  # base view's kept, then the grid's kept in raster order of the full stitched grid
        keys, subs = [], []
        for c in range(1, crop_layout.num_crops):
            row, col = divmod(c - 1, crop_layout.cols)
            where = torch.tensor(kept[c])
            keys.append((row * 24 + where // 24) * crop_layout.cols * 24 + col * 24 + where % 24)
            subs.append(projected[c, kept[c]])
        image = torch.cat([projected[0, kept[0]], torch.cat(subs)[torch.cat(keys).argsort()]])
        ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_llava_next_identity_and_a_padded_batch_of_sizes_equals_its_rows(wide_next):
    model, processor = wide_next
    clip, tokenizer = tiny_clip(model, processor)
    inputs = processor(images=[make_image(500, 300)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    assert_identity(model, vtoken.CDPruner(budget=1.0, clip=clip, clip_tokenizer=tokenizer), inputs)
    sizes, questions = [(800, 300), (336, 500)], ["what is it?", "describe it."]
    prompts = [build_prompt(processor, q) for q in questions]
    images = [make_image(*s, i) for i, s in enumerate(sizes)]
    batched = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(images=[im], text=[p], return_tensors="pt") for im, p in zip(images, prompts, strict=True)]
    with torch.no_grad(), vtoken.patched(model, vtoken.CDPruner(budget=20, clip=clip, clip_tokenizer=tokenizer)):
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=3)


# --------------------------------------------------------------------------- refusals
def test_the_default_clip_checkpoint_does_not_fit_a_tiny_tower(llava):
    """The tower's width (32) is not CLIP-L's (1024): refused at patch, without asking the hub."""
    with pytest.raises(vtoken.VTokenError, match="vision width 1024.*hidden size 32.*relevance='llm'"):
        vtoken.patch(llava[0], "cdpruner")
    assert vtoken.handle_of(llava[0]) is None


def test_an_absent_checkpoint_offline_names_what_to_pass(llava, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(vtoken.VTokenError, match="cdpruner: cannot load the CLIP checkpoint 'nobody/no-clip'.*clip="):
        vtoken.patch(llava[0], vtoken.CDPruner(clip="nobody/no-clip"))
    assert vtoken.handle_of(llava[0]) is None


def test_a_clip_of_another_width_is_refused_at_patch(llava):
    model, processor = llava
    clip, tokenizer = tiny_clip(model, processor)
    clip.visual_projection = torch.nn.Linear(48, 16, bias=False)
    with pytest.raises(vtoken.VTokenError, match="vision width 48.*hidden size 32"):
        vtoken.patch(model, vtoken.CDPruner(clip=clip, clip_tokenizer=tokenizer))


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-onevision", "tiny-internvl"])
def test_families_without_a_clip_text_tower_refuse_it_naming_the_variant(name):
    model, _ = TINY_MODELS[name]()  # CDPruner-LLM there: tests/test_contract.py's rows
    with pytest.raises(vtoken.MissingSignalError, match="clip_features.*relevance='llm'"):
        vtoken.patch(model, vtoken.CDPruner())
    assert vtoken.handle_of(model) is None


def test_composes_with_an_llm_stage_and_sparse_prefill(llava, photos):
    model, processor = llava
    clip, tokenizer = tiny_clip(model, processor)
    inputs = inputs_for(processor, [photos["astronaut"]], [QUESTION])
    encoder = vtoken.CDPruner(budget=64, clip=clip, clip_tokenizer=tokenizer)
    with torch.no_grad(), vtoken.patched(model, [encoder, vtoken.FastV(layer=0, keep=0.5)]) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    stages = [r.stage for r in handle.records]
    assert stages[0] == "encoder" and handle.records[0].tokens_out == 64
    assert any(s.startswith("prefill.") and r.tokens_in == 64 for s, r in zip(stages, handle.records, strict=True))
    with torch.no_grad(), vtoken.patched(model, [encoder, vtoken.SparsePrefill(min_length=1)]) as handle:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert handle.records[0].tokens_out == 64


# --------------------------------------------------------------------------- launch counts
@pytest.mark.parametrize("relevance", ["clip", "llm"])
def test_a_selection_launches_a_fixed_burst_and_never_syncs(llava, relevance):
    """Zero host syncs; the same short burst of kernels at budgets 16 and 120 and for 1 or 5 crops of an image
    (the greedy steps run inside one `vtoken::dpp_greedy`). The question's text embeddings are computed on the
    first call and cached."""
    clip, tokenizer = tiny_clip(*llava)
    g = torch.Generator().manual_seed(0)
    counted = {}
    for crops in (1, 5):
        projected, clip_features = torch.randn(crops, 576, 64, generator=g), torch.randn(crops, 576, 32, generator=g)
        for budget in (16, 120):
            method = vtoken.CDPruner(budget=budget, relevance=relevance, clip=clip, clip_tokenizer=tokenizer)
            tokens = _tokens(projected, torch.randn(4, 64, generator=g), clip_features=clip_features)
            tokens.image_of_crop = [0] * crops
            method.select(tokens)  # the question's embeddings, once
            with count_launches() as launches:
                selection = method.select(tokens)
            assert launches.syncs == 0, launches.describe()
            assert launches.ops["vtoken::dpp_greedy"] == 1, launches.describe()
            assert selection.kept.shape == (crops, budget)
            counted[crops, budget] = launches.kernels
    assert len(set(counted.values())) == 1 and max(counted.values()) <= 40, counted
