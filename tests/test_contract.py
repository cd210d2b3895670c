"""The contract every method keeps on every family (DESIGN.md's invariants), held once: one table over every
registered method x every tiny family x every input the family takes, where `vtoken.applicable_methods` says the
method applies (tests/contract.py derives the cases; no list of methods or families is kept by hand). A new method
or family joins every row by registering; a method's own file holds only what is its own (its reference
equality, its defects).

Rows:
- identity (invariant 1): keeping every token gives the unpatched logits (<= 1e-5, fp32) and greedy ids (up to a
  near-tie, tests/near_ties.py);
- batch (5): a padded batch of two rows gives each row's greedy ids alone (within 1e-4, the near-tie policy);
- records and exact budget (3): a pruning run generates, its records say what reached the LLM (the LLM's input
  and the layer after each LLM drop shrink by exactly the dropped tokens), and a method that knows its count
  before the data (`planned_count`) keeps exactly it;
- restore (4): `unpatch` leaves tensors, modules, hooks, attention implementations, the model's attributes and
  its outputs exactly as before; patching twice is a clear error that keeps the first patch;
- clear errors (8): a method refused on a family (a missing signal, stage or modality) raises the documented
  error at `patch`, an input a patched method refuses raises at the call, a bad value of any declared parameter
  raises at construction naming the method and the parameter, and each leaves the model exactly intact;
- docs: docs/guide/methods.md's family tables say "n/a" exactly where `applicable_methods` refuses.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy
from contract import (
    FAMILIES,
    KEEP_ALL,
    METHODS,
    NO_KEEP_ALL,
    PRUNING,
    accepted_words,
    all_cases,
    assert_same_snapshot,
    docs_refuses,
    every_param_is_declared,
    expected_count,
    greedy,
    inputs,
    keep_all,
    keeps_a_count,
    native_cases,
    parameter_cases,
    pruning,
    reference,
    refused_call_cases,
    refused_patch_cases,
    snapshot,
    takes,
    tiny,
    verdicts,
    view,
)

import vtoken
from vtoken.methods.base import unmet
from vtoken.params import Kept, own
from vtoken.registry import make_method, method_class

ENCODER_OUTPUT = ("encoder", "encoder.merge")  # the encoder's records of what goes on to the LLM (MustDrop merges
# in the tower; its "encoder.keyset" is a subset its LLM stages keep, not what the LLM receives)


def before_llm(records) -> list:
    """The records of what went on to the LLM: the encoder stage's, else the tower stage's (a tower method alone)."""
    return [r for r in records if r.stage in ENCODER_OUTPUT] or [r for r in records if r.stage == "tower"]


# behaviour bugs the table found (xfail, strict: fixing one makes its case pass and fail here until removed)
BUGS: dict[str, str] = {}


def _ids(cases) -> list[str]:
    return [str(c.values[0]) if hasattr(c, "values") else str(c) for c in cases]


# --------------------------------------------------------------------------- the table covers every method
def test_every_registered_method_applies_somewhere_and_the_exceptions_are_current():
    covered = {c.method for c in all_cases()}
    assert covered == set(METHODS), set(METHODS) - covered
    assert set(KEEP_ALL) | set(NO_KEEP_ALL) | set(PRUNING) <= set(METHODS)  # a stale key fails
    known = {str(c) for c in [*all_cases(), *refused_call_cases()]} | {f"{m}-{f}" for m, f in DOCUMENTED}
    known |= {_param_id(*c) for c in parameter_cases()}
    assert set(BUGS) <= known
    assert not set(KEEP_ALL) & set(NO_KEEP_ALL)
    assert all(every_param_is_declared(method_class(m)) for m in METHODS)


DOCUMENTED = [(m, f) for f in FAMILIES for m in verdicts(f) if docs_refuses(m, f) is not None]


@pytest.mark.parametrize(
    "method, family",
    [pytest.param(m, f, marks=pytest.mark.xfail(strict=True, reason=BUGS[f"{m}-{f}"])) if f"{m}-{f}" in BUGS
     else (m, f) for m, f in DOCUMENTED],
    ids=[f"{m}-{f}" for m, f in DOCUMENTED],
)  # fmt: skip
def test_the_docs_tables_say_na_exactly_where_patch_refuses(method, family):
    """docs/guide/methods.md's method x family tables: "n/a" where `applicable_methods` refuses, not elsewhere."""
    why = verdicts(family)[method]
    assert docs_refuses(method, family) == (why is not None), why


