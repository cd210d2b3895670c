"""Chat use (issue 23): multi-turn conversations continued from the cache a patched model returned, streaming.

A later turn is compared with the unpatched model fed the new tokens by hand on top of the pruned turn's cache,
at the positions decoding uses (counted here from the unpatched model's own M-RoPE positions on Qwen families),
and, keeping every token, with the unpatched model's own turn 2.
"""

import contextlib
import copy
import dataclasses
import inspect
import threading

import pytest
import torch
from conftest import make_image
from transformers import DynamicCache, TextIteratorStreamer

import vtoken
from vtoken.adapters import hf
from vtoken.zoo import TINY_MODELS, build_prompt

FAMILIES = sorted(TINY_MODELS)
MROPE = {"tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"}
PIXEL_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "num_patches", "pixel_attention_mask")
STEPS = 3


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model, processor = TINY_MODELS[request.param]()
    return request.param, model, processor


def _turn1(processor, image, question="what is in the image?"):
    return processor(images=[image], text=[build_prompt(processor, question)], return_tensors="pt")


def _text_turn(processor, question="describe the colours."):
    """The tokens of a new user turn and the generation prompt (text only), without special tokens added."""
    content = [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def _second_turn_kwargs(first, sequences, new_ids):
    """generate kwargs of turn 2: the conversation as returned, then the new tokens; the caller's per-token inputs
    extended over it (0 for text)."""
    ids = torch.cat([sequences, new_ids], dim=1)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for key in ("mm_token_type_ids", "token_type_ids"):
        if first.get(key) is not None:
            kwargs[key] = torch.cat([first[key], torch.zeros_like(ids[:, first[key].shape[1] :])], dim=1)
    return kwargs


def _generate(model, steps=STEPS, **kwargs):
    with torch.no_grad():
        return model.generate(**kwargs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip


def _next_rope_position(model, inputs):
    """The unpatched model's own M-RoPE position of the first token after the prompt `inputs` (its largest + 1)."""
    grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw") if inputs.get(k) is not None}
    rope, _ = model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], **grids)
    return int(rope.max()) + 1


def continue_by_hand(model, cache, new_ids, text_start, rope_start, steps=STEPS):
    """The unpatched model fed `new_ids` [1, n] on top of `cache`, then greedy decoding: text positions (masks)
    from `text_start`, rotary positions from `rope_start` (M-RoPE families: all three rows), an explicit all-ones
    mask. Returns per-step logits [steps, V] and tokens [1, steps]."""
    logits, tokens, ids = [], [], new_ids
    with torch.no_grad():
        for _ in range(steps):
            n = ids.shape[1]
            text = torch.arange(text_start, text_start + n)[None]
            positions = text
            if rope_start is not None:
                rope = torch.arange(rope_start, rope_start + n)[None, None].expand(3, 1, n)
                positions = torch.cat([text[None], rope])
                rope_start += n
            mask = torch.ones(1, text_start + n, dtype=torch.long)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **hf.cache_kwargs(cache),
                        use_cache=True)  # fmt: skip
            text_start += n
            logits.append(out.logits[:, -1])
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(ids)
    return torch.cat(logits), torch.cat(tokens, dim=1)


