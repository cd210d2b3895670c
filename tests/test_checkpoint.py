"""The real loading path: a checkpoint saved with save_pretrained, loaded through AutoModelForImageTextToText."""

import pytest
import torch
from conftest import OTHER_TINY_MODELS, inputs_for

import vtoken
from vtoken.zoo import load


def test_saved_checkpoint_loads_offline_and_patches(llava, photos, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load(str(tmp_path))
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    assert torch.equal(
        inputs_for(loaded_processor, [photos["astronaut"]], ["what is in the image?"])["input_ids"], inputs["input_ids"]
    )
    with torch.no_grad():
        with vtoken.patched(model, "fastervlm", budget=0.25):
            expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        with vtoken.patched(loaded, "fastervlm", budget=0.25) as handle:
            got = loaded.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected) and handle.records[0].tokens_out == 144


def test_unknown_model_name_is_named():

    with pytest.raises(vtoken.VTokenError, match="tiny-llava"):
        load("not-a-model")


@pytest.mark.parametrize("name", OTHER_TINY_MODELS)
def test_every_family_round_trips_through_from_pretrained(name, tmp_path, monkeypatch):
    from conftest import make_image

    from vtoken.zoo import TINY_MODELS, build_prompt

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = TINY_MODELS[name]()
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load(str(tmp_path))
    assert type(loaded) is type(model)
    inputs = loaded_processor(
        images=[make_image(500, 300)], text=[build_prompt(loaded_processor, "what?")], return_tensors="pt"
    )
    with torch.no_grad():
        with vtoken.patched(model, "random", budget=0.25):
            expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        with vtoken.patched(loaded, "random", budget=0.25) as handle:
            got = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected) and handle.records


def test_mmtok_finds_the_tokenizer_of_a_checkpoint_loaded_without_vtoken(llava, photos, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()  # vtoken never saw its processor
    inputs = inputs_for(processor, [photos["coffee"]], ["what colour is the object?"])
    with torch.no_grad():
        with vtoken.patched(model, "mmtok", budget=40) as handle:
            model(**inputs)
            expected = handle.records[0].kept
        with vtoken.patched(loaded, "mmtok", budget=40) as handle:
            loaded(**inputs)
    assert torch.equal(handle.records[0].kept, expected)
