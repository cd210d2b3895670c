"""The real loading path: a checkpoint saved with save_pretrained, loaded through AutoModelForImageTextToText."""

import torch
from conftest import inputs_for

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
    import pytest

    with pytest.raises(vtoken.VTokenError, match="tiny-llava"):
        load("not-a-model")
