import copy

import numpy as np
import pytest
import torch
from near_ties import greedy_steps_agreeing
from PIL import Image

import vtoken
from vtoken.zoo import TINY_MODELS, build_prompt, tiny_llava

# every built-in family beside LLaVA-1.5 (which the `llava` fixture covers)
OTHER_TINY_MODELS = [name for name in TINY_MODELS if name != "tiny-llava"]

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llava():
    """(model, processor): the built-in tiny LLaVA-1.5, fp32, SDPA everywhere."""
    return tiny_llava()


def captured_llm_input(model, inputs):
    """The LLM's inputs_embeds [B, L, D] of a forward of `model` (patched or not) on `inputs`, read by a hook."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    return seen["embeds"]


DEEP_LAYERS = 6  # the LLM depth of `deep_llava`: room for several drop points


@pytest.fixture(scope="module")
def deep_llava():
    """The tiny LLaVA-1.5 with a 6-layer LLM (4 query heads, 2 key/value heads: GQA), for the LLM stages."""
    return tiny_llava(text_layers=DEEP_LAYERS)


@pytest.fixture(scope="module")
def eager_lm(deep_llava):
    """An eager-attention copy of `deep_llava`'s language model and its head (attention maps from each layer)."""
    model = copy.deepcopy(deep_llava[0])
    model.set_attn_implementation("eager")
    return model.model.language_model, model.lm_head


@pytest.fixture
def single(deep_llava, photos):
    """One prompt with one photo for `deep_llava`."""
    return inputs_for(deep_llava[1], [photos["astronaut"]], ["what is in the image? answer with one word."])


@pytest.fixture(autouse=True)
def _always_unpatch(request):
    """Never let a failing test leave a shared (model, processor) fixture patched."""
    yield
    for value in getattr(request.node, "funcargs", {}).values():
        if isinstance(value, tuple) and value and isinstance(value[0], torch.nn.Module):
            if vtoken.handle_of(value[0]) is not None:
                vtoken.unpatch(value[0])


@pytest.fixture(scope="session")
def photos():
    """Real photos shipped with scikit-image, as PIL images of different sizes and aspect ratios."""
    from skimage import data

    return {
        "astronaut": Image.fromarray(data.astronaut()),  # 512x512
        "chelsea": Image.fromarray(data.chelsea()),  # 451x300
        "coffee": Image.fromarray(data.coffee()),  # 600x400
        "rocket": Image.fromarray(data.rocket()),  # 427x640
    }


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def inputs_for(processor, images, questions):
    """Processor inputs for one image per prompt, left-padded."""
    prompts = [build_prompt(processor, q) for q in questions]
    return processor(images=images, text=prompts, return_tensors="pt", padding=True)


def video_inputs(processor, frames=4, question="what happens?"):
    """Processor inputs for one prompt with one clip of `frames` frames."""
    from vtoken.images import example_clip

    prompt = build_prompt(processor, question, num_images=0, num_videos=1)
    return processor(videos=[example_clip(frames)], text=[prompt], return_tensors="pt")


def feed_language_model(model, input_ids, token_id, visual):
    """Reference logits: the bare language model on `input_ids[0]` with its one run of `token_id` placeholders
    replaced by exactly the embeddings `visual` [n, D], contiguous positions."""
    ids = input_ids[0]
    placeholders = (ids == token_id).nonzero().squeeze(1)
    new_ids = torch.cat([ids[: placeholders[0]], torch.full((len(visual),), token_id), ids[placeholders[-1] + 1 :]])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(new_ids[None])
        embeds[new_ids[None] == token_id] = visual
        return model.lm_head(model.model.language_model(inputs_embeds=embeds).last_hidden_state)


def eager_cls_attention(tower, pixel_values, layer=-2):
    """Independent [CLS] scores: an eager copy of a CLIP tower run with output_attentions; head-mean attention
    of [CLS] to every patch in the layer whose output is hidden_states[layer]."""
    from transformers import CLIPVisionModel

    config = tower.config.__class__.from_dict(tower.config.to_dict())
    config._attn_implementation = "eager"
    eager = CLIPVisionModel(config).eval()
    eager.load_state_dict(tower.state_dict())
    with torch.no_grad():
        return eager(pixel_values, output_attentions=True).attentions[layer][:, :, 0, 1:].mean(1)


def greedy(model, inputs, max_new_tokens: int):
    """Greedy generation that keeps its per-step logits: (ids [B, max_new_tokens] after the prompt, logits
    [max_new_tokens, B, V])."""
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    return out.sequences[:, inputs["input_ids"].shape[1] :], torch.stack(out.logits)