# --------------------------------------------------------------------------- identity
FAILS = (RuntimeError, AssertionError)  # how a known bug shows: raised inside torch, or outputs that differ
IDENTITY = [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, raises=FAILS, reason=BUGS[str(c)])) if str(c) in BUGS
    else c
    for c in native_cases()
    if c.method not in NO_KEEP_ALL
]  # fmt: skip


@pytest.mark.parametrize("case", IDENTITY, ids=_ids(IDENTITY))
def test_keeping_every_token_is_the_unpatched_model(case):
    """Greedy steps' logits within 1e-5 of the unpatched model's (the prompt's last position, then each step with
    the cache) and the same ids, up to a near-tie."""
    model, _ = tiny(case.family)
    batch, ref = inputs(case.family, case.modality), reference(case.family, case.modality)
    with torch.no_grad(), vtoken.patched(model, keep_all(case)) as handle:
        tokens = greedy(model, batch)
        records = list(handle.records)
    assert tokens[1].shape == ref.greedy[1].shape and (tokens[1] - ref.greedy[1]).abs().max() <= 1e-5
    assert_same_greedy(tokens, ref.greedy, 1e-5, min_steps=3)
    assert all(r.tokens_out == r.tokens_in for r in records if r.stage in ENCODER_OUTPUT), records


# --------------------------------------------------------------------------- batch
@pytest.mark.parametrize("case", all_cases(), ids=_ids(all_cases()))
def test_a_padded_batch_equals_its_rows_alone(case):
    """Each row of a left-padded batch of two (another size, a longer question) generates its greedy ids alone
    (the pruning run's are row 0's), up to a near-tie within 1e-4 (a batch's shapes round differently)."""
    model, _ = tiny(case.family)
    batched = inputs(case.family, case.modality, rows=(0, 1))
    assert (batched["attention_mask"] == 0).any()  # the rows are padded
    first = run_of(case).tokens
    with torch.no_grad(), vtoken.patched(model, pruning(case), layout=case.layout):
        ids, logits = greedy(model, batched)
        alone = [first, greedy(model, inputs(case.family, case.modality, rows=(1,)))]
    for row, one in enumerate(alone):
        steps = one[0].shape[1]  # alone, generate stops at EOS; the batch's row goes on with padding
        assert_same_greedy((ids[row : row + 1, :steps], logits[:steps, row : row + 1]), one, 1e-4, min(3, steps))


# --------------------------------------------------------------------------- a pruning run: records, budget, restore
class Run:
    """One pruning run of a case (cached: the records, budget, restore and batch rows read it): the model
    generates greedily patched, forward pre-hooks measure what the LLM and each decoder layer receive at prefill,
    then it is unpatched and run again."""

    def __init__(self, case):
        model, _ = tiny(case.family)
        self.batch = inputs(case.family, case.modality)
        self.reference = reference(case.family, case.modality)
        self.before = snapshot(model)
        self.method = pruning(case)
        language_model = view(case.family).language_model
        self.lengths: dict[str, int] = {}

        def measure(name):
            def hook(module, args, kwargs):
                hidden = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
                self.lengths.setdefault(name, (args[0] if hidden is None else hidden).shape[1])  # prefill only

            return hook

        hooks = [language_model.register_forward_pre_hook(measure("llm"), with_kwargs=True)]
        hooks += [layer.register_forward_pre_hook(measure(f"layer{i}"), with_kwargs=True)
                  for i, layer in enumerate(language_model.layers)]  # fmt: skip
        try:
            handle = vtoken.patch(model, self.method, layout=case.layout)
            try:
                with torch.no_grad():
                    self.tokens = greedy(model, self.batch)
                    self.records = list(handle.records)
                    self.beams = model.generate(**self.batch, **BEAMS)
                    self.beam_records = list(handle.records)
            finally:
                vtoken.unpatch(model)
        finally:
            for hook in hooks:
                hook.remove()
        self.after = snapshot(model)
        with torch.no_grad():
            self.logits_after = model(**self.batch).logits
            self.generated_after = model.generate(**self.batch, max_new_tokens=2, do_sample=False)


BEAMS = dict(max_new_tokens=2, num_beams=2, num_return_sequences=2, do_sample=False)
_runs: dict = {}


def run_of(case) -> Run:
    if case not in _runs:
        _runs[case] = Run(case)
    return _runs[case]


