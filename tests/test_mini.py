"""The shipped vtoken-mini: a stock LLaVA-1.5 checkpoint inside the package, loaded offline, scored on a fixed
200-question test slice, and a FasterVLM retention number on it (thresholds live in the benchmark).

The shipped model scores 0.92 on this slice (colour 1.0, read 1.0, shape 0.95, count 0.825, presence 0.825):
the issue's 0.9 is the overall threshold, and each type must also beat always giving its most common answer.
"""

from collections import Counter

import pytest
import torch

import vtoken
from vtoken.mini import vqa
from vtoken.mini.evaluate import evaluate
from vtoken.mini.model import WEIGHTS, load, pixel_values
from vtoken.zoo import build_prompt

SLICE = vqa.question_set("test", 200)  # 40 questions of each type, 200 different images
TARGET = 0.9  # the goal; the shipped model: 0.92
# the shipped model: 1.0, 1.0, 0.95, 0.825, 0.825; majority answer: 0.275, 0.15, 0.275, 0.475, 0.55
MIN_BY_TYPE = {"colour": 0.9, "read": 0.9, "shape": 0.85, "count": 0.7, "presence": 0.75}
ABOVE_MAJORITY = 0.2  # each type in MIN_BY_TYPE also beats always giving its most common answer by this much


@pytest.fixture(scope="module")
def mini():
    return load()


@pytest.fixture(scope="module")
def unpruned(mini):
    return evaluate(*mini, SLICE)


def majority_baseline(kind: str | None = None) -> float:
    """Accuracy of always giving each type's most common answer on the slice (independent of any model)."""
    asked = [q for _, q in SLICE if kind in (None, q.kind)]
    best = {k: Counter(q.answer for q in asked if q.kind == k).most_common(1) for k in vqa.QUESTION_TYPES}
    return sum(b[0][1] for b in best.values() if b) / len(asked)


def test_shipped_weights_are_a_stock_llava_1_5_checkpoint(mini):
    from transformers import CLIPVisionModel, LlavaForConditionalGeneration

    model, processor = mini
    assert (WEIGHTS / "model.safetensors").stat().st_size <= 25 * 2**20
    assert isinstance(model, LlavaForConditionalGeneration)
    assert isinstance(model.model.vision_tower, CLIPVisionModel)
    assert model.config.vision_feature_layer == -2 and model.config.vision_feature_select_strategy == "default"
    image, questions = vqa.sample("test", 0)
    inputs = processor(images=[image], text=[build_prompt(processor, questions[0].text)], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 12 * 12
    # training fed pixels without the processor's resize: they must be what the processor gives
    assert torch.allclose(inputs["pixel_values"], pixel_values([image], processor), atol=1e-5)


def test_unpruned_accuracy_on_the_test_slice(unpruned):
    accuracy = unpruned.accuracy()
    print("unpruned accuracy:", {k: round(v, 3) for k, v in accuracy.items()})
    assert set(unpruned.answers) <= set(vqa.vocabulary())  # one-word answers from the task's own vocabulary
    assert accuracy["all"] >= TARGET
    for kind, least in MIN_BY_TYPE.items():  # it reads the image
        assert accuracy[kind] >= max(least, majority_baseline(kind) + ABOVE_MAJORITY), kind


def test_fastervlm_retention_at_25_percent(mini, unpruned):
    model, processor = mini
    with vtoken.patched(model, "fastervlm", budget=0.25):
        pruned = evaluate(model, processor, SLICE)
    assert all(t == 36 for t in pruned.tokens) and all(len(k) == 36 for k in pruned.kept)
    retention = pruned.accuracy()["all"] / unpruned.accuracy()["all"]
    print(f"FasterVLM at 25 %: accuracy {pruned.accuracy()['all']:.3f}, retention {retention:.3f}")
    assert 0.0 <= retention <= 1.0
