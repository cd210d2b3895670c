"""Reliability under real use (issues 16 and 23): threads, both padding sides, copies, pickling, use_cache, batch
records, labels, static caches, assisted decoding and compiled models. Every test compares against the same call
made alone, an independently patched model, the stock or uncompiled model or a loss computed by hand. (Multi-turn
chat and streaming: test_chat.py.)"""

import contextlib
import copy
import io
import os
import threading

import numpy as np
import pytest
import torch
from conftest import assert_same_greedy, greedy, inputs_for
from PIL import Image
from transformers import StaticCache

import vtoken
from vtoken.adapters import hf
from vtoken.zoo import TINY_MODELS, build_prompt, tiny_llava

METHODS = {
    "fastervlm": lambda: vtoken.FasterVLM(budget=0.25),
    "fastv": lambda: vtoken.FastV(layer=2, keep=0.25),
    "mustdrop": lambda: vtoken.MustDrop(layers=(1, 2), global_thr=0.0025, individual_thr=0.02),
}
GREEDY = dict(max_new_tokens=4, do_sample=False)


@pytest.fixture(scope="module")
def llava4():
    """The tiny LLaVA-1.5 with a 4-layer LLM: deep enough for FastV at layer 2 and MustDrop at layers 1, 2."""
    return tiny_llava(text_layers=4)


@pytest.fixture(scope="module")
def cases(photos):
    """(image, question) of three prompts of different lengths."""
    return [
        (photos["astronaut"], "what is in the image?"),
        (photos["coffee"], "describe the colours of this picture in a few words, please."),
        (photos["rocket"], "is it day or night?"),
    ]


@pytest.fixture(scope="module")
def prompts(llava4, cases):
    """Processor inputs of the three prompts, one by one."""
    return [inputs_for(llava4[1], [image], [question]) for image, question in cases]


def summary_of(records):
    return [(r.stage, r.image, r.crop, r.tokens_in, r.tokens_out, None if r.kept is None else r.kept.tolist())
            for r in records]  # fmt: skip