@pytest.mark.parametrize("case", all_cases(), ids=_ids(all_cases()))
def test_records_say_what_reached_the_llm(case):
    run = run_of(case)
    ids = run.batch["input_ids"]
    length, placeholders = ids.shape[1], view(case.family).visual_tokens(ids)[0]
    assert 1 <= run.tokens[0].shape[1] <= 3  # it generated
    llm_visual = run.lengths["llm"] - (length - placeholders)  # the visual tokens the LLM received
    encoder = before_llm(run.records)
    kept_in, kept_out = sum(r.tokens_in for r in encoder), sum(r.tokens_out for r in encoder)
    if not encoder:
        assert llm_visual == placeholders  # nothing dropped before the LLM
    elif case.layout == "official" or placeholders == kept_in:  # every visual token was the method's to keep
        assert llm_visual == kept_out, (llm_visual, kept_out)
    elif encoder[0].stage == "tower":  # the tower's kept patches, then the native layout unpads and adds newlines
        assert 0 < llm_visual <= placeholders, (llm_visual, placeholders)  # (tests/test_tower_stage.py: exact)
    else:  # separators the method does not choose among ([CLS] passed through, newlines: dropped with their rows)
        assert kept_out <= llm_visual <= kept_out + placeholders - kept_in, (llm_visual, kept_in, kept_out)
    for r in encoder:
        assert 0 <= r.tokens_out <= r.tokens_in, r
        if r.kept is not None:
            kept = r.kept.tolist()
            assert kept == sorted(set(kept)) and all(0 <= k < r.grid[0] * r.grid[1] for k in kept), r
            assert len(kept) == r.tokens_out or (run.method.merges and len(kept) < r.tokens_out), r
    # an LLM stage: its first drop starts from what the LLM received; the layer after each drop gets that many fewer
    # (FrameFusion's merge and prune calls are checked in its own file)
    drops = sorted({int(r.stage[len("prefill.layer") :]) for r in run.records if r.stage.startswith("prefill.layer")})
    sequence = run.lengths["llm"]
    for k in drops:
        (record,) = [r for r in run.records if r.stage == f"prefill.layer{k}"]  # one row
        if k == drops[0]:
            assert record.tokens_in == llm_visual, record
        sequence -= record.tokens_in - record.tokens_out
        if f"layer{k + 1}" in run.lengths:
            assert run.lengths[f"layer{k + 1}"] == sequence, (k, record)
    for r in run.records:
        if r.stage.startswith("sparse."):
            assert r.tokens_in == r.tokens_out == run.lengths["llm"], r  # keeps every token


BUDGETED = [c for c in all_cases() if keeps_a_count(c)]


@pytest.mark.parametrize("case", BUDGETED, ids=_ids(BUDGETED))
def test_a_known_count_is_kept_exactly(case):
    run = run_of(case)
    encoder = before_llm(run.records)
    assert encoder
    for r in encoder:
        assert r.tokens_out == expected_count(run.method, r.tokens_in), r


def _selection(records, row: int | None = None) -> list[tuple]:
    return [
        (r.stage, r.image, r.crop, r.tokens_in, r.tokens_out, None if r.kept is None else r.kept.tolist())
        for r in records
        if r.stage in ENCODER_OUTPUT or (r.stage.startswith("prefill.") and r.image == row)
    ]


@pytest.mark.parametrize("case", all_cases(), ids=_ids(all_cases()))
def test_beam_search_returns_every_sequence_from_the_same_selection(case):
    """Beams with num_return_sequences: the prompt heads every returned sequence, the encoder selects once per
    image (not per beam) what greedy decoding selects, and an LLM stage drops in every beam what it drops alone."""
    run = run_of(case)
    prompt = run.batch["input_ids"]
    assert run.beams.shape[0] == 2 and torch.equal(run.beams[:, : prompt.shape[1]], prompt.expand(2, -1))
    for beam in (0, 1):
        assert [s[:1] + s[2:] for s in _selection(run.beam_records, beam)] == [
            s[:1] + s[2:] for s in _selection(run.records, 0)
        ]


