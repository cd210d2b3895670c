"""The encoder stage checks what a method returns, once, where the engine takes it (issue 44.5).

Tried as a plugin author would: a method whose `score()` returns a wrong shape, one on another device, one returning
NaN scores, one whose `select()` returns something else than a `Selection` of the crops. Each gets a `VTokenError`
naming the method, what it returned and what was expected, from `vtoken.patch`'s generate, `vtoken.select` and the
stage itself, and the model stays intact (after `unpatch` it gives the unpatched logits exactly). Before the stage
checked them: torch's "selected index k out of range", "Tensor on device meta is not on the expected device cpu!",
and NaN scores ran silently and kept an arbitrary set.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import inputs_for

import vtoken
from vtoken.stages import EncoderStage
from vtoken.tokens import Selection, VisualTokens


@dataclass
class BadScores(vtoken.ScoreMethod):
    """Scores gone wrong in one of the ways a plugin's can: `fault` says which."""

    fault: str = "shape"

    name = "bad_scores"
    requires = ("vision_features",)

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        norms = tokens.signals["vision_features"].float().norm(dim=-1)  # [C, N]
        if self.fault == "shape":
            return norms[:, :-3]  # a grid cut short
        if self.fault == "meta":
            return norms.to("meta")
        if self.fault == "nan":
            return norms.masked_fill(torch.arange(norms.shape[1]) % 5 == 0, float("nan"))
        if self.fault == "int":
            return norms.long()
        return norms


@dataclass
class BadSelect(vtoken.EncoderMethod):
    """A `select()` returning what the engine does not take."""

    fault: str = "rows"

    name = "bad_select"

    def select(self, tokens: VisualTokens):
        keep = torch.arange(4).expand(tokens.num_crops, -1)
        if self.fault == "rows":
            return Selection(kept=keep[:1])  # one row for every crop
        if self.fault == "float":
            return Selection(kept=keep.float())
        if self.fault == "type":
            return keep
        return Selection(kept=keep)


FAULTS = {
    BadScores: {
        "shape": r"bad_scores\.score\(\) returned scores of shape \(1, 573\); expected \[C, N\] = \[1, 576\]",
        "meta": r"bad_scores\.score\(\) returned scores on meta; expected the features' device, cpu",
        "nan": r"bad_scores\.score\(\) returned NaN or \+inf scores",
        "int": r"bad_scores\.score\(\) returned scores of dtype torch\.int64; expected a floating-point tensor",
    },
    BadSelect: {
        "rows": r"bad_select\.select\(\) returned kept of shape \(1, 4\); expected \[2, k\]",
        "float": r"bad_select\.select\(\) returned kept indices of dtype torch\.float32; expected torch\.int64",
        "type": r"bad_select\.select\(\) returned Tensor; expected a vtoken\.Selection",
    },
}
CASES = [(cls, fault, message) for cls, faults in FAULTS.items() for fault, message in faults.items()]


def _tokens(crops: int) -> VisualTokens:
    features = torch.randn(crops, 576, 8, generator=torch.Generator().manual_seed(0))
    return VisualTokens(features, (24, 24), {}, torch.arange(crops))


@pytest.mark.parametrize(("cls", "fault", "message"), CASES, ids=[f"{c.__name__}-{f}" for c, f, _ in CASES])
def test_the_stage_names_what_a_method_returned(cls, fault, message):
    crops = 2 if cls is BadSelect else 1
    with pytest.raises(vtoken.VTokenError, match=message):
        EncoderStage(cls(fault=fault)).select(_tokens(crops))
    EncoderStage(cls(fault="none")).select(_tokens(crops))  # the same method without the fault passes


@pytest.mark.parametrize("fault", ["shape", "meta", "nan"])
def test_through_select(fault):
    features = torch.randn(1, 576, 8)
    with pytest.raises(vtoken.VTokenError, match=FAULTS[BadScores][fault]):
        vtoken.select(BadScores(fault=fault), features)


@pytest.mark.parametrize("fault", ["shape", "meta", "nan"])
def test_through_patch_the_model_stays_intact(llava, photos, fault):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is it?"])
    with torch.no_grad():
        before = model(**inputs).logits
    handle = vtoken.patch(model, BadScores(fault=fault, budget=0.25))
    try:
        with pytest.raises(vtoken.VTokenError, match=FAULTS[BadScores][fault]):
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
        with pytest.raises(vtoken.VTokenError, match=FAULTS[BadScores][fault]):
            model(**inputs)
    finally:
        handle.unpatch()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


def test_finite_scores_are_checked_on_the_device_without_a_sync():
    """The NaN check is one device-side assert (no read back): on the CPU it raises at once, on CUDA it would end
    the call with a device-side assert."""
    from vtoken.launches import count_launches

    stage = EncoderStage(BadScores(fault="none"))
    with count_launches() as counted:
        stage.select(_tokens(2))
    assert counted.syncs == 0, counted.describe()
    assert counted.ops["_assert_async"] == 1, counted.describe()
