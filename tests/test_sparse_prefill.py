"""Sparse prefill: plan builders on controlled inputs, and the method inside tiny LLaVA-1.5 and Qwen2-VL (images,
M-RoPE, video) against the stock language model run with the equivalent 4-D boolean mask."""

import copy
import threading

import numpy as np
import pytest
import torch
from conftest import inputs_for, video_inputs
from PIL import Image

import vtoken
from vtoken.adapters import hf
from vtoken.kernels import block_mask_from_plan
from vtoken.methods.sparse_prefill import (
    a_shape_blocks,
    a_shape_plan,
    density_blocks,
    grid_blocks,
    line_blocks,
    plan_from_block_mask,
    prefill_bound,
    vertical_slash_scores,
)
from vtoken.zoo import tiny_llava, tiny_llava_next_video, tiny_qwen2_vl

SMALL = dict(block_size=16, min_length=16)  # tiny prompts (~600 tokens) run sparse


# --------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "params",
    [
        dict(pattern="diagonal"),
        dict(density=0.0),
        dict(density=1.5),
        dict(density=True),
        dict(density="0.1"),
        dict(density=0.2, vertical=10),
        dict(vertical=-1),
        dict(vertical=0, slash=0),
        dict(pattern="a_shape", density=0.5),
        dict(pattern="grid", slash=4),
        dict(sink=-1),
        dict(window=0),
        dict(block_size=48),
        dict(block_size=8),
        dict(min_length=0),
        dict(layers="all"),
        dict(layers=[0, -1]),
        dict(layers=[]),
        dict(backend="cuda"),
    ],
)
def test_bad_values_fail_at_construction(params):
    with pytest.raises(vtoken.VTokenError):
        vtoken.SparsePrefill(**params)


def test_registered_by_name():
    method = vtoken.make_method("sparse_prefill", pattern="a_shape", window=32)
    assert isinstance(method, vtoken.SparsePrefill) and method.local == 32
    assert "sparse_prefill" in vtoken.available_methods()
    assert vtoken.SparsePrefill().min_length == 32768 and vtoken.SparsePrefill(density=1.0).is_identity


def test_prefill_bound():
    assert prefill_bound(0.4, 0.1) == pytest.approx(1 / 0.64)
    assert prefill_bound(0.73, 1.0) == pytest.approx(1.0)


# --------------------------------------------------------------------- plan builders
def test_a_shape_blocks_cover_exactly_the_needed_blocks():
    seq, block, sink, window = 150, 16, 5, 40
    mask = a_shape_blocks(seq, block, sink, window)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    wanted = (j <= i) & ((j < sink) | (i - j < window))
    n = mask.shape[0]
    by_block = torch.zeros(n, n, dtype=torch.bool)  # brute force: a block is needed iff it holds a wanted pair
    for qb in range(n):
        for kb in range(n):
            by_block[qb, kb] = wanted[qb * block : (qb + 1) * block, kb * block : (kb + 1) * block].any()
    assert torch.equal(mask, by_block)
    counts, index = a_shape_plan(seq, block, sink, window)  # built directly: the same plan
    assert torch.equal(counts, plan_from_block_mask(mask)[0]) and torch.equal(
        block_mask_from_plan(counts, index, n), mask
    )


def test_plan_round_trip_and_garbage_free():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(2, 3, 7, 7, generator=g) > 0.5) & torch.ones(7, 7, dtype=torch.bool).tril()
    counts, index = plan_from_block_mask(mask)
    assert torch.equal(block_mask_from_plan(counts, index, 7), mask)
    listed = torch.arange(index.shape[-1]) < counts[..., None]
    ascending = index[..., 1:] > index[..., :-1]
    assert bool((ascending | ~listed[..., 1:]).all())


def planted(seq=192, dim=32, column=37, offset=21, heads=2):
    """q, k where every query splits its attention between key `column` (a vertical line) and the key `offset`
    positions before it (a slash): a RoPE-like multi-frequency rotation peaks only at relative offset `offset`,
    and one extra direction is shared by the queries and key `column` alone, at the same logit."""
    freqs = 2 * torch.pi * 2.0 ** torch.arange(9) / 512

    def rotation(position):
        angle = position.float()[:, None] * freqs
        return torch.cat([angle.cos(), angle.sin()], dim=-1) * 2  # logit 4 * 9 = 36 at the peak

    q = torch.zeros(1, heads, seq, dim)
    k = torch.zeros(1, heads, seq, dim)
    q[..., :18] = rotation(torch.arange(seq))
    k[..., :18] = rotation(torch.arange(seq) + offset)
    k[..., column, :18] = 0.0
    q[..., 20], k[..., column, 20] = 6.0, 6.0  # logit 36
    return q, k, column, offset


