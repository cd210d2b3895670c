"""Qwen2.5-VL-7B-shaped image and LLaVA-OneVision-7B-shaped 32-frame video: TTFT and peak memory vs the oracle.

Real widths and depths (random weights): Qwen2.5-VL-7B (windowed ViT, 32 blocks, 1280 wide; Qwen2.5-7B LM, 28
layers, 3584 wide) on an 896 x 896 image (1,024 visual tokens); LLaVA-OneVision-7B (SigLIP-so400m, 26 layers,
1152 wide; Qwen2-7B LM) on a 32-frame video (32 x 196 pooled tokens + 1 newline). On a CPU the LM and towers are
cut to `--cpu-layers` layers to fit; the table says so.

Configurations interleaved in one process: unpatched; `random` and `pool` at each budget; and the oracle at the
same budget, i.e. the stock vision encoder followed by `generate` on the already-pruned inputs (prepared before
timing: zero selection and bookkeeping cost), the best a method keeping k tokens per image/frame can do.

    python benchmarks/bench_families.py --device cuda
"""

from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import vtoken  # noqa: E402
from vtoken.images import example_clip, example_image  # noqa: E402
from vtoken.zoo import build_prompt, tiny_onevision, tiny_qwen2_5_vl  # noqa: E402


def _build(builder, overrides: dict, device, dtype):
    """A family's tiny builder re-dimensioned to real shapes (the processor and tokenizer are reused)."""
    model, processor = builder()
    config = model.config
    for section, values in common.shaped(overrides).items():
        target = getattr(config, section) if section != "top" else config
        for key, value in values.items():
            setattr(target, key, value)
        if "num_hidden_layers" in values and getattr(target, "layer_types", None) is not None:
            # per-layer attention types follow the depth: the config class derives them again from its settings
            settings = {key: value for key, value in target.to_dict().items() if key != "layer_types"}
            target.layer_types = type(target)(**settings).layer_types
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = type(model)(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    vtoken.remember_tokenizer(model, processor)  # for methods that read the prompt's question (MMTok)
    return model, processor


def qwen_7b_lm(layers: int | None) -> dict:
    """Qwen2/Qwen2.5-7B language-model shape (both 7B VLMs below use it)."""
    return dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers or 28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064)  # fmt: skip


def qwen25_vl_7b(layers: int | None, device, dtype):
    text = qwen_7b_lm(layers)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    depth = layers or 32
    vision = dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        window_size=112,
        # the full-attention blocks of the real tower that a cut one has (at least its last block)
        fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth] or [depth - 1],
    )
    model, processor = _build(tiny_qwen2_5_vl, {"text_config": text, "vision_config": vision}, device, dtype)
    processor.image_processor.max_pixels = 896 * 896
    image = example_image(896)
    inputs = processor(images=[image], text=[build_prompt(processor, "What is in the image?")], return_tensors="pt")
    return model, inputs


def onevision_7b(layers: int | None, device, dtype, frames: int = 32):
    text = qwen_7b_lm(layers)
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers or 26, num_attention_heads=16)
    model, processor = _build(tiny_onevision, {"text_config": text, "vision_config": vision}, device, dtype)
    prompt = build_prompt(processor, "What happens in the video?", num_images=0, num_videos=1)
    inputs = processor(videos=[example_clip(frames, size=384)], text=[prompt], return_tensors="pt")
    return model, inputs


def first_k(budget):
    """A zero-cost 'method' for the oracle: the first k tokens of every crop/frame."""

    class FirstK(vtoken.ScoreMethod):
        name = "first-k"

        def score(self, tokens):
            return -torch.arange(tokens.num_tokens, device=tokens.features.device, dtype=torch.float32).expand(
                tokens.num_crops, -1
            )

    return FirstK(budget=budget)


BASELINES = {"random": lambda b: vtoken.Random(budget=b), "pool": lambda b: vtoken.Pool(budget=b)}