def assert_same_greedy(got, ref, tolerance: float, min_steps: int) -> None:
    """Two paths' `greedy` runs, row by row: ids equal up to the first step where they part at a near-tie (the
    policy of tests/near_ties.py: a real difference fails, and so does a near-tie before `min_steps`)."""
    (got_ids, got_logits), (ref_ids, ref_logits) = got, ref
    assert got_ids.shape[0] == ref_ids.shape[0]
    for row in range(ref_ids.shape[0]):
        greedy_steps_agreeing(got_ids[row].tolist(), ref_ids[row].tolist(), ref_logits[:, row], tolerance,
                              got_logits[:, row], min_steps)  # fmt: skip


def assert_greedy_matches(generated, reference, tolerance: float = 1e-5, min_steps: int = 3) -> None:
    """A patched model's `greedy` run against a hand-fed reference's (ids [1, steps], per-step logits [steps, 1, V]),
    cut to the steps generate made (it stops at EOS): `assert_same_greedy`."""
    steps = generated[0].shape[1]
    ids, logits = reference
    assert_same_greedy(generated, (ids[:, :steps], logits[:steps]), tolerance, min(min_steps, steps))


def assert_identity(model, method, inputs, max_new_tokens=4, **patch_kwargs):
    """Invariant 1: keeping every token gives the unpatched model's logits (<= 1e-5) and greedy tokens (up to a
    near-tie within 1e-5, after at least 3 steps; tests/near_ties.py). `method`: a name (patched at budget 1.0) or
    a method object already set to keep everything."""
    if isinstance(method, str):
        patch_kwargs["budget"] = 1.0
    with torch.no_grad():
        ref = model(**inputs).logits
        ref_tokens = greedy(model, inputs, max_new_tokens)
        with vtoken.patched(model, method, **patch_kwargs):
            logits = model(**inputs).logits
            tokens = greedy(model, inputs, max_new_tokens)
    assert (logits - ref).abs().max() <= 1e-5
    assert_same_greedy(tokens, ref_tokens, 1e-5, min(3, max_new_tokens))


def assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=5):
    """Invariant 5: every row of a padded batch generates what its sample generates alone (greedy ids up to a
    near-tie within 1e-4, after at least 3 steps; tests/near_ties.py: the batch's shapes round differently)."""
    ids, logits = greedy(model, batched, max_new_tokens)
    for row, single in enumerate(singles):
        one = greedy(model, single, max_new_tokens)
        steps = one[0].shape[1]  # alone, generate stops at EOS; the batch's row goes on with padding
        got = (ids[row : row + 1, :steps], logits[:steps, row : row + 1])
        assert_same_greedy(got, one, 1e-4, min(3, steps))


def assert_batch_beams_and_restore(model, method, batched, singles, batch_tokens=5):
    """Invariants 4 and 5 plus beams, with `method` at budget 0.25: a padded batch equals one-by-one runs
    (`batch_tokens` greedy tokens), 3 tokens of beams with num_return_sequences run, and after unpatching the
    model generates as before with untouched parameters."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generate = dict(max_new_tokens=3, num_beams=2, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**batched, **generate)
        with vtoken.patched(model, method, budget=0.25):
            assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=batch_tokens)
            beams = model.generate(**batched, **generate, num_return_sequences=2)
        after = model.generate(**batched, **generate)
    assert beams.shape[0] == 2 * batched["input_ids"].shape[0] and torch.equal(after, ref)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def mask_outside_unpadded(scores, crop, layout, side=24):
    """LLaVA-NeXT: a copy of one crop's scores [side*side] with the tokens that unpadding removes set to -inf
    (computed from the stitched grid, independently of the adapter's own masks)."""
    scores = scores.clone()
    if crop == 0:  # the base view is never unpadded
        return scores
    valid = set(layout.unpadded.flatten().tolist())
    row, col = divmod(crop - 1, layout.cols)
    for t in range(side * side):
        if ((row * side + t // side) * layout.cols * side + col * side + t % side) not in valid:
            scores[t] = float("-inf")
    return scores


def shortened_prompt(model, input_ids, token_id, kept_per_run):
    """Row 0 of `input_ids` with each run of `token_id` placeholders shortened to its kept tokens, and its input
    embeddings with exactly `kept_per_run` (one [k, D] tensor per run, in order) in the placeholders: returns
    ([1, L'] ids, [1, L', D] embeddings), to feed the bare language model by hand."""
    ids = input_ids[0]
    flags = (ids == token_id).tolist() + [False]
    runs, start = [], None
    for i, is_placeholder in enumerate(flags):
        if is_placeholder and start is None:
            start = i
        if not is_placeholder and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == len(kept_per_run)
    pieces, last = [], 0
    for (begin, end), kept in zip(runs, kept_per_run, strict=True):
        pieces += [ids[last:begin], torch.full((len(kept),), token_id)]
        last = end
    new_ids = torch.cat([*pieces, ids[last:]])[None]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(new_ids)
        embeds[new_ids == token_id] = torch.cat(list(kept_per_run)).to(embeds)
    return new_ids, embeds