def test_planted_vertical_and_slash_are_recovered():
    q, k, column, offset = planted()
    seq, block = q.shape[2], 16
    rows = torch.arange(seq - 64, seq)[None]
    vertical, slash = vertical_slash_scores(q, k, rows, None, 1.0)
    assert vertical.shape == slash.shape == (1, 2, seq)
    assert bool((vertical.argmax(-1) == column).all()) and bool((slash.argmax(-1) == offset).all())
    mandatory = a_shape_blocks(seq, block, 16, 16)
    # line mode from row `column` on; density mode once a row's budget exceeds its mandatory blocks + 2
    for mask, first_row in (
        (line_blocks(vertical, slash, block, 1, 1, mandatory), column),
        (density_blocks(vertical, slash, block, 0.6, mandatory), 8 * block),
    ):
        n = mask.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert not bool((mask & ~causal).any())  # nothing above the diagonal
        assert bool(mask[..., :, 0].all()) and bool(mask.diagonal(dim1=-2, dim2=-1).all())  # sink, diagonal
        for i in range(first_row, seq):  # rows read the line's block and their slash key's block
            assert bool(mask[..., i // block, column // block].all())
            assert bool(mask[..., i // block, (i - offset) // block].all())


def test_density_blocks_keep_the_fraction_of_each_row():
    g = torch.Generator().manual_seed(1)
    seq, block, density = 300, 16, 0.25
    vertical, slash = torch.rand(1, 2, seq, generator=g), torch.rand(1, 2, seq, generator=g)
    mandatory = a_shape_blocks(seq, block, 16, 16)
    mask = density_blocks(vertical, slash, block, density, mandatory)
    n = mask.shape[-1]
    want = torch.maximum(torch.ceil(density * (torch.arange(n) + 1.0)).long(), mandatory.sum(-1))
    assert torch.equal(mask.sum(-1), want.expand(1, 2, n))
    assert bool((mask | ~mandatory).all())


def test_grid_blocks_follow_frames():
    seq, block, start, stride, frames = 512, 16, 24, 96, 4
    end = start + stride * frames
    mask = grid_blocks(seq, block, torch.tensor([[start, end]]), torch.tensor([stride]), 0, 16)[0]
    n = mask.shape[0]
    assert not bool((mask & ~torch.ones(n, n, dtype=torch.bool).tril()).any())
    for i in range(start, end):
        qb = i // block
        if qb * block < start or (qb + 1) * block > end:
            assert bool(mask[qb, : qb + 1].all())  # a block holding text stays dense
            continue
        for earlier in range(i - stride, start - 1, -stride):  # the same spatial position in every earlier frame
            assert bool(mask[qb, earlier // block])
        assert bool(mask[qb, (start - 1) // block])  # the text before the video
    assert bool(mask[(end + 1) // block, : (end + 1) // block + 1].all())  # the question after the video
    inside = [qb for qb in range(n) if qb * block >= start and (qb + 1) * block <= end]
    assert mask[inside].sum() < 0.5 * sum(qb + 1 for qb in inside)  # and the video rows are sparse


# --------------------------------------------------------------------- inside models
@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_vl()


@pytest.fixture(scope="module")
def next_video():
    return tiny_llava_next_video()


@pytest.fixture(scope="module")
def llava_batch(llava):
    from skimage import data

    images = [Image.fromarray(data.astronaut()), Image.fromarray(data.coffee())]
    return inputs_for(llava[1], images, ["what is it?", "what is in the image? answer with one word."])


def qwen_video_inputs(processor, frames=8):
    """One 224 x 224 clip: frames / 2 temporal groups of 8 x 8 merged tokens."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    clip = [Image.fromarray(np.roll(base, 8 * i, axis=1)) for i in range(frames)]
    content = [{"type": "video"}, {"type": "text", "text": "what happens?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(videos=[clip], text=[prompt], return_tensors="pt")


def qwen_image_inputs(processor):
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in [(336, 280), (224, 224)]]
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}], add_generation_prompt=True
        )
        for q in ["what is it?", "describe the picture in detail please"]
    ]
    return processor(images=images, text=prompts, return_tensors="pt", padding=True)


def run_capturing_lm(model, inputs):
    """One forward; returns the LLM's keyword inputs and its last hidden state."""
    seen = {}

    def before(module, args, kwargs):
        left_out = ("past_key_values", hf.CACHE_KWARG, "use_cache")
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k not in left_out}

    def after(module, args, output):
        seen["hidden"] = output.last_hidden_state

    hooks = [
        model.model.language_model.register_forward_pre_hook(before, with_kwargs=True),
        model.model.language_model.register_forward_hook(after),
    ]
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    return seen["kwargs"], seen["hidden"], logits


def stock_lm_with_mask(model, lm_kwargs, mask):
    """The unpatched language model on the captured inputs with an explicit 4-D boolean mask [B, 1, L, L]."""
    with torch.no_grad():
        out = model.model.language_model(**dict(lm_kwargs, attention_mask=mask), use_cache=False)
    return out.last_hidden_state


def a_shape_mask(padding, sink, window):
    """[B, 1, L, L] bool: causal, key padding, and j - first < sink or i - j < window (first: each row's first
    real column, so a left-padded row has the same pattern as the row alone)."""
    length = padding.shape[1]
    valid = padding.bool()
    first = valid.long().argmax(1)[:, None, None]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j <= i) & ((j - first < sink) | (i - j < window))
    return (allowed & valid[:, None, :])[:, None]


def assert_rows_close(got, want, padding):
    real = padding.bool()
    assert (got[real] - want[real]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llava", "qwen-image"])
def test_a_shape_equals_the_language_model_with_its_mask(family, llava, qwen, llava_batch):
    model, processor = llava if family == "llava" else qwen
    inputs = llava_batch if family == "llava" else qwen_image_inputs(processor)
    sink, window = 5, 40
    lm_kwargs, _, _ = run_capturing_lm(model, inputs)
    with vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", sink=sink, window=window, **SMALL)) as handle:
        _, hidden, _ = run_capturing_lm(model, inputs)
    padding = inputs["attention_mask"]
    assert bool((padding == 0).any())  # the batch is padded
    want = stock_lm_with_mask(model, lm_kwargs, a_shape_mask(padding, sink, window))
    assert_rows_close(hidden, want, padding)
    layers = sorted({r.stage for r in handle.records})
    assert layers == ["sparse.layer0", "sparse.layer1"]
    assert all(0 < r.extra["density"] <= 1 and r.tokens_in == int(padding[r.image].sum()) for r in handle.records)
    assert min(r.extra["density"] for r in handle.records) < 0.9
    assert "of causal attention blocks computed" in handle.summary()


def test_generate_continues_after_a_sparse_prefill(llava, llava_batch):
    model, _ = llava
    inputs = {k: v[:1] for k, v in llava_batch.items()}
    inputs["input_ids"] = inputs["input_ids"][:, inputs["attention_mask"][0].bool()]  # drop row 0's padding
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    sink, window, steps = 3, 50, 4
    method = vtoken.SparsePrefill(pattern="a_shape", sink=sink, window=window, **SMALL)
    with torch.no_grad(), vtoken.patched(model, method):
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    # reference: the stock LM on prompt + generated tokens, prompt rows A-shaped, new rows dense
    lm_kwargs, _, _ = run_capturing_lm(model, inputs)
    embeds = lm_kwargs["inputs_embeds"]
    length = embeds.shape[1]
    tokens = []
    for _ in range(steps):
        total = embeds.shape[1]
        mask = torch.ones(total, total, dtype=torch.bool).tril()
        mask[:length, :length] = a_shape_mask(torch.ones(1, length), sink, window)[0, 0]
        with torch.no_grad():
            hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=mask[None, None]).last_hidden_state
            token = model.lm_head(hidden[:, -1]).argmax(-1)
        tokens.append(int(token))
        embeds = torch.cat([embeds, model.get_input_embeddings()(token)[:, None]], dim=1)
    assert out[0, length:].tolist() == tokens


def test_vertical_slash_runs_sparse_and_records(llava, llava_batch):
    """Estimated plans, planned per row from its first real token: a left-padded batch gives each row's logits
    run alone."""
    model, _ = llava
    with torch.no_grad():
        ref = model(**llava_batch).logits
        with vtoken.patched(model, vtoken.SparsePrefill(density=0.3, sink=16, window=16, **SMALL)) as handle:
            logits = model(**llava_batch).logits
            records = handle.records
            singles = []
            for row in range(2):
                real = llava_batch["attention_mask"][row].bool()
                one = dict(input_ids=llava_batch["input_ids"][row : row + 1, real],
                           pixel_values=llava_batch["pixel_values"][row : row + 1])  # fmt: skip
                singles.append((real, model(**one).logits[0]))
    assert torch.isfinite(logits).all() and not torch.equal(logits, ref)
    assert {r.stage for r in records} == {"sparse.layer0", "sparse.layer1"}
    assert all(0.3 <= r.extra["density"] < 0.6 and r.extra["estimation_ms"] > 0 for r in records)
    assert not bool(llava_batch["attention_mask"][0].all())  # row 0 is left-padded
    for row, (real, alone) in enumerate(singles):
        assert (logits[row, real] - alone).abs().max() <= 1e-4


def video_case(family, qwen, next_video):
    """(model, inputs, frames) of one prompt with one clip."""
    if family == "qwen2-vl":
        model, processor = qwen
        inputs = qwen_video_inputs(processor)
        return model, inputs, int(inputs["video_grid_thw"][0, 0])
    model, processor = next_video
    return model, video_inputs(processor, frames=4), 4


@pytest.mark.parametrize("family", ["qwen2-vl", "llava-next-video"])
def test_grid_on_video_equals_the_language_model_with_its_block_mask(family, qwen, next_video):
    model, inputs, frames = video_case(family, qwen, next_video)
    ids = inputs["input_ids"][0]
    video = (ids == model.config.video_token_id).nonzero().squeeze(1)
    start, end, stride = int(video[0]), int(video[-1]) + 1, len(video) // frames
    block, window = 16, 16
    lm_kwargs, _, _ = run_capturing_lm(model, inputs)
    method = vtoken.SparsePrefill(pattern="grid", sink=0, window=window, block_size=block, min_length=16)
    with vtoken.patched(model, method) as handle:
        _, hidden, _ = run_capturing_lm(model, inputs)
        records = handle.records
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=2, do_sample=False)  # generate finds the frames too
        generate_records = handle.records
    blocks = grid_blocks(len(ids), block, torch.tensor([[start, end]]), torch.tensor([stride]), 0, window)
    mask = blocks.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, : len(ids), : len(ids)]
    mask &= torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    want = stock_lm_with_mask(model, lm_kwargs, mask[:, None])
    assert (hidden - want).abs().max() <= 1e-5
    for seen in (records, generate_records):
        assert [r.stage for r in seen] == ["sparse.layer0", "sparse.layer1"]
        assert all(r.extra["density"] < 0.9 for r in seen)


def test_grid_after_per_frame_pruning(next_video):
    """An encoder-stage method keeping k tokens per frame: the grid's stride becomes k."""
    model, processor = next_video
    inputs = video_inputs(processor, frames=4)
    method = vtoken.SparsePrefill(pattern="grid", sink=0, window=16, block_size=16, min_length=16)
    with torch.no_grad(), vtoken.patched(model, [vtoken.Random(budget=0.5), method]) as handle:
        model(**inputs)
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    stages = [r.stage for r in handle.records]
    assert stages.count("encoder") == 4 and stages[-2:] == ["sparse.layer0", "sparse.layer1"]


def test_composes_with_fastervlm_and_fastv(llava, llava_batch):
    """With a window covering the whole prompt, A-shape is exact causal attention computed by the sparse path: the
    composed run must equal FasterVLM + FastV alone, in every layer after FastV's drop too (its mask respected)."""
    model, _ = llava
    pruning = [vtoken.FasterVLM(budget=0.5), vtoken.FastV(layer=0, keep=0.5)]
    with torch.no_grad():
        with vtoken.patched(model, pruning):
            ref = model(**llava_batch).logits
            ref_tokens = model.generate(**llava_batch, max_new_tokens=3, do_sample=False)
        wide = vtoken.SparsePrefill(pattern="a_shape", sink=0, window=10**6, **SMALL)
        with vtoken.patched(model, [*pruning, wide]) as handle:
            logits = model(**llava_batch).logits
            records = handle.records
            tokens = model.generate(**llava_batch, max_new_tokens=3, do_sample=False)
        narrow = vtoken.SparsePrefill(pattern="a_shape", sink=4, window=32, **SMALL)
        with vtoken.patched(model, [vtoken.FastV(layer=0, keep=0.5), narrow]) as handle:
            model(**llava_batch)
            narrow_records = handle.records
    assert (logits - ref).abs().max() <= 1e-5 and torch.equal(tokens, ref_tokens)
    stages = [r.stage for r in records]
    assert "encoder" in stages and "prefill.layer0" in stages
    lengths = {r.stage: r.tokens_in for r in records if r.stage.startswith("sparse") and r.image == 0}
    assert set(lengths) == {"sparse.layer0", "sparse.layer1"}  # no layer fell back to dense
    assert lengths["sparse.layer1"] < lengths["sparse.layer0"]  # layer 1 ran on FastV's shorter sequence
    assert {r.stage for r in narrow_records if r.stage.startswith("sparse")} == {"sparse.layer0", "sparse.layer1"}


def test_composes_with_mustdrop(llava_batch):
    """MustDrop's three stages (encoder merge, prefill filter, decode KV cut) with an all-covering A-shape: equal to
    MustDrop alone, and the layers after its drop run sparse on the shorter sequence."""
    model, _ = tiny_llava(text_layers=4)

    def mustdrop():
        return vtoken.MustDrop(global_thr=0.011, individual_thr=0.01, layers=(1,))

    wide = vtoken.SparsePrefill(pattern="a_shape", sink=0, window=10**6, **SMALL)
    with torch.no_grad():
        with vtoken.patched(model, mustdrop()):
            ref = model(**llava_batch).logits
            ref_tokens = model.generate(**llava_batch, max_new_tokens=3, do_sample=False)
        with vtoken.patched(model, [mustdrop(), wide]) as handle:
            logits = model(**llava_batch).logits
            lengths = {r.stage: r.tokens_in for r in handle.records if r.stage.startswith("sparse") and r.image == 0}
            tokens = model.generate(**llava_batch, max_new_tokens=3, do_sample=False)
    assert (logits - ref).abs().max() <= 1e-5 and torch.equal(tokens, ref_tokens)
    assert sorted(lengths) == [f"sparse.layer{i}" for i in range(4)]
    assert lengths["sparse.layer2"] < lengths["sparse.layer1"]


def test_an_eager_language_model(llava, llava_batch):
    """With eager attention the mask arrives additive (float); the sparse path reads it the same way, decoding
    stays eager, and unpatch gives eager back."""
    model = copy.deepcopy(llava[0])
    model.set_attn_implementation("eager")
    sink, window = 5, 40
    lm_kwargs, _, _ = run_capturing_lm(llava[0], llava_batch)
    with (
        torch.no_grad(),
        vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", sink=sink, window=window, **SMALL)) as handle,
    ):
        assert model.config.text_config._attn_implementation == "vtoken_sparse_eager"
        _, hidden, _ = run_capturing_lm(model, llava_batch)
        records = handle.records
        model.generate(**llava_batch, max_new_tokens=2, do_sample=False)
    padding = llava_batch["attention_mask"]
    assert_rows_close(hidden, stock_lm_with_mask(llava[0], lm_kwargs, a_shape_mask(padding, sink, window)), padding)
    assert {r.stage for r in records} == {"sparse.layer0", "sparse.layer1"}
    assert model.config.text_config._attn_implementation == "eager"


def test_unpatch_restores_attention_implementation_and_outputs(llava, llava_batch):
    model, _ = llava
    configs = [model.config, model.config.text_config, model.config.vision_config]
    before = [c._attn_implementation_internal for c in configs]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(**llava_batch).logits
        vtoken.patch(model, vtoken.SparsePrefill(pattern="a_shape", window=32, **SMALL))
        assert model.config.text_config._attn_implementation == "vtoken_sparse_sdpa"
        assert model.config.vision_config._attn_implementation == before[2]
        vtoken.unpatch(model)
        after = model(**llava_batch).logits
    assert [c._attn_implementation_internal for c in configs] == before
    assert torch.equal(after, ref)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_short_prompts_and_decoding_run_the_models_own_attention(llava, llava_batch):
    model, _ = llava
    with torch.no_grad():
        ref = model(**llava_batch).logits
        with vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", window=8, block_size=16)) as handle:
            logits = model(**llava_batch).logits  # ~600 tokens < the default min_length
    assert torch.equal(logits, ref)
    assert [r.extra["dense"] for r in handle.records] == [
        f"dense: the prompt's {llava_batch['input_ids'].shape[1]} tokens are fewer than min_length=32768"
    ]


def test_clear_errors_leave_the_model_unpatched(llava, qwen):
    model, _ = llava
    cases = [
        vtoken.SparsePrefill(pattern="grid"),  # LLaVA-1.5 takes no video
        vtoken.SparsePrefill(layers=[5]),  # a 2-layer LLM
        vtoken.SparsePrefill(backend="triton"),  # a CPU model without the interpreter
        [vtoken.SparsePrefill(), vtoken.SparsePrefill(pattern="a_shape")],
    ]
    for method in cases:
        with pytest.raises(vtoken.VTokenError):
            vtoken.patch(model, method)
        assert vtoken.handle_of(model) is None
        assert model.config.text_config._attn_implementation == "sdpa"


def test_threads_calling_one_patched_model(llava, llava_batch):
    model, _ = llava
    first = {k: v[:1] for k, v in llava_batch.items()}
    second = {k: v[1:] for k, v in llava_batch.items()}
    with torch.no_grad(), vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", window=40, **SMALL)):
        want = [model(**first).logits, model(**second).logits]
        got = [None, None]

        def work(slot, inputs):
            with torch.no_grad():
                got[slot] = model(**inputs).logits

        threads = [threading.Thread(target=work, args=(i, x)) for i, x in enumerate([first, second] * 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_patched_model_runs_its_own_sparse_stage(llava_batch, how):
    """A deep or unpickled copy is patched on its own: the same logits as the original, its own records, and
    unpatching the copy leaves the original sparse (issue 16: copies)."""
    import io

    model, _ = tiny_llava()  # fresh: transformers' first call installs hooks that no model can pickle after
    method = vtoken.SparsePrefill(pattern="a_shape", window=40, **SMALL)
    handle = vtoken.patch(model, method)
    if how == "deepcopy":
        other = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        other = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        want = model(**llava_batch).logits
        got = other(**llava_batch).logits
        assert torch.equal(got, want)
        copied = vtoken.handle_of(other)
        assert copied is not handle and any(r.stage.startswith("sparse.layer") for r in copied.records)
        vtoken.unpatch(other)
        assert other.config.text_config._attn_implementation == "sdpa"
        assert torch.equal(model(**llava_batch).logits, want)  # the original still runs sparse
        unpatched = other(**llava_batch).logits
    vtoken.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**llava_batch).logits, unpatched)
        assert not torch.equal(unpatched, want)  # the sparse pattern changes the logits: the checks above can fail


# --------------------------------------------------------------------- never slower than dense (issue 32)
def test_recorded_break_even_is_conservative_and_the_defaults_never_lose():
    """The recorded model predicts no measured kernel point faster than it ran; below its shortest measurement it
    says dense; with the defaults (vertical_slash, density 0.1, min_length 32768) every length from min_length to
    1M tokens is predicted faster than dense, and shorter ones run dense."""
    from vtoken.kernels.sparse_speed import CUDA_H200, KERNEL_DENSITIES, KERNEL_SPEEDUPS, recorded_break_even

    assert recorded_break_even("NVIDIA H200") is CUDA_H200 and recorded_break_even("cpu") is None
    assert recorded_break_even(torch.device("cpu")) is None
    assert recorded_break_even("NVIDIA H100 80GB HBM3") is None  # not measured yet: no other GPU's constants
    for length, speedups in KERNEL_SPEEDUPS.items():
        for density, speedup in zip(KERNEL_DENSITIES, speedups, strict=True):
            assert CUDA_H200.ratio(length, density, estimated=False) >= 1 / speedup - 1e-9
    assert CUDA_H200.ratio(4096, 0.1, estimated=False) is None
    assert CUDA_H200.decide(4096, 0.01, estimated=False) == (False, "no measurement below 8192 tokens: dense is "
                                                                     "the safe choice")  # fmt: skip
    assert not CUDA_H200.decide(8192, 0.1, estimated=True)[0]  # the run's 0.76x at 8k: the estimate dominated
    method = vtoken.SparsePrefill()
    for length in [method.min_length, 40000, 65536, 100000, 131072, 1 << 20]:
        ratio = CUDA_H200.ratio(length, method.planned_density(length), estimated=True)
        assert ratio < CUDA_H200.margin, (length, ratio)
    limit = CUDA_H200.density_limit(32768, estimated=True)
    assert 0.1 < limit < 0.5 and CUDA_H200.decide(32768, limit + 0.01, estimated=True)[0] is False


def test_an_unknown_gpu_warns_once_and_a_measured_model_wins(monkeypatch):
    """Break-even models are keyed by the GPU's name: a GPU without one warns once (naming vtoken.warmup), and what
    warm-up measured there is used from then on, before anything recorded."""
    import warnings

    from vtoken.kernels import sparse_speed

    monkeypatch.setattr(sparse_speed, "MEASURED", {})
    monkeypatch.setattr(sparse_speed, "_unmeasured_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            sparse_speed.warn_unmeasured("NVIDIA H100 80GB HBM3")
        sparse_speed.warn_unmeasured("NVIDIA L40S")
    assert len(caught) == 2 and "NVIDIA H100 80GB HBM3" in str(caught[0].message)
    assert "vtoken.warmup(model)" in str(caught[0].message) and "min_length" in str(caught[0].message)
    mine = _speed(0.1, lengths=(1024,))
    sparse_speed.MEASURED["NVIDIA H100 80GB HBM3"] = mine
    sparse_speed.MEASURED["NVIDIA H200"] = mine
    assert sparse_speed.recorded_break_even("NVIDIA H100 80GB HBM3") is mine
    assert sparse_speed.recorded_break_even("NVIDIA H200") is mine  # measured here beats recorded elsewhere


def test_measuring_a_break_even_fits_the_timings():
    """`measure_break_even` times the dense layer, the kernel at each density and the estimate (a warm-up run each
    first), and fits the kernel's ratios as the recorded model was fitted."""
    from vtoken.kernels.sparse_speed import fit_kernel, measure_break_even

    ran = []

    def timer(run, repeats):
        return [run() for _ in range(repeats)], None

    def dense(length):
        return lambda: ran.append(("dense", length)) or 1.0 * length

    def sparse(length, density):
        return lambda: ran.append(("sparse", length, density)) or (0.05 + 0.8 * density) * length

    def estimate(length):
        return lambda: 0.02 * length

    model = measure_break_even(dense, sparse, estimate, [4096, 1024], (1.0, 0.5, 0.1), timer=timer, repeats=3)
    assert model.lengths == (1024, 4096)
    fixed, slope = fit_kernel((1.0, 0.5, 0.1), [1 / 0.85, 1 / 0.45, 1 / 0.13])
    assert model.fixed[0] == pytest.approx(fixed) and model.per_density[0] == pytest.approx(slope)
    assert model.fixed[0] == pytest.approx(0.05) and model.per_density[1] == pytest.approx(0.8)
    assert model.estimate == pytest.approx((0.02, 0.02))
    assert ran.count(("dense", 1024)) == 4  # one warm-up run, then three timed


def test_warmup_pays_the_first_calls_costs(llava_batch):
    """vtoken.warmup compiles FlexAttention for the prompt length it is given (and runs a generate on the given
    inputs); the first request after it compiles nothing. Bad arguments and an unpatched model are refused."""
    from vtoken.kernels.block_sparse_flex import flex_unavailable
    from vtoken.launches import count_events

    if flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    model, _ = tiny_llava()
    inputs = {k: v[1:] for k, v in llava_batch.items()}
    seq = inputs["input_ids"].shape[1]
    with pytest.raises(vtoken.VTokenError, match="not patched"):
        vtoken.warmup(model)
    torch._dynamo.reset()  # nothing compiled before: warm-up must compile
    method = vtoken.SparsePrefill(pattern="a_shape", window=40, backend="flex", **SMALL)
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        bad_arguments = [(dict(lengths=[0]), "lengths=.0."), (dict(batches="one"), "batches='one'"),
                         (dict(measure="yes"), "measure='yes'"),
                         (dict(max_new_tokens=0), "max_new_tokens=0")]  # fmt: skip
        for bad, match in bad_arguments:
            with pytest.raises(vtoken.VTokenError, match=match):
                vtoken.warmup(model, **bad)
        report = vtoken.warmup(model, inputs, lengths=[seq])
        assert report.events.compiles >= 1 and report.generated, str(report)
        assert report.prepared[0] == f"{seq} tokens x 1: sparse on flex" and "paid here" in str(report)
        with count_events() as first:
            model(**inputs)
        assert {r.extra["attention"] for r in handle.records} == {"flex"}
    torch._dynamo.reset()
    assert first.compiles == 0 and not first.events, first.describe()


def test_break_even_model_validation():
    from vtoken.kernels.sparse_speed import BreakEven

    with pytest.raises(ValueError):
        BreakEven(lengths=(8, 4), fixed=(0, 0), per_density=(1, 1), estimate=(0, 0))
    with pytest.raises(ValueError):
        BreakEven(lengths=(8,), fixed=(0, 0), per_density=(1,), estimate=(0,))
    with pytest.raises(ValueError):
        BreakEven(lengths=(8,), fixed=(0,), per_density=(1,), estimate=(0,), margin=1.5)
    with pytest.raises(ValueError):
        BreakEven(lengths=(8,), fixed=(0,), per_density=(-1,), estimate=(0,))
    flat = BreakEven(lengths=(8,), fixed=(0.5,), per_density=(0.0,), estimate=(0.0,))
    assert flat.density_limit(8, False) == 1.0 and flat.density_limit(8, True) == 1.0
    for bad in ("yes", 1, None, 0.5):
        with pytest.raises(vtoken.VTokenError, match="break_even"):
            vtoken.SparsePrefill(break_even=bad)


def test_planned_density_is_what_the_plan_computes():
    """The host-side prediction the break-even decides on equals the density the plan achieves (one row, no
    padding), and bounds it in line mode."""
    from vtoken.methods.sparse_prefill import density_plan

    g = torch.Generator().manual_seed(0)
    seq = 700
    q, k = torch.randn(1, 2, seq, 16, generator=g), torch.randn(1, 2, seq, 16, generator=g)
    n = -(-seq // 16)
    causal = n * (n + 1) / 2
    for params in [dict(pattern="a_shape", sink=5, window=100), dict(density=0.3), dict(density=0.05, sink=40),
                   dict(vertical=3, slash=2)]:  # fmt: skip
        method = vtoken.SparsePrefill(block_size=16, **params)
        counts, index, _ = method.plan(q, k, None, 0.25)
        achieved = float(counts[0].double().mean(0).sum()) / causal
        if "vertical" in params:
            assert achieved <= method.planned_density(seq) + 1e-9
        else:
            assert method.planned_density(seq) == pytest.approx(achieved, abs=1e-12), params
    vertical, slash = torch.rand(1, 2, seq, generator=g), torch.rand(1, 2, seq, generator=g)
    mandatory = a_shape_blocks(seq, 16, 64, 64)
    assert torch.equal(density_plan(vertical, slash, 16, 0.2, mandatory)[1],
                       density_plan(vertical, slash, 16, 0.2, mandatory, int(mandatory.sum(-1).max()))[1])  # fmt: skip


def _speed(fixed, per_density=1.0, lengths=(16,), margin=0.9):
    from vtoken.kernels.sparse_speed import BreakEven

    return BreakEven(lengths=lengths, fixed=(fixed,), per_density=(per_density,), estimate=(0.0,), margin=margin,
                     source="test")  # fmt: skip


def test_a_plan_predicted_to_lose_runs_the_models_own_attention_exactly(llava, llava_batch):
    """A speed model that predicts no gain: the output is the unpatched model's, bit for bit, and one note says why;
    one that predicts a gain runs sparse, and every layer's records say which attention ran and why."""
    model, _ = llava
    seq = llava_batch["input_ids"].shape[1]
    with torch.no_grad():
        ref = model(**llava_batch).logits
        lose = vtoken.SparsePrefill(pattern="a_shape", window=40, break_even=_speed(2.0), **SMALL)
        with vtoken.patched(model, lose) as handle:
            logits = model(**llava_batch).logits
            notes = handle.records
        short = vtoken.SparsePrefill(pattern="a_shape", window=40, break_even=_speed(0.0, lengths=(10**4,)), **SMALL)
        with vtoken.patched(model, short) as handle:
            short_logits = model(**llava_batch).logits
            short_notes = handle.records
        gain = vtoken.SparsePrefill(pattern="a_shape", window=40, break_even=_speed(0.0), **SMALL)
        with vtoken.patched(model, gain) as handle:
            sparse_logits = model(**llava_batch).logits
            records = handle.records
    assert torch.equal(logits, ref) and torch.equal(short_logits, ref) and not torch.equal(sparse_logits, ref)
    density = gain.planned_density(seq)
    assert [r.stage for r in notes] == ["sparse"] and notes[0].extra["attention"] == "sdpa"
    assert notes[0].extra["dense"] == (
        f"dense: predicted {2 + density:.2f}x the dense layer's time at {seq} tokens, density {density:.3f} "
        "(break-even margin 0.9; gains below density 0.00)"
    )
    assert short_notes[0].extra["dense"] == "dense: no measurement below 10000 tokens: dense is the safe choice"
    assert {r.stage for r in records} == {"sparse.layer0", "sparse.layer1"}
    for r in records:
        assert r.extra["attention"] == "torch"  # auto on CPU at this size: the reference
        assert r.extra["why"] == (
            f"predicted {density:.2f}x the dense layer's time at {seq} tokens, density {density:.3f}; "
            "auto on cpu: torch (no measuring off CUDA)"
        )


def test_the_break_even_decides_by_density(llava, llava_batch):
    """Time ratio = density (margin 0.5): a wide A-shape (dense plan) falls back, a narrow one runs sparse; the
    decision follows the host-side planned density."""
    model, _ = llava
    seq = llava_batch["input_ids"].shape[1]
    decided = {}
    for window in (16, 400):
        method = vtoken.SparsePrefill(pattern="a_shape", sink=0, window=window, break_even=_speed(0.0, margin=0.5),
                                      **SMALL)  # fmt: skip
        with torch.no_grad(), vtoken.patched(model, method) as handle:
            model(**llava_batch)
        decided[window] = ({r.stage for r in handle.records}, method.planned_density(seq))
    assert decided[16][0] == {"sparse.layer0", "sparse.layer1"} and decided[16][1] < 0.5
    assert decided[400][0] == {"sparse"} and decided[400][1] > 0.5


def test_without_a_speed_model_min_length_decides(llava, llava_batch):
    """Off CUDA nothing is recorded, and break_even=False turns the model off: records say so."""
    model, _ = llava
    for break_even, source in [(True, "no speed model recorded for cpu"), (False, "break_even=False")]:
        method = vtoken.SparsePrefill(pattern="a_shape", window=40, break_even=break_even, **SMALL)
        with torch.no_grad(), vtoken.patched(model, method) as handle:
            model(**llava_batch)
        whys = {r.extra["why"] for r in handle.records}
        assert whys == {f"{source}: min_length=16 decides; auto on cpu: torch (no measuring off CUDA)"}


def test_auto_on_cpu_picks_without_measuring():
    from vtoken.kernels.sparse_speed import DENSE_SCORES_LIMIT, cpu_backend

    assert cpu_backend(2, 4, 600) == "torch" and cpu_backend(1, 4, 2048) == "torch"  # tiny models, tests
    assert 4 * 2048**2 <= DENSE_SCORES_LIMIT < 28 * 1024**2
    assert cpu_backend(1, 28, 1024) == "flex"  # a 7B's 28 heads at 1k tokens: compiling pays
    assert cpu_backend(1, 28, 32768) == "flex"  # the reference's dense scores would take 120 GB


def test_backend_choice_measures_once_per_shape_class():
    """auto on CUDA: each backend runs once to warm up, then is timed; the fastest is kept per shape class and its
    measured output returned; a second call of the class measures nothing."""
    from vtoken.kernels.sparse_speed import BackendChoice

    calls = []

    def timer(run, repeats):
        out = [run() for _ in range(repeats)][-1]
        return ([0.001, 0.0005, 0.003] if out == "flex" else [0.002] * 3), out

    choice = BackendChoice(timer=timer)
    runs = {name: (lambda name=name: calls.append(name) or name) for name in ("triton", "flex")}
    q, k = torch.zeros(1, 28, 5000, 128), torch.zeros(1, 4, 5000, 128)
    key = choice.shape_class(q, k, 64, 0.12, False, 0)
    assert key == ("cpu", "cpu", torch.float32, 1, 28, 4, 128, 64, 8192, 0.2, False, False)
    assert choice.known(key) is None
    assert choice.pick(key, runs) == ("flex", "flex")
    assert calls == ["triton", "flex"] + ["triton"] * 3 + ["flex"] * 3
    assert choice.known(key) == "flex" and choice.pick(key, runs) == ("flex", None) and len(calls) == 8
    assert choice.shape_class(q, k, 64, 0.5, False, 0) != key


def test_flex_backend_inside_a_model_equals_the_reference(llava, llava_batch):
    """backend='flex' (compiled FlexAttention on CPU) against backend='torch' on a padded batch: estimated plans,
    and the A-shape with its element limits."""
    from vtoken.kernels.block_sparse_flex import flex_unavailable

    if flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    model, _ = llava
    for params in [dict(density=0.3, sink=16, window=16), dict(pattern="a_shape", sink=5, window=40)]:
        outputs = {}
        for backend in ("torch", "flex"):
            method = vtoken.SparsePrefill(backend=backend, **params, **SMALL)
            with torch.no_grad(), vtoken.patched(model, method) as handle:
                outputs[backend] = model(**llava_batch).logits
            assert {r.extra["attention"] for r in handle.records} == {backend}
        assert (outputs["flex"] - outputs["torch"]).abs().max() <= 1e-4, params


def test_a_sparse_prefill_reads_nothing_back(llava_batch):
    """A sparse prefill forces no host sync beyond the unpatched model's, padded batch or not, at any depth: what a
    layer's mask is comes from how transformers built it, its key padding stays on the device, the decision is
    host arithmetic, and the records (achieved densities, kernel times) are built when read, after the call. A
    layer launches as many kernels for four rows as for two (no loop over rows)."""
    from vtoken.launches import count_launches

    unpadded = {k: v[1:].repeat(4, *([1] * (v.dim() - 1))) for k, v in llava_batch.items()}
    padded = {k: v.repeat(2, *([1] * (v.dim() - 1))) for k, v in llava_batch.items()}
    assert bool((padded["attention_mask"] == 0).any())
    counted = {}
    for layers in (2, 4):
        model, _ = tiny_llava(text_layers=layers)
        for pattern in ("vertical_slash", "a_shape"):
            for name, inputs, rows in (("unpadded", unpadded, 2), ("unpadded", unpadded, 4), ("padded", padded, 4)):
                method = vtoken.SparsePrefill(pattern=pattern, **SMALL)
                batch = {k: v[:rows] for k, v in inputs.items()}
                with torch.no_grad(), vtoken.patched(model, method) as handle:
                    model(**batch)  # transformers' first-call setup
                    with count_launches() as sparse:
                        model(**batch)
                    assert {r.stage for r in handle.records} == {f"sparse.layer{i}" for i in range(layers)}
                with torch.no_grad(), count_launches() as dense:
                    model(**batch)
                counted[layers, pattern, name, rows] = (sparse.kernels - dense.kernels, sparse.syncs - dense.syncs,
                                                        sparse.describe())  # fmt: skip
    assert all(syncs == 0 for _, syncs, _ in counted.values()), counted
    for pattern in ("vertical_slash", "a_shape"):
        per_layer = [(counted[4, pattern, "unpadded", rows][0] - counted[2, pattern, "unpadded", rows][0]) / 2
                     for rows in (2, 4)]  # fmt: skip
        assert per_layer[0] == per_layer[1], (pattern, counted)


def test_a_mask_it_did_not_see_built_runs_the_models_own_attention(llava, llava_batch):
    """A 4-D mask handed to the language model (not made by transformers' mask builder in this call) is not known
    to be causal + key padding without reading it: those layers run the model's own attention, exactly, and say
    why."""
    model, _ = llava
    lm_kwargs, _, _ = run_capturing_lm(model, llava_batch)
    padding = llava_batch["attention_mask"]
    mask = a_shape_mask(padding, 5, 40)
    want = stock_lm_with_mask(model, lm_kwargs, mask)
    with vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", sink=5, window=40, **SMALL)) as handle:
        got = stock_lm_with_mask(model, lm_kwargs, mask)
        notes = handle.records
    assert torch.equal(got, want)
    assert [r.stage for r in notes] == ["sparse", "sparse"]  # one note per layer
    assert all("not made by transformers' causal mask builder" in r.extra["dense"] for r in notes)


def test_a_failing_backend_under_auto_falls_back_with_one_warning(llava, llava_batch, monkeypatch):
    """backend='auto': a backend that raises leaves the forward to the model's own attention (the unpatched logits,
    exactly), with one warning naming the error, and the records say so in every later call too; a backend the
    user named raises."""
    import warnings

    from vtoken.adapters import sparse_prefill as adapter

    model, _ = llava

    def broken(backend, args):
        raise RuntimeError("kernel launch failed: out of resources")

    monkeypatch.setattr(adapter, "run_backend", broken)
    with torch.no_grad():
        want = model(**llava_batch).logits
        with vtoken.patched(model, vtoken.SparsePrefill(pattern="a_shape", window=40, **SMALL)) as handle:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first = model(**llava_batch).logits
                second = model(**llava_batch).logits
            notes = handle.records
        assert torch.equal(first, want) and torch.equal(second, want)
        assert len(caught) == 1 and "out of resources" in str(caught[0].message), [str(w.message) for w in caught]
        assert "falls back to the model's own attention" in str(caught[0].message)
        assert [r.stage for r in notes] == ["sparse"] and "failed earlier" in notes[0].extra["dense"]
        named = vtoken.SparsePrefill(pattern="a_shape", window=40, backend="torch", **SMALL)
        with vtoken.patched(model, named), pytest.raises(RuntimeError, match="out of resources"):
            model(**llava_batch)


@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_a_compiled_patched_model_equals_the_uncompiled_one(llava_batch, backend):
    """`model.compile()` after patch: the sparse attention function runs eagerly inside the compiled model (the
    custom op and FlexAttention's own compiled kernel included): the same logits and records."""
    from vtoken.kernels.block_sparse_flex import flex_unavailable

    if backend == "flex" and flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    model, _ = tiny_llava()
    method = vtoken.SparsePrefill(density=0.3, sink=16, window=16, backend=backend, **SMALL)
    with torch.no_grad(), vtoken.patched(model, method) as handle:
        want = model(**llava_batch).logits
        stages = [(r.stage, r.extra["attention"]) for r in handle.records]
        model.compile(backend="eager")
        got = model(**llava_batch).logits
        assert [(r.stage, r.extra["attention"]) for r in handle.records] == stages
    torch._dynamo.reset()
    assert torch.equal(got, want) and {s for s, _ in stages} == {"sparse.layer0", "sparse.layer1"}


def test_the_gpu_benchmark_configuration_builds_and_runs_on_meta():
    """`bench_sparse_prefill.py --device cuda` at full depth, built on the meta device (no memory, no GPU): the
    28-layer Qwen2.5-VL-7B shape runs its LLM (a config list left at the tiny model's length fails here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_sparse_prefill as bench
    finally:
        sys.path.pop(0)
    cfg = bench.settings(cuda=True)
    model, _ = bench.build_model(cfg, torch.device("meta"), torch.bfloat16)
    assert len(model.model.language_model.layers) == cfg["text"]["num_hidden_layers"] == 28
    with torch.no_grad():
        out = model.model.language_model(input_ids=torch.zeros(1, 64, dtype=torch.long, device="meta"))
    assert out.last_hidden_state.shape == (1, 64, 3584)