def measure(name, model, inputs, budgets, repeats, device, dtype, encoder, methods=BASELINES):
    """TTFT, selection time and peak memory: unpatched, then at every budget each of `methods` (label -> budget ->
    method) and the oracle keeping the same number of tokens."""
    inputs = inputs.to(device)
    for key, value in inputs.items():
        if value.is_floating_point():
            inputs[key] = value.to(dtype)
    generate = dict(max_new_tokens=1, do_sample=False)
    configs, contexts, tokens_kept = {}, {}, {}
    selection: dict[str, list[float]] = {}

    @torch.inference_mode()
    def stock():
        model.generate(**inputs, **generate)

    configs["unpatched"] = stock
    with torch.inference_mode(), vtoken.patched(model, "random", budget=1.0) as handle:
        model(**inputs)
        total = sum(r.tokens_in for r in handle.records)
    tokens_kept["unpatched"] = total
    for budget in budgets:
        for label, make in methods.items():
            key, method = f"{label}@{budget:g}", make(budget)

            @contextmanager
            def patched(method=method, key=key):
                with vtoken.patched(model, method) as handle:
                    yield
                    selection.setdefault(key, []).append(sum(r.seconds for r in handle.records))
                    tokens_kept[key] = sum(r.tokens_out for r in handle.records)

            configs[key], contexts[key] = stock, patched
        with torch.inference_mode(), vtoken.patched(model, first_k(budget)) as handle:
            prepared, _ = handle.adapter.calls.prepare(dict(inputs))
            tokens_kept[f"oracle@{budget:g}"] = sum(r.tokens_out for r in handle.records)

        @torch.inference_mode()
        def oracle(prepared=prepared, budget=budget):
            encoder(model, inputs, budget)  # the vision encoder's cost, its output unused
            model.generate(**prepared, **generate)

        configs[f"oracle@{budget:g}"] = oracle
    timed = common.interleaved(configs, repeats, device, warmup=1, contexts=contexts)
    rows = {}
    for key, result in timed.items():
        oracle = None
        if "@" in key and not key.startswith("oracle"):
            oracle = timed["oracle@" + key.split("@")[1]]
        row = {"visual_tokens": tokens_kept[key], **common.timing_row(timed["unpatched"], result, oracle),
               "peak_mb": result["peak_bytes"] / 2**20}  # fmt: skip
        if key in selection:
            row["selection_ms"] = statistics.median(selection[key][1:]) * 1e3
            row["selection_share"] = row["selection_ms"] / (timed["unpatched"]["median_s"] * 1e3)
        rows[key] = row
    return rows


def gpu_models() -> dict:
    """What `--device cuda` builds, by name: (device, dtype) -> (model, inputs) at full depth (tests build them on
    the meta device, so the GPU path cannot rot unseen)."""
    return {
        "qwen2.5-vl-7b": lambda device, dtype: qwen25_vl_7b(None, device, dtype),
        "llava-onevision-7b video": lambda device, dtype: onevision_7b(None, device, dtype),
    }


def image_encoder(model, inputs, budget):
    """Qwen: the stock vision encoder (methods select after its merger, so it runs in full for them too)."""
    model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])


def video_encoder(model, inputs, budget):
    """OneVision: the stock video encoder (methods select after its projector and pooling)."""
    model.model.get_video_features(inputs["pixel_values_videos"])


def main() -> None:
    parser = common.ttft_parser(__doc__, "LM/tower depth on a CPU")
    parser.add_argument("--only", choices=["qwen", "onevision"], default=None)
    parser.add_argument("--frames", type=int, default=32)
    args = parser.parse_args()
    device, dtype, layers, repeats = common.run_settings(args)
    cuda = device.type == "cuda"

    results, lines = {}, []
    cases = [
        ("qwen2.5-vl-7b image 896x896", "qwen", qwen25_vl_7b, image_encoder),
        ("llava-onevision-7b video", "onevision", lambda *a: onevision_7b(*a, frames=args.frames), video_encoder),
    ]
    for title, key, build, encoder in cases:
        if args.only and args.only != key:
            continue
        model, inputs = build(layers, device, dtype)
        rows = measure(title, model, inputs, args.budgets, repeats, device, dtype, encoder)
        results[title] = rows
        depth = "full depth" if layers is None else f"LM and tower cut to {layers} layer(s)"
        lines += common.ttft_table(f"{title} ({depth}, prompt {inputs['input_ids'].shape[1]} tokens):", rows)
        del model
        if cuda:
            torch.cuda.empty_cache()
    common.report("families", device, dtype, repeats, results, lines, args.out)


if __name__ == "__main__":
    main()