def test_text_turn_after_a_pruned_turn_continues_its_cache(family):
    """Turn 1 with an image at budget 0.25, turn 2 text only with the whole conversation and turn 1's cache (the
    one generate returned, and a DynamicCache the caller passed): turn 2 equals the unpatched model fed the new
    tokens on top of turn 1's pruned cache, at the positions decoding continues with."""
    name, model, processor = family
    first = _turn1(processor, make_image(300, 220, 1))
    new_ids = _text_turn(processor)
    for given_cache in (False, True):
        given = DynamicCache(config=model.config.get_text_config())
        cache_kwargs = hf.cache_kwargs(given) if given_cache else {}
        with vtoken.patched(model, vtoken.Random(budget=0.25)) as handle:
            out1 = _generate(model, **first, **cache_kwargs)
            dropped = sum(r.tokens_in - r.tokens_out for r in handle.records)
            cache = hf.cache_out(out1)
            assert dropped > 0 and (not given_cache or cache is given)
            held = copy.deepcopy(cache)
            out2 = _generate(model, **_second_turn_kwargs(first, out1.sequences, new_ids), **hf.cache_kwargs(cache))
        past = held.get_seq_length()
        prompt = first["input_ids"].shape[1]
        assert past == prompt - dropped + STEPS - 1  # the pruned prompt and the tokens generated since
        rope = _next_rope_position(model, first) + STEPS - 1 if name in MROPE else None
        cut = out1.sequences.shape[1] - 1  # the last generated token is not in the cache yet
        ids = torch.cat([out1.sequences[:, cut:], new_ids], dim=1)
        logits, tokens = continue_by_hand(model, held, ids, past, rope)
        assert torch.equal(out2.sequences[:, : out1.sequences.shape[1]], out1.sequences)  # the caller's own prompt
        assert torch.equal(out2.sequences[:, -STEPS:], tokens), (name, given_cache)
        assert (torch.cat(out2.logits) - logits).abs().max() <= 1e-4, (name, given_cache)


def _image_turn(processor, image, question="and this one?"):
    """Processor inputs of a new user turn with one image (its own placeholders and pixels only)."""
    return processor(images=[image], text=[build_prompt(processor, question)], return_tensors="pt")


def _with_new_image(first, sequences, new):
    """generate kwargs of a turn 2 bringing an image: the conversation as returned, then the new turn's ids, with
    only the new image's pixels (what the cache lacks), per-token inputs extended over the conversation."""
    ids = torch.cat([sequences, new["input_ids"]], dim=1)
    kwargs = {k: v for k, v in new.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                         "token_type_ids")}  # fmt: skip
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    for key in ("mm_token_type_ids", "token_type_ids"):
        if first.get(key) is not None:
            between = torch.zeros_like(sequences[:, first[key].shape[1] :])
            kwargs[key] = torch.cat([first[key], between, new[key]], dim=1)
    return kwargs


class _Capture:
    """The keyword arguments of the first call of `module` (a forward pre-hook)."""

    def __init__(self, module):
        self.kwargs = None
        self._hook = module.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        if self.kwargs is None:
            self.kwargs = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            self.kwargs.update(self.kwargs.pop("kwargs", {}))

    def remove(self):
        self._hook.remove()


def _uncached_rope(model, sequences, new, kept_columns):
    """[3, 1, n] the unpatched model's M-RoPE positions of the uncached tokens (the last generated one, then the new
    turn) counted from 0, at `kept_columns`."""
    ids = torch.cat([sequences[:, -1:], new["input_ids"]], dim=1)
    types = torch.cat([torch.zeros_like(ids[:, :1]), new["mm_token_type_ids"]], dim=1)
    rope, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=new["image_grid_thw"])
    return rope[:, :, kept_columns]