def run_threads(work, threads=2):
    """Run `work(t)` in `threads` threads at once; re-raise the first exception any of them raised."""
    errors = []

    def target(t):
        try:
            work(t)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    pool = [threading.Thread(target=target, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]


# ----------------------------------------------------------------------------------------------- 1. threads
@pytest.mark.parametrize("name", list(METHODS))
def test_threads_generate_as_sequential_calls(llava4, prompts, name):
    """Two threads calling generate on one patched model get exactly the tokens and records of the same calls
    made alone (each thread reads its own most recent call's records)."""
    model, _ = llava4
    with vtoken.patched(model, METHODS[name]()) as handle, torch.no_grad():
        alone = []
        for inputs in prompts:
            alone.append((model.generate(**inputs, **GREEDY), summary_of(handle.records)))
        results = {}

        def work(t):
            for round_ in range(2):
                for i, inputs in enumerate(prompts):
                    results[t, round_, i] = model.generate(**inputs, **GREEDY), summary_of(handle.records)

        run_threads(work)
    assert len(results) == 2 * 2 * len(prompts)
    for (_, _, i), (tokens, records) in results.items():
        assert torch.equal(tokens, alone[i][0])
        assert records == alone[i][1]


@pytest.mark.parametrize("name", list(METHODS))
def test_thread_in_generate_and_thread_in_forward(llava4, prompts, name):
    """One thread in generate while another calls model(...): both give what they give alone."""
    model, _ = llava4
    with vtoken.patched(model, METHODS[name]()), torch.no_grad():
        tokens = model.generate(**prompts[0], **GREEDY)
        logits = model(**prompts[1]).logits
        seen = {"generate": [], "forward": []}

        def work(t):
            for _ in range(3):
                if t == 0:
                    seen["generate"].append(model.generate(**prompts[0], **GREEDY))
                else:
                    seen["forward"].append(model(**prompts[1]).logits)

        run_threads(work)
    assert all(torch.equal(out, tokens) for out in seen["generate"])
    assert all(torch.equal(out, logits) for out in seen["forward"])


def test_records_of_a_thread_that_made_no_call(llava4, prompts):
    """A thread that made no call reads the most recent call of any thread; a calling thread reads its own."""
    model, _ = llava4
    with vtoken.patched(model, METHODS["fastervlm"]()) as handle, torch.no_grad():
        seen = {}

        def call(t):
            model(**prompts[t])
            seen[t] = summary_of(handle.records)

        run_threads(lambda t: call(0), threads=1)
        assert summary_of(handle.records) == seen[0]  # this thread made no call
        model(**prompts[1])
        run_threads(lambda t: call(2), threads=1)
        assert summary_of(handle.records) != seen[2]  # this thread's own call
        assert seen[0] != seen[2]


# ----------------------------------------------------------------------------------------------- 2. padding
@pytest.mark.parametrize("name", list(METHODS))
def test_right_and_left_padding_give_the_rows_alone(llava4, cases, prompts, name):
    """A padded batch's logits, per row, equal the row run alone, with the batch padded on either side (the
    output keeps the batch's padding side); the records too."""
    model, processor = llava4
    rows = prompts[:2]
    batch = {}
    texts = [build_prompt(processor, question) for _, question in cases[:2]]
    for side in ("left", "right"):
        inputs = processor(images=[image for image, _ in cases[:2]], text=texts, return_tensors="pt", padding=True,
                           padding_side=side)  # fmt: skip
        assert (inputs["attention_mask"][:, -1 if side == "right" else 0] == 0).any()
        batch[side] = inputs
    with vtoken.patched(model, METHODS[name]()) as handle, torch.no_grad():
        alone = []
        for inputs in rows:
            alone.append((model(**inputs).logits[0], summary_of(handle.records)))
        for side, inputs in batch.items():
            positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = model(**inputs, position_ids=positions).logits
            records = summary_of(handle.records)
            for row, (expected, expected_records) in enumerate(alone):
                width = expected.shape[0]
                got = logits[row, :width] if side == "right" else logits[row, -width:]
                assert (got - expected).abs().max() <= 1e-4, (side, row)
                mine = [r[:1] + r[2:] for r in records if r[1] == row]  # one image per row: image == row
                assert mine == [r[:1] + r[2:] for r in expected_records], (side, row)


# ----------------------------------------------------------------------------------------------- 3. copies
def _perturbed(model):
    """A deep copy of the unpatched `model` with its LM head changed (so that it generates differently)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.add_(torch.randn(twin.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return twin


def _logits(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, **GREEDY, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.cat(out.logits)


def test_deepcopy_of_a_patched_model_is_patched_on_its_own(llava4, prompts):
    """The copy prunes with its own weights and records (as a copy patched independently); the original's
    records stay those of its own last call, and unpatching the copy leaves the original patched."""
    model, _ = llava4
    reference = _perturbed(model)
    with vtoken.patched(reference, METHODS["fastv"]()):
        expected = _logits(reference, prompts[0])
    with vtoken.patched(model, METHODS["fastv"]()) as handle:
        own = _logits(model, prompts[1])
        own_records = summary_of(handle.records)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.lm_head.weight.copy_(reference.lm_head.weight)
        got = _logits(twin, prompts[0])
        assert summary_of(handle.records) == own_records
        twin_handle = vtoken.handle_of(twin)
        assert twin_handle is not None and twin_handle.adapter.model is twin
        assert [r.tokens_in for r in twin_handle.records if r.stage.startswith("prefill")] == [576]
        vtoken.unpatch(twin)
        assert torch.equal(_logits(model, prompts[1])[0], own[0])
    assert torch.equal(got[0], expected[0]) and (got[1] - expected[1]).abs().max() <= 1e-5
    assert "generate" not in twin.__dict__


def test_stale_generate_reference_stops_pruning_after_unpatch(llava4, prompts):
    model, _ = llava4
    stock = _logits(model, prompts[0])
    with vtoken.patched(model, METHODS["fastervlm"]()):
        stale = model.generate
        pruned = _logits(model, prompts[0])
    assert not torch.allclose(pruned[1], stock[1])  # the method changes this prompt's logits
    with torch.no_grad():
        out = stale(**prompts[0], **GREEDY, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock[0]) and torch.equal(torch.cat(out.logits), stock[1])


def test_users_own_generate_is_kept_and_restored(llava4, prompts):
    """An instance-level generate the user set before patch is what the patched model calls, and unpatch puts it
    back (rather than deleting it)."""
    model, _ = llava4
    calls = []
    stock = model.generate

    def own(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return stock(*args, **kwargs)

    model.generate = own
    try:
        with vtoken.patched(model, METHODS["fastervlm"]()), torch.no_grad():
            model.generate(**prompts[0], **GREEDY)
        assert len(calls) == 1 and calls[0] < prompts[0]["input_ids"].shape[1]  # it got the shrunk prompt
        assert model.__dict__.get("generate") is own
    finally:
        model.__dict__.pop("generate", None)


# ----------------------------------------------------------------------------------------------- 5. use_cache
@pytest.mark.parametrize("name", list(METHODS))
def test_use_cache_false_changes_nothing(llava4, prompts, name):
    model, _ = llava4
    with vtoken.patched(model, METHODS[name]()) as handle, torch.no_grad():
        cached = model.generate(**prompts[0], **GREEDY, output_logits=True, return_dict_in_generate=True)
        records = summary_of(handle.records)
        uncached = model.generate(**prompts[0], **GREEDY, use_cache=False, output_logits=True,
                                  return_dict_in_generate=True)  # fmt: skip
        assert summary_of(handle.records) == records
    assert torch.equal(uncached.sequences, cached.sequences)
    assert (torch.cat(uncached.logits) - torch.cat(cached.logits)).abs().max() <= 1e-4


# ----------------------------------------------------------------------------------------------- 6. batch records
@pytest.mark.parametrize("name", ["fastv", "mustdrop"])
def test_llm_stage_records_index_each_rows_own_visual_tokens(llava4, photos, name):
    """Rows with two images (1,152 visual tokens) and one image (576): every LLM-stage record's `kept` has
    `tokens_out` entries, indexes the row's own visual tokens, and equals the row's record run alone."""
    model, processor = llava4
    texts = [build_prompt(processor, "what differs between these?", num_images=2),
             build_prompt(processor, "what is this?")]  # fmt: skip
    images = [photos["astronaut"], photos["coffee"], photos["rocket"]]
    batched = processor(images=images, text=texts, return_tensors="pt", padding=True)
    singles = [processor(images=images[:2], text=texts[:1], return_tensors="pt"),
               processor(images=images[2:], text=texts[1:], return_tensors="pt")]  # fmt: skip
    with vtoken.patched(model, METHODS[name]()) as handle, torch.no_grad():
        model(**batched)
        records = [r for r in handle.records if r.stage.startswith("prefill")]
        alone = []
        for single in singles:
            model(**single)
            alone.append([r for r in handle.records if r.stage.startswith("prefill")])
    assert {r.image for r in records} == {0, 1}
    assert any(r.tokens_out < r.tokens_in for r in records)
    for record in records:
        assert len(record.kept) == record.tokens_out
        assert record.tokens_out == 0 or int(record.kept.max()) < record.tokens_in or record.stage != "prefill"
        (same,) = [r for r in alone[record.image] if r.stage == record.stage]
        assert (record.tokens_in, record.tokens_out) == (same.tokens_in, same.tokens_out)
        assert record.kept.tolist() == same.kept.tolist()
    if name == "fastv":
        assert [r.tokens_in for r in records] == [1152, 576]


# ----------------------------------------------------------------------------------------------- 7. labels
@pytest.mark.parametrize("name", ["fastv", "mustdrop"])
def test_labels_give_the_loss_over_the_kept_sequence(llava4, prompts, name):
    """With labels, the loss is the model's loss over the sequence the last layers ran on: the kept columns'
    labels (visual tokens have label -100), computed here by hand from the records."""
    model, _ = llava4
    inputs = prompts[0]
    image = model.config.image_token_id
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == image, -100)
    with vtoken.patched(model, METHODS[name]()) as handle, torch.no_grad():
        out = model(**inputs, labels=labels)
        prefill = [r for r in handle.records if r.stage.startswith("prefill")]
        final = prefill[-1].tokens_out
    assert final < prefill[0].tokens_in  # the prefill dropped tokens
    ids = inputs["input_ids"][0]
    first, last = (ids == image).nonzero()[[0, -1], 0].tolist()
    kept = torch.cat([labels[0, :first], torch.full((final,), -100), labels[0, last + 1 :]])
    assert out.logits.shape[1] == len(kept) < len(ids)
    expected = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), kept[1:], ignore_index=-100)
    assert abs(float(out.loss) - float(expected)) <= 1e-5


# ----------------------------------------------------------------------------------------------- 8. static caches
@pytest.mark.parametrize("name", ["fastv", "mustdrop"])
def test_static_cache_is_refused_before_anything_runs(llava4, prompts, name):
    model, _ = llava4
    calls = []
    hook = model.model.language_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with vtoken.patched(model, METHODS[name]()), torch.no_grad():
            with pytest.raises(vtoken.InputError, match="static"):
                model.generate(**prompts[0], **GREEDY, cache_implementation="static")
            cache = StaticCache(config=model.config.get_text_config(), max_cache_len=1024)
            with pytest.raises(vtoken.InputError, match="StaticCache"):
                model(**prompts[0], **hf.cache_kwargs(cache), use_cache=True)
    finally:
        hook.remove()
    assert calls == []


def test_encoder_methods_work_with_a_static_cache(llava4, prompts):
    model, _ = llava4
    with vtoken.patched(model, METHODS["fastervlm"]()), torch.no_grad():
        dynamic = model.generate(**prompts[0], **GREEDY)
        static = model.generate(**prompts[0], **GREEDY, cache_implementation="static")
    assert torch.equal(static, dynamic)


def test_max_length_counts_the_callers_prompt(llava4, prompts):
    """max_length (given, or from the model's generation config) counts the caller's prompt: a patched model stops
    where the stock one does, and one shorter than the prompt fails with the stock message, naming the caller's
    lengths."""
    model, _ = llava4
    length = prompts[0]["input_ids"].shape[1]
    errors, outputs = [], []
    config = model.generation_config
    for patched in (False, True):
        with vtoken.patched(model, METHODS["fastervlm"]()) if patched else contextlib.nullcontext(), torch.no_grad():
            with pytest.raises(ValueError) as error:
                model.generate(**prompts[0], do_sample=False, max_length=length - 10)
            errors.append(str(error.value))
            outputs.append(model.generate(**prompts[0], do_sample=False, max_length=length + 3).shape[1])
            config.max_length = length + 2
            try:
                outputs.append(model.generate(**prompts[0], do_sample=False).shape[1])
            finally:
                config.max_length = None
    assert str(length) in errors[0] and errors[0] == errors[1]
    assert outputs == [length + 3, length + 2] * 2


# ----------------------------------------------------------------------------------------------- 10. pickling
def test_a_patched_model_pickles_and_the_copy_is_patched_on_its_own(prompts):
    """torch.save / torch.load round trip of a patched model: the loaded copy is patched on its own (same outputs
    and records as the original, its own handle), and unpatching it gives the stock model. (A fresh model: in
    transformers 5.23 the first call installs output-capturing hooks that the stock model cannot pickle either.)"""
    model, _ = tiny_llava(text_layers=4)
    with vtoken.patched(model, METHODS["mustdrop"]()) as handle:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        expected = _logits(model, prompts[0])
        records = summary_of(handle.records)
        twin = vtoken.handle_of(loaded)
        assert twin is not None and twin is not handle and twin.adapter.model is loaded
        got = _logits(loaded, prompts[0])
        assert torch.equal(got[0], expected[0]) and (got[1] - expected[1]).abs().max() <= 1e-5
        assert summary_of(twin.records) == records
        vtoken.unpatch(loaded)
        assert vtoken.handle_of(model) is handle
    stock = _logits(model, prompts[0])
    assert not torch.allclose(stock[1], expected[1])
    unpatched = _logits(loaded, prompts[0])
    assert torch.equal(unpatched[0], stock[0]) and torch.equal(unpatched[1], stock[1])


# ----------------------------------------------------------------------------------------------- 11. assisted decoding
ASSISTED = {"assistant_model": None, "prompt_lookup_num_tokens": 3}  # None: an unpatched copy of the model


def _assisted(model, kind):
    return {kind: copy.deepcopy(model) if kind == "assistant_model" else ASSISTED[kind]}


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl", "tiny-internvl", "tiny-gemma3"])
def test_assisted_decoding_with_an_encoder_stage_is_plain_greedy(name, photos):
    """An assistant model (an unpatched copy, handed the pruned prompt and features as transformers hands it the
    main model's) gives exactly the patched model's plain greedy tokens."""
    model, processor = TINY_MODELS[name]()
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is in the image?"])
    extra = _assisted(model, "assistant_model")
    with vtoken.patched(model, vtoken.Random(budget=0.25)), torch.no_grad():
        plain = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assisted = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, **extra)
    assert torch.equal(assisted, plain)


INSIDE_THE_LLM = {
    "fastv": lambda: vtoken.FastV(layer=2, keep=0.25),
    "mustdrop": METHODS["mustdrop"],
    "sparse_prefill": lambda: vtoken.SparsePrefill(pattern="a_shape", min_length=16, block_size=16),
}


@pytest.mark.parametrize("kind", list(ASSISTED))
@pytest.mark.parametrize("name", list(INSIDE_THE_LLM))
def test_assisted_decoding_with_a_stage_inside_the_llm_is_refused_first(llava4, prompts, name, kind):
    """Assisted decoding runs the prompt with the first candidates and crops the cache on rejection (FastV and
    MustDrop gave other tokens, or failed mid-generate contradicting themselves): refused before anything runs,
    naming assisted decoding and the method; with generation-config settings too."""
    model, _ = llava4
    calls = []
    hook = model.model.language_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with vtoken.patched(model, INSIDE_THE_LLM[name]()), torch.no_grad():
            with pytest.raises(vtoken.InputError, match=f"assisted decoding \\({kind}=\\).*{name}"):
                model.generate(**prompts[0], **GREEDY, **_assisted(model, kind))
            if kind == "prompt_lookup_num_tokens":
                config = copy.deepcopy(model.generation_config)
                config.prompt_lookup_num_tokens = 3
                with pytest.raises(vtoken.InputError, match="assisted decoding"):
                    model.generate(**prompts[0], max_new_tokens=3, generation_config=config)
    finally:
        hook.remove()
    assert calls == []


def test_prompt_lookup_with_images_and_assisted_turns_on_a_cache_are_refused_first(llava4, prompts):
    """Prompt lookup proposes the prompt's image placeholders as candidates (transformers fails with a feature
    count mismatch, unpatched too); assisted decoding on a cache runs the cached tokens again (other tokens than
    plain decoding, unpatched too): both refused before anything runs, naming the reason."""
    model, _ = llava4
    with torch.no_grad():
        with pytest.raises(ValueError, match="do not match"):  # the stock failure this replaces
            model.generate(**prompts[0], **GREEDY, prompt_lookup_num_tokens=3)
    calls = []
    with vtoken.patched(model, METHODS["fastervlm"]()), torch.no_grad():
        first = model.generate(**prompts[0], **GREEDY, return_dict_in_generate=True)
        hook = model.model.language_model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(vtoken.InputError, match="prompt lookup .* image placeholders"):
                model.generate(**prompts[0], **GREEDY, prompt_lookup_num_tokens=3)
            ids = torch.cat([first.sequences, first.sequences[:, -3:]], dim=1)
            for kind in ASSISTED:
                with pytest.raises(vtoken.InputError, match="does not continue from a cache"):
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **GREEDY,
                                   **hf.cache_kwargs(hf.cache_out(first)), **_assisted(model, kind))  # fmt: skip
        finally:
            hook.remove()
    assert calls == []


# ----------------------------------------------------------------------------------------------- 12. torch.compile
# Each compiled case traces the whole model (~15-30 s here on CPU), so the suite compiles one family per adapter path
# (1-D RoPE with a [CLS] probe, InternVL's probe with QK-norm, M-RoPE with DeepStack, the hybrid LLM) with the "eager"
# backend, and LLaVA with "aot_eager" and "inductor" too (inductor: ~45 s of C++ compilation, fused kernels round
# differently: logits within 1e-5); VTOKEN_COMPILE_FAMILIES=all runs every family.
COMPILED = ["tiny-llava", "tiny-internvl", "tiny-qwen3-vl", "tiny-qwen3.5"]
if os.environ.get("VTOKEN_COMPILE_FAMILIES") == "all":
    COMPILED = sorted(TINY_MODELS)


def _stack(model, name):
    """An encoder method ([CLS]-scored FasterVLM where the tower has [CLS]) and FastV where the family takes it."""
    cls = name in ("tiny-llava", "tiny-internvl", "tiny-llava-next", "tiny-video-llava", "tiny-llava-next-video")
    stack = [vtoken.FasterVLM(budget=0.25) if cls else vtoken.Random(budget=0.25)]
    if name != "tiny-gemma3":
        text = model.config.get_text_config()
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        stack.append(vtoken.FastV(layer=types.index("full_attention"), keep=0.5))
    return stack


@pytest.mark.parametrize(
    ("name", "backend"), [(n, "eager") for n in COMPILED] + [("tiny-llava", "aot_eager"), ("tiny-llava", "inductor")]
)
def test_compiling_after_patch_equals_the_uncompiled_patched_model(name, backend, photos):
    """Compiled after patch (`model.compile()`; `torch.compile(model)`'s wrapper with aot_eager): logits, records
    and greedy tokens equal the uncompiled patched model's (vtoken's hooks run eagerly, so the [CLS] probes fire);
    unpatching leaves the stock model's outputs."""
    model, processor = TINY_MODELS[name]()
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is in the image?"])
    with torch.no_grad():
        stock = model(**inputs).logits
        with vtoken.patched(model, _stack(model, name)) as handle:
            logits = model(**inputs).logits
            tokens = greedy(model, inputs, 2)
            records = summary_of(handle.records)
            if backend == "aot_eager":  # the wrapper runs the patched model; its generate is the model's
                compiled = torch.compile(model, backend=backend)
            else:
                model.compile(backend=backend)
                compiled = model
            got = compiled(**inputs).logits
            got_records = summary_of(handle.records)
            got_tokens = greedy(compiled, inputs, 2)
        after = compiled(**inputs).logits
    torch._dynamo.reset()
    assert logits.shape[1] < stock.shape[1]  # pruned
    close = torch.equal if backend != "inductor" else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)
    assert close(got, logits) and got_records == records
    if backend == "inductor":  # its kernels round differently: equal ids up to a near-tie (tests/near_ties.py)
        assert_same_greedy(got_tokens, tokens, 1e-5, min_steps=1)
    else:
        assert torch.equal(got_tokens[0], tokens[0])
    assert close(after, stock)


def test_patching_a_compiled_wrapper_names_the_model_to_patch(llava4):
    """`vtoken.patch(torch.compile(model))` is refused, naming `model._orig_mod`; the model stays unpatched."""
    model, _ = llava4
    wrapper = torch.compile(model, backend="eager")
    with pytest.raises(vtoken.UnsupportedModelError, match=r"model\._orig_mod"):
        vtoken.patch(wrapper, "fastervlm", budget=0.25)
    assert vtoken.handle_of(model) is None


# ----------------------------------------------------------------------------------------------- 13. sparse prefill
def _lm_inputs_and_hidden(model, inputs):
    """One forward: the LLM's keyword inputs and its last hidden state."""
    seen = {}
    hooks = [
        model.model.language_model.register_forward_pre_hook(
            lambda m, a, kw: seen.update(kwargs={k: v for k, v in kw.items() if k not in (hf.CACHE_KWARG,
                                                                                          "use_cache")}),
            with_kwargs=True,
        ),
        model.model.language_model.register_forward_hook(lambda m, a, out: seen.update(hidden=out.last_hidden_state)),
    ]  # fmt: skip
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["kwargs"], seen["hidden"]


def _masked_lm(model, lm_kwargs, blocks, block):
    """The unpatched language model on captured inputs under the token mask of a block mask [1, Qb, Kb] (causal)."""
    length = lm_kwargs["inputs_embeds"].shape[1]
    mask = blocks.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :length, :length]
    mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    with torch.no_grad():
        return model.model.language_model(**dict(lm_kwargs, attention_mask=mask[:, None]), use_cache=False)