@pytest.mark.parametrize("case", all_cases(), ids=_ids(all_cases()))
def test_unpatch_restores_the_model_exactly(case):
    run = run_of(case)
    assert_same_snapshot(run.after, run.before)
    assert torch.equal(run.logits_after, run.reference.logits)
    new = run.generated_after[:, run.batch["input_ids"].shape[1] :]
    assert torch.equal(new, run.reference.greedy[0][:, : new.shape[1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_patching_twice_is_a_clear_error_that_keeps_the_first_patch(family):
    model, _ = tiny(family)
    first, second = [m for m, why in verdicts(family).items() if why is None][:2]
    before = snapshot(model)
    handle = vtoken.patch(model, make_method(first, **_fit(family, first)))
    try:
        patched = snapshot(model)
        with pytest.raises(vtoken.AlreadyPatchedError, match="unpatch"):
            vtoken.patch(model, make_method(second, **_fit(family, second)))
        assert vtoken.handle_of(model) is handle
        assert_same_snapshot(snapshot(model), patched)
    finally:
        vtoken.unpatch(model)
    assert_same_snapshot(snapshot(model), before)
    with pytest.raises(vtoken.VTokenError, match="not patched"):
        vtoken.unpatch(model)


def _fit(family: str, method: str) -> dict:
    return method_class(method).fit(view(family))


# --------------------------------------------------------------------------- clear errors
REFUSED = refused_patch_cases()


@pytest.mark.parametrize("method, family", REFUSED, ids=[f"{m}-{f}" for m, f in REFUSED])
def test_a_refused_patch_names_why_and_leaves_the_model_intact(method, family):
    """Refused at `patch` with a `VTokenError` naming the method and, as far as its declaration tells, what the
    family lacks: an input it acts on, a stage, the signals it requires (a `MissingSignalError` names them all)."""
    model, _ = tiny(family)
    cls = method_class(method)
    instance = make_method(method, **cls.fit(view(family)))
    before = snapshot(model)
    with pytest.raises(vtoken.VTokenError) as err:
        vtoken.patch(model, instance)
    message = str(err.value)
    assert method in message, message
    if not set(cls.modalities) & set(takes(family)):
        assert "inputs only" in message, message
    elif not set(cls.stages) <= set(view(family).stages):
        assert "stage" in message, message
    if isinstance(err.value, vtoken.MissingSignalError):
        missing = unmet(tuple(instance.requires), set(view(family).signals))
        assert missing and all(s in message for s in missing), message
    assert_same_snapshot(snapshot(model), before)


CALLS = [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=BUGS[str(c)])) if str(c) in BUGS else c
         for c in refused_call_cases()]  # fmt: skip


@pytest.mark.parametrize("case", CALLS, ids=_ids(CALLS))
def test_a_refused_call_names_why_and_leaves_the_model_intact(case):
    model, _ = tiny(case.family)
    batch = inputs(case.family, case.modality)
    ref = reference(case.family, case.modality)  # first: transformers marks a tower on its first call
    with torch.no_grad(), vtoken.patched(model, pruning(case), layout=case.layout) as handle:
        patched = snapshot(model)
        for call in (lambda: model(**batch), lambda: model.generate(**batch, max_new_tokens=1)):
            with pytest.raises(vtoken.VTokenError, match=case.method):
                call()
            assert_same_snapshot(snapshot(model), patched)
        assert not handle.records
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref.logits)


def _param_id(method: str, param: str, value) -> str:
    """A stable id (the same in every pytest-xdist worker: a bare object's repr holds its address)."""
    shown = "object()" if type(value) is object else repr(value)
    return f"{method}-{param}-{type(value).__name__}:{shown}"[:60]


PARAMETERS = [
    pytest.param(*case, marks=pytest.mark.xfail(strict=True, reason=BUGS[_param_id(*case)])) if _param_id(*case) in BUGS
    else case
    for case in parameter_cases()
]  # fmt: skip


@pytest.mark.parametrize("method, param, value", PARAMETERS, ids=[_param_id(*c) for c in parameter_cases()])
def test_a_bad_parameter_is_refused_naming_it_and_nothing_is_patched(method, param, value):
    """At construction: a `VTokenError` (a `BudgetError` for a budget) naming the method, the parameter, the value
    and what is accepted; `patch` with it raises the same and installs nothing."""
    spec = method_class(method).declared_params()[param]
    with pytest.raises(vtoken.BudgetError if isinstance(own(spec), Kept) else vtoken.VTokenError) as err:
        make_method(method, **{param: value})
    message = str(err.value)
    assert method in message and param in message, message
    if type(value) is not object:  # a value it can show
        assert repr(value)[:4] in message or str(value) in message, message
    for word in accepted_words(method, spec):
        assert word in message, (word, message)
    model, _ = tiny(FAMILIES[0])  # any family: the parameter is refused before the model is looked at
    before = snapshot(model)
    with pytest.raises(type(err.value)):
        vtoken.patch(model, method, **{param: value})
    assert_same_snapshot(snapshot(model), before)