@pytest.mark.parametrize("budget", [0.25, 1.0])
def test_image_turn_on_a_pruned_cache_prunes_the_new_image_alone(family, budget):
    """Turn 2 brings a new image (its pixels only) on top of turn 1's cache: only the new turn's placeholders are
    counted, the new image is pruned by the same method, and turn 2 equals the unpatched model fed the new tokens
    (with the kept embeddings it was handed) on top of turn 1's cache, at the positions decoding continues with
    (Qwen: the new image's own M-RoPE positions, moved there). Keeping every token, the non-Qwen families equal the
    unpatched model's own turn 2 (stock Qwen generate fails on this call in transformers 5.23: it numbers the
    whole conversation's images with the new image's grid alone)."""
    name, model, processor = family
    first = _turn1(processor, make_image(300, 220, 1))
    new = _image_turn(processor, make_image(200, 260, 2))
    method = vtoken.Random(budget=budget)
    with vtoken.patched(model, method) as handle:
        out1 = _generate(model, **first)
        held = copy.deepcopy(hf.cache_out(out1))
        capture = _Capture(model.model)
        try:
            turn2 = _with_new_image(first, out1.sequences, new)
            out2 = _generate(model, **turn2, **hf.cache_kwargs(hf.cache_out(out1)))
        finally:
            capture.remove()
        records = list(handle.records)
    assert records and all(r.tokens_out == vtoken.tokens_to_keep(budget, r.tokens_in) for r in records)
    placeholder = model.config.image_token_id
    run = (new["input_ids"][0] == placeholder).nonzero().squeeze(1)
    given = capture.kwargs["input_ids"]
    kept = int((given == placeholder).sum())  # the kept tokens (and, on anyres layouts, the row newlines kept)
    assert (kept < len(run)) == (budget < 1), name
    uncached = torch.cat([out1.sequences[:, -1:], new["input_ids"]], dim=1)[0]
    # what reached the model: the uncached tokens, the new image's run shortened (its length is what matters)
    keep = torch.ones_like(uncached, dtype=torch.bool)
    keep[1 + run[kept:]] = False
    assert torch.equal(given[0], uncached[keep]), name
    past = held.get_seq_length()
    n = given.shape[1]
    text = torch.arange(past, past + n)[None]
    positions = text
    if name in MROPE:
        offsets = torch.cat([r.kept + sum(x.tokens_in for x in records[:i]) for i, r in enumerate(records)])
        keep = torch.ones_like(uncached, dtype=torch.bool)
        keep[1 + run] = False
        keep[1 + run[offsets]] = True
        start = _next_rope_position(model, first) + STEPS - 1
        rope = _uncached_rope(model, out1.sequences, new, keep.nonzero().squeeze(1)) + start
        positions = torch.cat([text[None], rope])
    extra = {k: v for k, v in capture.kwargs.items() if k in ("mm_encoder_outputs", "token_type_ids",
                                                               "mm_token_type_ids")}  # fmt: skip
    with torch.no_grad():
        ref = model(input_ids=given, attention_mask=torch.ones(1, past + n, dtype=torch.long), position_ids=positions,
                    **hf.cache_kwargs(held), use_cache=True, **extra)  # fmt: skip
        first_logits = ref.logits[:, -1]
        rope_next = int(positions[1:].max()) + 1 if name in MROPE else None
        logits, tokens = continue_by_hand(model, held, first_logits.argmax(-1, keepdim=True), past + n, rope_next,
                                          steps=STEPS - 1)  # fmt: skip
    assert (out2.logits[0] - first_logits).abs().max() <= 1e-4, name
    assert (torch.cat(out2.logits[1:]) - logits).abs().max() <= 1e-4, name
    assert torch.equal(out2.sequences[:, -STEPS:], torch.cat([first_logits.argmax(-1, keepdim=True), tokens], 1))
    if budget == 1.0 and name not in MROPE:  # the unpatched model's own turn 2
        stock1 = _generate(model, **first)
        stock2 = _generate(model, **_with_new_image(first, stock1.sequences, new),
                           **hf.cache_kwargs(hf.cache_out(stock1)))  # fmt: skip
        assert torch.equal(out2.sequences, stock2.sequences)
        assert (torch.cat(out2.logits) - torch.cat(stock2.logits)).abs().max() <= 1e-5


def _fastv(model, keep):
    """FastV after the first full-attention LLM layer that leaves a later one (Qwen3.5: not a linear layer)."""
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layer = next(i for i, kind in enumerate(types[:-1]) if kind == "full_attention")
    return vtoken.FastV(layer=layer, keep=keep)