def _clip(frames, side):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    return [Image.fromarray(np.roll(base, 8 * i, axis=1)) for i in range(frames)]


def _frames_found_by_hand(name, model, ids):
    """[F, 2] (start, end) columns of a one-video prompt's frames, read off the prompt: Qwen3-VL's runs of video
    placeholders (one per temporal patch, timestamps between); InternVL's image runs (one per frame, no image)."""
    token = model.config.video_token_id if name == "tiny-qwen3-vl" else model.config.image_token_id
    flags = torch.cat([torch.tensor([0]), (ids == token).long(), torch.tensor([0])]).diff()
    return torch.stack([(flags == 1).nonzero().squeeze(1), (flags == -1).nonzero().squeeze(1)], 1)


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-internvl"])
def test_grid_plans_sparse_blocks_on_videos_whose_frames_are_separate_runs(name):
    """Qwen3-VL (timestamps between temporal patches) and InternVL ("FrameN:" image runs): the grid pattern plans
    real sparse blocks (ran dense before), and the LLM's output equals the unpatched LLM under the token mask of the
    frames read off the prompt here."""
    from vtoken.methods.sparse_prefill import frame_grid_blocks

    model, processor = TINY_MODELS[name]()
    prompt = build_prompt(processor, "what happens?", num_images=0, num_videos=1)
    if name == "tiny-qwen3-vl":  # 4 temporal patches of 11 x 11 tokens
        size = {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 1024}
        inputs = processor(videos=[_clip(8, 448)], text=[prompt], return_tensors="pt", do_sample_frames=False,
                           size=size)  # fmt: skip
    else:  # 4 frames of 16 x 16 tokens
        inputs = processor(videos=[_clip(4, 224)], text=[prompt], return_tensors="pt")
    ids = inputs["input_ids"][0]
    frames = _frames_found_by_hand(name, model, ids)
    assert len(frames) > 2 and bool((frames[1:, 0] > frames[:-1, 1]).all())  # text between the frames
    block, window = 16, 16
    lm_kwargs, dense = _lm_inputs_and_hidden(model, inputs)
    method = vtoken.SparsePrefill(pattern="grid", sink=0, window=window, block_size=block, min_length=16)
    with vtoken.patched(model, method) as handle:
        _, hidden = _lm_inputs_and_hidden(model, inputs)
        records = handle.records
    assert [r.stage for r in records] == [f"sparse.layer{i}" for i in range(len(model.model.language_model.layers))]
    assert all(r.extra["density"] < 0.8 for r in records)
    blocks = frame_grid_blocks(len(ids), block, [[frames]], 0, window)
    want = _masked_lm(model, lm_kwargs, blocks, block).last_hidden_state
    assert (hidden - want).abs().max() <= 1e-5 and (hidden - dense).abs().max() > 1e-3


