"""One definition of "visual tokens" (vtoken.counts): the image/video positions of the LLM's input, counted the
same way unpatched and patched, checked against the LLM's input read by hand (the rows of `inputs_embeds`)."""

import pytest
import torch
from conftest import captured_llm_input, make_image

import vtoken
from vtoken.counts import VisualCounts, count, llm_input, placeholders
from vtoken.records import Record, summarize
from vtoken.zoo import build_prompt, tiny_llava, tiny_llava_next


def _inputs(processor, size=(500, 400)):
    return processor(images=[make_image(*size)], text=[build_prompt(processor, "what is it?")], return_tensors="pt")


def _embeds(model, inputs, methods=None):
    """The LLM's input embeddings [L, D] of a forward (patched with `methods` if given), read by a hook."""
    if methods is None:
        return captured_llm_input(model, inputs)[0]
    with vtoken.patched(model, methods):
        return captured_llm_input(model, inputs)[0]


def _counted(model, inputs, methods):
    with vtoken.patched(model, methods) as handle, llm_input(model) as lengths, torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        records = list(handle.records)
    return count(model, inputs, lengths, records), records


@pytest.fixture(scope="module")
def llava_next():
    torch.manual_seed(0)
    return tiny_llava_next()


def test_llava_next_counts_the_same_input_the_same_way(llava_next):
    """The issue's case: the unpatched row counted 2,928 (patches + newline separators) and the patched rows 2,880
    (patches only). Now a keep-all patch reads "all N kept" with the same N as the unpatched prompt."""
    model, processor = llava_next
    inputs = _inputs(processor)
    unpatched = placeholders(model, inputs["input_ids"])[0]
    counted, records = _counted(model, inputs, [vtoken.Random(budget=1.0)])
    assert (
        counted.unpatched == unpatched and counted.llm_input == unpatched and counted.text() == f"all {unpatched} kept"
    )
    patches = sum(r.tokens_in for r in records if r.stage == "encoder")
    newline = model.model.image_newline.detach()
    embeds = _embeds(model, inputs)
    separators = int((embeds == newline).all(dim=1).sum())  # newline rows of the unpatched LLM input, by hand
    assert separators > 0 and unpatched == patches + separators  # the LLM's input = patches + separators


def test_llava_next_pruned_count_is_what_the_llm_receives(llava_next):
    model, processor = llava_next
    inputs = _inputs(processor)
    counted, records = _counted(model, inputs, [vtoken.Pool(budget=0.25)])
    kept_patches = sum(r.tokens_out for r in records if r.stage == "encoder")
    embeds = _embeds(model, inputs, [vtoken.Pool(budget=0.25)])
    separators = int((embeds == model.model.image_newline.detach()).all(dim=1).sum())
    text = inputs["input_ids"].shape[1] - counted.unpatched
    assert counted.llm_input == kept_patches + separators == embeds.shape[0] - text
    assert (
        counted.text()
        == f"{counted.unpatched} -> {counted.llm_input} ({counted.llm_input / counted.unpatched:.1%} kept)"
    )


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    return tiny_llava()


def test_keep_all_stages_say_all_kept_never_zero(llava):
    """Sparse prefill keeps every token (it skips attention work instead): "all 576 kept", not "0 -> 0"."""
    model, processor = llava
    inputs = _inputs(processor)
    sparse = vtoken.SparsePrefill(min_length=64, block_size=16, sink=4)
    counted, records = _counted(model, inputs, [sparse])
    assert counted == VisualCounts(576, 576, []) and counted.text() == "all 576 kept"
    assert "0 -> 0" not in summarize(records)


def test_prefill_stages_are_reported_after_their_layer_not_as_the_input(llava):
    model, processor = llava
    inputs = _inputs(processor)
    counted, records = _counted(model, inputs, [vtoken.FastV(layer=0, keep=0.5)])
    assert counted.llm_input == counted.unpatched == 576  # FastV does not shorten the LLM's input
    assert counted.inside == [("prefill.layer0", 288)]
    assert counted.text() == "all 576 kept; after LLM layer 0: 288"
    assert "prefill.layer0: 576 -> 288 visual tokens after LLM layer 0 (50.0% kept)" in summarize(records)


def test_summary_never_calls_cache_entries_visual_tokens():
    def record(stage, tin, tout):
        return Record(stage, "m", 0, 0, tin, tout, None, (1, tin), None)

    class NoTimer:
        seconds = 0.0

    records = [record("encoder.merge", 576, 400), record("encoder.keyset", 400, 32), record("prefill.layer2", 400, 250),
               record("decode.kv", 400, 100), record("encoder", 144, 144)]  # fmt: skip
    for r in records:
        r.timer = NoTimer()
    lines = summarize(records).splitlines()
    assert "encoder.merge: 576 -> 400 selected (69.4% kept)" in lines
    assert "encoder.keyset: 32 of 400 tokens marked as keys (none removed)" in lines
    assert "decode.kv: the KV cache keeps 100 of 400 visual entries per layer (25.0% kept)" in lines
    assert "encoder: all 144 kept" in lines
    assert not any("decode.kv" in line and "visual tokens" in line for line in lines)