@pytest.mark.parametrize("stage", ["encoder", "prefill"])
def test_text_turn_keeping_every_token_is_the_unpatched_models(family, stage):
    """Keeping every token (an encoder method, or FastV inside the LLM), turn 2 on turn 1's cache gives the
    unpatched model's turn 2: tokens and logits."""
    name, model, processor = family
    if stage == "prefill" and name == "tiny-gemma3":  # LLM stages are refused at patch, the model left as it was
        with pytest.raises(vtoken.VTokenError, match="Gemma"):
            vtoken.patch(model, vtoken.FastV(layer=0, keep=1.0))
        assert vtoken.handle_of(model) is None
        return
    first = _turn1(processor, make_image(300, 220, 1))
    new_ids = _text_turn(processor)
    method = vtoken.Random(budget=1.0) if stage == "encoder" else _fastv(model, 1.0)
    turns = []
    for patched in (False, True):
        with vtoken.patched(model, method) if patched else contextlib.nullcontext():
            out1 = _generate(model, **first)
            turns.append(_generate(model, **_second_turn_kwargs(first, out1.sequences, new_ids),
                                   **hf.cache_kwargs(hf.cache_out(out1))))  # fmt: skip
    stock, mine = turns
    assert torch.equal(mine.sequences, stock.sequences), name
    assert (torch.cat(mine.logits) - torch.cat(stock.logits)).abs().max() <= 1e-5, name


def _forward_turn(model, cache, first, sequences, new_ids):
    """Turn 2 through model(...): only the tokens the cache lacks, a mask over the caller's whole conversation."""
    width = sequences.shape[1] + new_ids.shape[1]
    ids = torch.cat([sequences[:, -1:], new_ids], dim=1)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones(1, width, dtype=torch.long), **hf.cache_kwargs(cache),
                     use_cache=True).logits[:, -1]  # fmt: skip


def test_text_turn_through_forward_continues_the_cache(family):
    """The same turn 2 through a plain forward (new tokens only, the caller's mask over the whole conversation)
    gives the unpatched model's logits fed by hand on top of turn 1's pruned cache; so does the conversation's next
    decoding step."""
    name, model, processor = family
    first = _turn1(processor, make_image(300, 220, 1))
    new_ids = _text_turn(processor)
    with vtoken.patched(model, vtoken.Random(budget=0.25)):
        out1 = _generate(model, **first)
        held = copy.deepcopy(hf.cache_out(out1))
        got = _forward_turn(model, hf.cache_out(out1), first, out1.sequences, new_ids)
        token = got.argmax(-1, keepdim=True)
        width = out1.sequences.shape[1] + new_ids.shape[1] + 1
        with torch.no_grad():
            step = model(input_ids=token, attention_mask=torch.ones(1, width, dtype=torch.long),
                         **hf.cache_kwargs(hf.cache_out(out1)), use_cache=True).logits[:, -1]  # fmt: skip
    rope = _next_rope_position(model, first) + STEPS - 1 if name in MROPE else None
    ids = torch.cat([out1.sequences[:, -1:], new_ids], dim=1)
    logits, _ = continue_by_hand(model, held, ids, held.get_seq_length(), rope, steps=2)
    assert (got - logits[0]).abs().max() <= 1e-4, name
    assert (step - logits[1]).abs().max() <= 1e-4, name


def test_a_conversation_must_extend_the_cached_prompt(family):
    """A turn 2 whose ids do not start with the prompt the cache was filled with, or that is shorter than what the
    cache holds, is refused with the reason (the stock model would silently continue a different sequence)."""
    name, model, processor = family
    first = _turn1(processor, make_image(300, 220, 1))
    with vtoken.patched(model, vtoken.Random(budget=0.25)):
        out1 = _generate(model, **first)
        other = out1.sequences.clone()
        other[0, 1] = (other[0, 1] + 1) % 10
        kwargs = _second_turn_kwargs(first, other, _text_turn(processor))
        with pytest.raises(vtoken.InputError, match="differ from the prompt the cache .* was filled with"):
            _generate(model, **kwargs, **hf.cache_kwargs(hf.cache_out(out1)))
        short = {"input_ids": first["input_ids"], "attention_mask": first["attention_mask"]}
        with pytest.raises(vtoken.InputError, match="generate.. takes the whole conversation"):
            _generate(model, **short, **hf.cache_kwargs(hf.cache_out(out1)))