def test_frame_grid_blocks_follow_frames_with_text_between():
    """Frames of 40 tokens with 5 text tokens between them: a query block inside a frame keeps the blocks of the
    same positions in every earlier frame and the text before the video; blocks holding text stay dense."""
    from vtoken.methods.sparse_prefill import frame_grid_blocks

    seq, block, length, gap = 400, 8, 40, 5
    starts = torch.arange(30, 30 + 6 * (length + gap), length + gap)
    frames = torch.stack([starts, starts + length], 1)
    mask = frame_grid_blocks(seq, block, [[frames]], 0, 8)[0]
    n = mask.shape[0]
    frame_of = {c: (f, c - int(s)) for f, (s, e) in enumerate(frames.tolist()) for c in range(s, e)}
    inside = []
    for qb in range(n):
        columns = range(qb * block, (qb + 1) * block)
        if not all(c in frame_of for c in columns):
            assert bool(mask[qb, : qb + 1].all()) and not bool(mask[qb, qb + 1 :].any())  # dense, causal
            continue
        for c in columns:
            f, offset = frame_of[c]
            for earlier in range(f):  # the same spatial position in every earlier frame
                assert bool(mask[qb, (int(frames[earlier, 0]) + offset) // block])
        assert bool(mask[qb, : (30 - 1) // block + 1].all())  # the text before the video
        inside.append(qb)
    assert len(inside) > n / 3 and mask[inside].sum() < 0.6 * sum(qb + 1 for qb in inside)  # the frames' rows sparse


def test_qwen3_5_sparse_prefill_runs_on_its_full_attention_layers(photos):
    """Qwen3.5's hybrid LLM: sparse prefill takes its full-attention layers (the linear-attention layers keep their
    recurrent path), equal to the unpatched LLM under the A-shape mask; naming a linear layer is refused, saying
    which layers are attention."""
    model, processor = TINY_MODELS["tiny-qwen3.5"]()
    inputs = inputs_for(processor, [photos["coffee"]], ["what is in the image?"])
    length = inputs["input_ids"].shape[1]
    lm_kwargs, dense = _lm_inputs_and_hidden(model, inputs)
    method = vtoken.SparsePrefill(pattern="a_shape", sink=16, window=16, block_size=16, min_length=16)
    with vtoken.patched(model, method) as handle:
        _, hidden = _lm_inputs_and_hidden(model, inputs)
        records = handle.records
    types = model.config.text_config.layer_types
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    assert [r.stage for r in records] == [f"sparse.layer{i}" for i in full] and all(
        r.extra["density"] < 1 for r in records
    )
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = ((j <= i) & ((j < 16) | (i - j < 16)))[None, None]
    with torch.no_grad():
        want = model.model.language_model(**dict(lm_kwargs, attention_mask=allowed), use_cache=False)
    assert (hidden - want.last_hidden_state).abs().max() <= 1e-5 and (hidden - dense).abs().max() > 1e-3
    linear = types.index("linear_attention")
    with pytest.raises(vtoken.VTokenError, match=rf"layers \[{linear}\] .* not softmax attention.*{full}"):
        vtoken.patch(model, vtoken.SparsePrefill(layers=[linear, full[0]]))
    assert vtoken.handle_of(model) is None


# ----------------------------------------------------------------------------------------------- 14. the CLI
def test_cli_refuses_an_empty_prompt_instead_of_answering_another(capsys):
    """`vtoken run --prompt ''` (or blank) is an error naming --prompt; it used to answer the default question."""
    from vtoken.cli import main

    for prompt in ("", "   "):
        assert main(["run", "--model", "tiny-llava", "--prompt", prompt, "--repeats", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--prompt is empty" in err


def test_cli_names_the_minimum_frames_of_a_one_frame_video(tmp_path, capsys):
    """A 1-frame GIF on Qwen3-VL: one line naming the 2 frames its processor needs (a transformers traceback
    before); with 2 frames the same call runs."""
    from vtoken.cli import main
    from vtoken.images import example_clip

    for frames in (1, 2):
        path = tmp_path / f"clip{frames}.gif"
        clip = example_clip(frames)
        clip[0].save(path, save_all=True, append_images=clip[1:], duration=100)
        code = main(["run", "--model", "tiny-qwen3-vl", "--video", str(path), "--method", "random",
                     "--repeats", "1", "--max-new-tokens", "1"])  # fmt: skip
        captured = capsys.readouterr()
        if frames == 1:
            assert code == 2 and captured.err.count("\n") == 1
            assert "gave 1 frame(s)" in captured.err and "needs at least 2" in captured.err
        else:
            assert code == 0, captured.err


# ----------------------------------------------------------------------------------------------- 15. messages
def _hooks_of(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(
    ("name", "method", "needles"),
    [
        # HiRED on PerceptionLM: the tile grid its split needs (it blamed a missing cls_attention@0)
        ("tiny-perception-lm", lambda: vtoken.HiRED(budget=0.25), ["tile grid", "fastervlm, random"]),
        # a [CLS] layer the tower lacks: the signal, the layers it has
        ("tiny-llava", lambda: vtoken.HiRED(budget=0.25, layer_early=99), ["cls_attention@99", "layers 0..2"]),
        # grid on a family that takes no video (InternVL takes videos: test_grid_plans_sparse_blocks_...)
        ("tiny-gemma3", lambda: vtoken.SparsePrefill(pattern="grid"), ["follows video frames", "a_shape"]),
    ],
)
def test_refusals_at_patch_name_the_cause_and_the_fix(name, method, needles):
    model, _ = TINY_MODELS[name]()
    hooks = _hooks_of(model)
    with pytest.raises(vtoken.VTokenError) as error:
        vtoken.patch(model, method())
    assert all(needle in str(error.value) for needle in needles), str(error.value)
    assert vtoken.handle_of(model) is None and _hooks_of(model) == hooks


def test_functional_encode_names_an_out_of_range_signal(llava4, prompts):
    """`cls_attention@99` on a 3-block tower: the signal and the accepted range (it said only 'layer=99')."""
    from vtoken.functional import encode

    model, _ = llava4
    with pytest.raises(vtoken.VTokenError, match=r"signal 'cls_attention@99' .* 3 blocks .* \[-3, 2\]"):
        encode(model.model.vision_tower, prompts[0]["pixel_values"], signals=["cls_attention@99"])
