"""Qwen3-VL-8B-shaped image and video: TTFT and peak memory of random/pool vs the oracle, DeepStack included.

Real widths (random weights): Qwen3-VL-8B's tower (27 blocks, 1152 wide, 16 px patches, DeepStack from blocks
8/16/24) and LM (36 layers, 4096 wide, 32 heads / 8 KV heads, head_dim 128, QK-norm, interleaved M-RoPE) on an
896 x 896 image (784 visual tokens) and a 16-frame 448 x 448 clip (8 temporal patches x 196 tokens, each after its
`<t seconds>` timestamp; `--frames`). On a CPU the LM and tower are cut to `--cpu-layers` layers (DeepStack from
the first min(3, layers) blocks into as many LM layers) and the vocabulary to the tiny tokenizer's (it only sizes
the embedding table and the one-token LM head); the table says so.

Configurations interleaved in one process, as `bench_families.py`: unpatched; `random` and `pool` at each budget;
the oracle (stock encoder, then `generate` on inputs pruned beforehand: zero selection cost). A method's DeepStack
gathering is part of its measured time.

    python benchmarks/bench_qwen3_vl.py --device cuda           # full depth, bf16
    python benchmarks/bench_qwen3_vl.py --budgets 0.25 --frames 8    # CPU cut (results/qwen3_vl_cpu.md)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from bench_families import _build, measure  # noqa: E402

from vtoken.images import example_clip, example_image  # noqa: E402
from vtoken.zoo import build_prompt, tiny_qwen3_vl  # noqa: E402


def qwen3_vl_8b(layers: int | None, device, dtype, video: bool, frames: int = 16):
    depth = layers or 36
    text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=depth, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})  # fmt: skip
    if layers is None:
        text["vocab_size"] = 151936
    deepstack = [8, 16, 24] if layers is None else list(range(min(3, layers)))
    vision = dict(depth=layers or 27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  num_position_embeddings=2304, deepstack_visual_indexes=deepstack)  # fmt: skip
    model, processor = _build(tiny_qwen3_vl, {"text_config": text, "vision_config": vision}, device, dtype)
    if video:
        processor.video_processor.size = {"shortest_edge": 64 * 64, "longest_edge": 448 * 448 * frames}
        prompt = build_prompt(processor, "What happens in the video?", num_images=0, num_videos=1)
        inputs = processor(videos=[example_clip(frames, size=448)], text=[prompt], return_tensors="pt",
                           do_sample_frames=False)  # fmt: skip
    else:
        processor.image_processor.size = {"shortest_edge": 64 * 64, "longest_edge": 896 * 896}
        prompt = build_prompt(processor, "What is in the image?")
        inputs = processor(images=[example_image(896)], text=[prompt], return_tensors="pt")
    return model, inputs


def gpu_models() -> dict:
    """What `--device cuda` builds (see bench_families.gpu_models)."""
    return {key: (lambda device, dtype, video=key == "video": qwen3_vl_8b(None, device, dtype, video=video))
            for key in ("image", "video")}  # fmt: skip


def image_encoder(model, inputs, budget):
    """The stock vision encoder with its DeepStack mergers (methods select after them)."""
    model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])


def video_encoder(model, inputs, budget):
    model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])


def main() -> None:
    parser = common.ttft_parser(__doc__, "LM/tower depth on a CPU")
    parser.add_argument("--only", choices=["image", "video"], default=None)
    parser.add_argument("--frames", type=int, default=16, help="video frames (two per temporal patch)")
    args = parser.parse_args()
    device, dtype, layers, repeats = common.run_settings(args)
    results, lines = {}, []
    for key, encoder in (("image", image_encoder), ("video", video_encoder)):
        if args.only and args.only != key:
            continue
        model, inputs = qwen3_vl_8b(layers, device, dtype, video=key == "video", frames=args.frames)
        grid = inputs[f"{'video' if key == 'video' else 'image'}_grid_thw"][0].tolist()
        title = f"qwen3-vl-8b {key} (grid t,h,w = {grid})"
        results[title] = measure(title, model, inputs, args.budgets, repeats, device, dtype, encoder)
        depth = "full depth" if layers is None else f"LM and tower cut to {layers} layer(s), tiny vocabulary"
        lines += common.ttft_table(f"{title} ({depth}, prompt {inputs['input_ids'].shape[1]} tokens):", results[title])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    common.report("qwen3_vl", device, dtype, repeats, results, lines, args.out)


if __name__ == "__main__":
    main()