def continue_by_layers(model, cache, ids, positions, steps=STEPS):
    """The unpatched decoder run layer by layer on `ids` [1, n] on top of `cache`, whose layers may hold different
    lengths (an LLM-stage cache): each layer attends to its own cached keys and the new tokens causally. positions:
    layer -> [P, 1, 1] position of the first new token in that layer (P = 1, or 3 rows of M-RoPE); the others follow
    it. Greedy decoding continues `steps` - 1 tokens, each at the next position. Returns logits [steps, V] and
    tokens [1, steps]."""
    lm = model.model.language_model
    logits, tokens, offset = [], [], 0
    with torch.no_grad():
        for _ in range(steps):
            hidden = lm.embed_tokens(ids)
            n = ids.shape[1]
            for i, layer in enumerate(lm.layers):
                past = hf.cache_layers(cache)[i].keys.shape[2]
                mask = torch.zeros(1, 1, n, past + n)
                mask[..., past:] = torch.full((n, n), torch.finfo(hidden.dtype).min).triu(1)
                pos = positions(i) + offset + torch.arange(n)
                pos = pos[0] if pos.shape[0] == 1 else pos
                hidden = layer(hidden, attention_mask=mask, position_ids=pos, **hf.cache_kwargs(cache), use_cache=True,
                               position_embeddings=lm.rotary_emb(hidden, pos))  # fmt: skip
            logits.append(model.lm_head(lm.norm(hidden[:, -1])))
            offset += n
            ids = logits[-1].argmax(-1, keepdim=True)
            tokens.append(ids)
    return torch.cat(logits), torch.cat(tokens, dim=1)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl", "tiny-qwen3-vl"])
@pytest.mark.parametrize("positions", ["original", "renumber"])
def test_text_turn_after_fastv_continues_each_layers_cache(name, positions):
    """FastV leaves layers after its drop holding fewer tokens; turn 2 (text) on that cache equals the unpatched
    decoder run layer by layer on it: every layer its own cached keys, the new tokens at the positions decoding
    uses (the prompt's numbering; renumbered layers moved back by the tokens they lost)."""
    model, processor = TINY_MODELS[name](**({"text_layers": 4} if name == "tiny-llava" else {}))
    if name in MROPE and positions == "renumber":  # M-RoPE keeps original positions: renumbering is refused at patch
        with pytest.raises(vtoken.VTokenError, match="renumber"):
            vtoken.patch(model, dataclasses.replace(_fastv(model, 0.25), positions=positions))
        assert vtoken.handle_of(model) is None
        return
    first = _turn1(processor, make_image(300, 220, 1))
    new_ids = _text_turn(processor)
    with vtoken.patched(model, dataclasses.replace(_fastv(model, 0.25), positions=positions)):
        out1 = _generate(model, **first)
        held = copy.deepcopy(hf.cache_out(out1))
        out2 = _generate(model, **_second_turn_kwargs(first, out1.sequences, new_ids),
                         **hf.cache_kwargs(hf.cache_out(out1)))  # fmt: skip
    lengths = [layer.keys.shape[2] for layer in hf.cache_layers(held)]
    assert lengths[-1] < lengths[0]  # the later layers hold fewer tokens
    past = lengths[0]
    start = _next_rope_position(model, first) + STEPS - 1 if name in MROPE else past

    def at(i):  # the first new token's position in layer i
        lost = lengths[0] - lengths[i] if positions == "renumber" else 0
        return torch.tensor([start - lost]).view(1, 1, 1).expand(3 if name in MROPE else 1, 1, 1)

    ids = torch.cat([out1.sequences[:, -1:], new_ids], dim=1)
    logits, tokens = continue_by_layers(model, held, ids, at)
    assert torch.equal(out2.sequences[:, -STEPS:], tokens)
    assert (torch.cat(out2.logits) - logits).abs().max() <= 1e-4


# ----------------------------------------------------------------------------------------------- streaming
class _Recording(TextIteratorStreamer):
    """A chat UI's streamer that also keeps every tensor generate hands it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def put(self, value):
        self.seen.append(value.clone())
        super().put(value)


def _stream(model, processor, skip_prompt, **kwargs):
    """generate in a thread with a TextIteratorStreamer read in this one, as chat UIs do: (returned sequences,
    streamed text, tensors the streamer got)."""
    streamer = _Recording(processor.tokenizer, skip_prompt=skip_prompt, timeout=60)
    result = {}

    def run():
        with torch.no_grad():
            result["out"] = model.generate(**kwargs, streamer=streamer, max_new_tokens=5, do_sample=False)

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    return result["out"], text, streamer.seen


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl", "tiny-internvl"])
@pytest.mark.parametrize("skip_prompt", [False, True])
def test_streamer_sees_the_callers_prompt_and_the_returned_tokens(name, skip_prompt):
    """A pruned turn and a turn continuing its cache, streamed through TextIteratorStreamer from a generate thread:
    the streamer gets the caller's own prompt first, then exactly the tokens generate returns, and its text is the
    returned sequence's (the prompt's too unless skip_prompt)."""
    model, processor = TINY_MODELS[name]()
    first = _turn1(processor, make_image(300, 220, 1))
    decode = processor.tokenizer.decode
    with vtoken.patched(model, vtoken.Random(budget=0.25)):
        out1, text1, seen1 = _stream(model, processor, skip_prompt, **first, return_dict_in_generate=True)
        turn2 = _second_turn_kwargs(first, out1.sequences, _text_turn(processor))
        out2, text2, seen2 = _stream(model, processor, skip_prompt, **turn2, **hf.cache_kwargs(hf.cache_out(out1)))
    for caller, returned, text, seen in ((first["input_ids"], out1.sequences, text1, seen1),
                                         (turn2["input_ids"], out2, text2, seen2)):  # fmt: skip
        assert torch.equal(seen[0], caller)  # the caller's prompt, not the shrunk one
        assert torch.equal(torch.cat([t.view(-1) for t in seen]), returned[0])
        assert text == decode(returned[0, caller.shape[1] :] if skip_prompt else returned[0])


def test_a_new_image_on_an_llm_stage_cache_is_refused_first():
    """FastV prunes inside the LLM during a prefill from an empty cache: a later turn bringing a new image on its
    cache is refused before the LLM runs, naming the ways that work (a cropped cache too)."""
    model, processor = TINY_MODELS["tiny-llava"](text_layers=4)
    first = _turn1(processor, make_image(300, 220, 1))
    new = _image_turn(processor, make_image(200, 260, 2))
    with vtoken.patched(model, vtoken.FastV(layer=1, keep=0.25)):
        out1 = _generate(model, **first)
        calls = []
        hook = model.model.language_model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(vtoken.InputError, match="fastv prunes .* new images on top of a cache .* text only"):
                _generate(model, **_with_new_image(first, out1.sequences, new), **hf.cache_kwargs(hf.cache_out(out1)))
            hf.cache_out(out1).crop(-(STEPS + 3))  # into the prompt
            with pytest.raises(vtoken.InputError, match="fewer than the .* pruned prompt"):
                _generate(model, **_second_turn_kwargs(first, out1.sequences, _text_turn(processor)),
                          **hf.cache_kwargs(hf.cache_out(out1)))  # fmt: skip
        finally:
            hook.remove()
    assert calls == []
