"""The tower stage: a vision tower's time with and without PixelPrune and ToMe, at real tower sizes (issue 41).

Random weights at real configs: Qwen2.5-VL-7B's tower (32 blocks, 1280 wide, 14 px patches, windows of 112 px, full
attention in blocks 7/15/23/31), Qwen3-VL-8B's (27 blocks, 1152 wide, 16 px patches, DeepStack from blocks
8/16/24) and CLIP-L/14 at 336 px (LLaVA-1.5's: 24 blocks, 1024 wide, the feature layer the output of block 22).
Two generated images: a document/screen page (text lines, a title bar, white margins) and a natural-image stand-in
(scikit-image's astronaut photo). Per tower and image, configurations timed side by side in one process
(interleaved, `common.interleaved`): the unpatched tower, PixelPrune (threshold 0, the official; its selection
on the pixels' device included in its time) and, on CLIP, ToMe r = 16 (official: proportional attention,
weighted merges) and LightCompress's variant, and PixelPrune's LLaVA extension. Reported: LLM-level tokens in and
out, the tower's time (median, min-max), the ratio to the unpatched tower with its spread; the issue's targets:
PixelPrune's time within 1.1x of (kept rows / all rows) of the unpatched time, ToMe r = 16 <= 0.75x.

Time to first token through `vtoken.patch` (`--ttft`, on by default): whole VLMs at real widths (random weights):
Qwen2.5-VL-7B and Qwen3-VL-8B (towers as above, their 3584- / 4096-wide LLMs) with PixelPrune, LLaVA-1.5-7B (CLIP-L
336, a 4096-wide Llama) with ToMe r = 16, its LightCompress variant and PixelPrune; `generate` of one new token on
the same two images, unpatched and patched, interleaved. Target: on a GPU, Qwen3-VL-8B on the document page at
<= 0.6x of the unpatched TTFT at batch 1. On a CPU the LLMs are cut to `--cpu-llm-layers` layers, the Qwen towers
as above and the Qwen vocabularies to the tiny tokenizer's (they only size the embedding table and the one-token
head).

    python benchmarks/bench_tower.py --device cuda --out benchmarks/results    # full depth, bf16, 1344 px pages
    python benchmarks/bench_tower.py --out benchmarks/results                  # CPU cut (results/tower_cpu.md)
    python benchmarks/bench_tower.py --only ttft --out benchmarks/results      # TTFT alone (tower_ttft_cpu.md)

On a CPU the Qwen towers are cut to `--cpu-layers` blocks (Qwen2.5-VL keeps one full-attention block among
them; Qwen3-VL its DeepStack from the first blocks) and the pages are `--size` px (448 by default); CLIP runs at
full depth (`--cpu-clip-layers` cuts it; its feature layer stays the output of the second-to-last block, so ToMe
merges in all but the last). The table says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import vtoken  # noqa: E402
from vtoken.adapters import hf  # noqa: E402
from vtoken.adapters.tower import HALF, OPENAI_CLIP, KeptPatches, ToMeTower, qwen_pruned_tower  # noqa: E402
from vtoken.methods.base import TowerShape  # noqa: E402
from vtoken.methods.pixelprune import PixelPrune  # noqa: E402
from vtoken.methods.tome import ToMe  # noqa: E402


# ----------------------------------------------------------------- images
def document_page(width: int, height: int, seed: int = 0) -> Image.Image:
    """A screen/document page: a title bar, a sidebar, paragraphs of text lines (PIL's bitmap font) on white."""
    rng = np.random.default_rng(seed)
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    draw.rectangle([0, 0, width, height // 14], fill=(33, 66, 120))
    draw.text((width // 40, height // 40), "Quarterly report - vtoken tower stage", fill="white")
    draw.rectangle([0, height // 14, width // 6, height], fill=(240, 242, 245))
    words = ["token", "merge", "pixel", "tower", "vision", "budget", "layer", "patch", "image", "model"]
    y = height // 10
    while y < height - height // 12:
        if rng.random() < 0.15:  # a paragraph break
            y += height // 30
            continue
        line = " ".join(rng.choice(words, size=int(rng.integers(4, 12))))
        draw.text((width // 5, y), line, fill=(20, 20, 20))
        y += max(12, height // 60)
    return page


def natural_image(size: int) -> Image.Image:
    """A natural-image stand-in: scikit-image's astronaut photo (shipped in its wheel), resized."""
    from skimage import data

    return Image.fromarray(data.astronaut()).resize((size, size), Image.BICUBIC)


# ----------------------------------------------------------------- towers at real configs
def qwen25_tower(layers: int | None, device, dtype):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    full = [7, 15, 23, 31] if layers is None else [layers - 1]  # the cut keeps one full-attention block
    vision = dict(depth=layers or 32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=full)  # fmt: skip
    config = Qwen2_5_VLConfig(vision_config=vision).vision_config
    shape = TowerShape("qwen2.5-vl", merge=2, patch=14, temporal=2, mean=OPENAI_CLIP[0], std=OPENAI_CLIP[1])
    return _built(Qwen2_5_VisionTransformerPretrainedModel, config, device, dtype), shape


def qwen3_tower(layers: int | None, device, dtype):
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    deepstack = [8, 16, 24] if layers is None else list(range(min(3, layers)))
    vision = dict(depth=layers or 27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                  deepstack_visual_indexes=deepstack)  # fmt: skip
    config = Qwen3VLConfig(vision_config=vision).vision_config
    shape = TowerShape("qwen3-vl", merge=2, patch=16, temporal=2, mean=HALF[0], std=HALF[1])
    return _built(Qwen3VLVisionModel, config, device, dtype), shape


def clip_tower(layers: int | None, device, dtype):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    depth = layers or 24
    config = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=depth,
                              num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)  # fmt: skip
    shape = TowerShape("llava-1.5", cls=True, feature_block=depth - 2, patch=14, mean=OPENAI_CLIP[0],
                       std=OPENAI_CLIP[1])  # fmt: skip
    return _built(CLIPVisionModel, config, device, dtype), shape


def _built(cls, config, device, dtype):
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)


def gpu_towers() -> dict:
    """What `--device cuda` builds: (device, dtype) -> (tower, TowerShape), at full depth."""
    return {"qwen2.5-vl-7b": lambda d, t: qwen25_tower(None, d, t), "qwen3-vl-8b": lambda d, t: qwen3_tower(None, d, t),
            "clip-l-336": lambda d, t: clip_tower(None, d, t)}  # fmt: skip


# ----------------------------------------------------------------- inputs
def qwen_pixels(image: Image.Image, shape: TowerShape, size: int, device):
    """The Qwen processor's pixel rows and grid for `image` at about size x size pixels."""
    from transformers import Qwen2VLImageProcessor

    side = shape.patch * shape.merge
    processor = Qwen2VLImageProcessor(patch_size=shape.patch, merge_size=shape.merge, image_mean=list(shape.mean),
                                      image_std=list(shape.std), min_pixels=side * side,
                                      max_pixels=size * size)  # fmt: skip
    out = processor(images=[image.resize((size, size), Image.BICUBIC)], return_tensors="pt")
    return out["pixel_values"].to(device), [tuple(g) for g in out["image_grid_thw"].tolist()]


def clip_pixels(image: Image.Image, shape: TowerShape, device):
    array = np.asarray(image.convert("RGB").resize((336, 336), Image.BICUBIC), dtype=np.float32) / 255
    pixels = (torch.from_numpy(array).permute(2, 0, 1) - torch.tensor(shape.mean)[:, None, None]) / torch.tensor(
        shape.std
    )[:, None, None]
    return pixels[None].to(device)


# ----------------------------------------------------------------- measurements
def clock_for(device: torch.device):
    """Wall time on a GPU; on a CPU the calling thread's CPU time (one torch thread: the work done, not what other
    processes on a shared machine took from it)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def measure_qwen(tower, shape, pixels, grids, repeats, device, dtype) -> dict:
    method = PixelPrune()
    selected = method.select_input(pixels, grids, shape)
    total = pixels.shape[0] // shape.merge**2
    grid_thw = torch.tensor(grids, device=device)

    def unpatched():
        with torch.no_grad():
            return tower(pixels.type(dtype), grid_thw=grid_thw)

    def pruned():
        with torch.no_grad():
            chosen = method.select_input(pixels, grids, shape)
            return qwen_pruned_tower(tower, pixels, grids, chosen)

    def selection():
        return method.select_input(pixels, grids, shape)

    configs = {"unpatched": unpatched, "pixelprune": pruned, "selection": selection}
    timed = common.interleaved(configs, repeats, device, clock=clock_for(device))
    kept = sum(selected.counts) / total
    row = _rows(timed, {"unpatched": total, "pixelprune": sum(selected.counts), "selection": None}, total)
    ratio = timed["pixelprune"]["median_s"] / timed["unpatched"]["median_s"]
    row["pixelprune"]["target"] = f"time ratio {ratio:.2f} vs 1.1 x kept {1.1 * kept:.2f}: " + (
        "met" if ratio <= 1.1 * kept else "missed"
    )
    return row


def measure_clip(tower, shape, pixels, repeats, device, dtype) -> dict:
    layer = shape.feature_block + 1
    attention = hf.attention_implementation(tower)
    pixels = pixels.type(dtype)

    def run():
        with torch.no_grad():
            return hf.hidden_states(tower, [layer], pixels)[0]

    def tome_context(method):
        def context():
            patch = ToMeTower(method, tower.encoder.layers, shape, attention)
            patch.install()
            try:
                yield
            finally:
                patch.remove()

        return _contextmanager(context)

    prune = PixelPrune()
    selected = prune.select_input(pixels.float(), [(24, 24)], shape)

    def pixelprune():
        chosen = prune.select_input(pixels.float(), [(24, 24)], shape)
        with KeptPatches(tower.encoder, chosen, shape.cls, attention, pixels.device):
            return run()

    official, light = ToMe(r=16), ToMe(r=16, prop_attn=False, weighted=False)
    configs = {"unpatched": run, "tome r=16": run, "tome r=16 (LightCompress)": run, "pixelprune": pixelprune}
    contexts = {"tome r=16": tome_context(official), "tome r=16 (LightCompress)": tome_context(light)}
    timed = common.interleaved(configs, repeats, device, contexts=contexts, clock=clock_for(device))
    n = 24 * 24
    out_tokens = official.count_before_encoding([(24, 24)], tower=shape)[0]
    row = _rows(timed, {"unpatched": n, "tome r=16": out_tokens, "tome r=16 (LightCompress)": out_tokens,
                        "pixelprune": selected.counts[0]}, n)  # fmt: skip
    for name in ("tome r=16", "tome r=16 (LightCompress)"):
        ratio = timed[name]["median_s"] / timed["unpatched"]["median_s"]
        row[name]["target"] = f"time ratio {ratio:.2f} vs 0.75: " + ("met" if ratio <= 0.75 else "missed")
    return row


# ----------------------------------------------------------------- time to first token through vtoken.patch
def qwen25_vl_7b(blocks: int | None, layers: int | None, device, dtype, size: int):
    """Qwen2.5-VL-7B at real widths (random weights; `blocks` tower blocks, `layers` LLM layers, None: all):
    (model, processor) taking pages of about size x size px."""
    from bench_families import _build, qwen_7b_lm

    from vtoken.zoo import tiny_qwen2_5_vl

    text = qwen_7b_lm(layers)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    if layers is not None:
        del text["vocab_size"]  # the tiny tokenizer's: it only sizes the embedding table and the head
    full = [7, 15, 23, 31] if blocks is None else [blocks - 1]  # a cut keeps one full-attention block
    vision = dict(depth=blocks or 32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  window_size=112, fullatt_block_indexes=full)  # fmt: skip
    model, processor = _build(tiny_qwen2_5_vl, {"text_config": text, "vision_config": vision}, device, dtype)
    processor.image_processor.max_pixels = size * size
    return model, processor


def qwen3_vl_8b(blocks: int | None, layers: int | None, device, dtype, size: int):
    """Qwen3-VL-8B at real widths (random weights), as benchmarks/bench_qwen3_vl.py builds it (`blocks`, `layers`:
    as `qwen25_vl_7b`)."""
    from bench_families import _build

    from vtoken.zoo import tiny_qwen3_vl

    text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers or 36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})  # fmt: skip
    if layers is None:
        text["vocab_size"] = 151936
    deepstack = [8, 16, 24] if blocks is None else list(range(min(3, blocks, layers or 36)))
    vision = dict(depth=blocks or 27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  num_position_embeddings=2304, deepstack_visual_indexes=deepstack)  # fmt: skip
    model, processor = _build(tiny_qwen3_vl, {"text_config": text, "vision_config": vision}, device, dtype)
    processor.image_processor.size = {"shortest_edge": 64 * 64, "longest_edge": size * size}
    return model, processor


def llava_15_7b(blocks: int | None, layers: int | None, device, dtype, size: int):
    """LLaVA-1.5-7B at real widths (random weights; CLIP-L 336 at full depth whatever `blocks`), as
    benchmarks/bench_llava.py builds it."""
    from bench_llava import build_model

    return build_model(layers or 32, device, dtype)


TTFT_MODELS = {
    "qwen2.5-vl-7b": (qwen25_vl_7b, {"pixelprune": PixelPrune}),
    "qwen3-vl-8b": (qwen3_vl_8b, {"pixelprune": PixelPrune}),
    "llava-1.5-7b": (llava_15_7b, {"tome r=16": ToMe, "tome r=16 (LightCompress)":
                                   lambda: ToMe(prop_attn=False, weighted=False), "pixelprune": PixelPrune}),
}  # fmt: skip


def gpu_models() -> dict:
    """What `--device cuda` builds for its TTFT rows: (device, dtype) -> (model, processor), at full depth."""
    return {key: (lambda device, dtype, build=build: build(None, None, device, dtype, 1344))
            for key, (build, _) in TTFT_MODELS.items()}  # fmt: skip


def measure_ttft(model, processor, image: Image.Image, methods: dict, repeats: int, device, dtype) -> dict:
    """TTFT (`generate` of one token) of the unpatched model and of every method through `vtoken.patch`, on one
    image; visual tokens reaching the LLM and the tower stage's own time (its records) per config."""
    from vtoken.zoo import build_prompt

    inputs = processor(images=[image], text=[build_prompt(processor, "What does the page say?")], return_tensors="pt")
    # fp32 pixels, as the processor makes them: PixelPrune selects on them (half precision can merge distinct pixel
    # values); the towers cast what they run on (CLIP's patch embedding, Qwen's gathered rows)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    placeholders = sum(int((inputs["input_ids"] == i).sum()) for i in (model.config.image_token_id,))
    tokens, seconds = {"unpatched": placeholders}, {}

    @torch.inference_mode()
    def generate():
        model.generate(**inputs, max_new_tokens=1, do_sample=False)

    configs, contexts = {"unpatched": generate}, {}
    for name, make in methods.items():

        @_contextmanager
        def patched(name=name, make=make):
            with vtoken.patched(model, make()) as handle:
                yield
                records = [r for r in handle.records if r.stage == "tower"]
                tokens[name] = sum(r.tokens_out for r in records)
                seconds.setdefault(name, []).append(sum(r.seconds for r in records))

        configs[name], contexts[name] = generate, patched
    timed = common.interleaved(configs, repeats, device, contexts=contexts, clock=clock_for(device))
    rows = {}
    for name, result in timed.items():
        rows[name] = {"visual_tokens": tokens[name], **common.timing_row(timed["unpatched"], result),
                      "ttft_runs_ms": [t * 1e3 for t in result["times_s"]]}  # fmt: skip
        if name in seconds:
            rows[name]["tower_stage_ms"] = float(np.median(seconds[name][1:] or seconds[name])) * 1e3
    return rows


def ttft_lines(title: str, rows: dict, target: str | None = None) -> list[str]:
    header = "| config | visual tokens (LLM input) | TTFT ms (median, min-max) | speedup (spread) | tower stage ms |"
    lines = ["", title, "", header, "|---|---:|---:|---|---:|"]
    for name, row in rows.items():
        speed = "(baseline)" if name == "unpatched" else row["speedup_text"]
        stage = f"{row['tower_stage_ms']:.2f}" if "tower_stage_ms" in row else ""
        lines.append(f"| {name} | {row['visual_tokens']} | {common.ttft_cell(row)} | {speed} | {stage} |")
    if target is not None:
        lines.append(f"\n{target}")
    return lines


def _contextmanager(function):
    from contextlib import contextmanager

    return contextmanager(function)


def _rows(timed: dict, tokens: dict, total: int) -> dict:
    base = timed["unpatched"]
    rows = {}
    for name, result in timed.items():
        t = result["timing"]
        row = {"tokens_in": total, "tokens_out": tokens[name], "ms": t.median * 1e3, "min_ms": t.low * 1e3,
               "max_ms": t.high * 1e3, "runs": t.n, "times_ms": [x * 1e3 for x in result["times_s"]]}  # fmt: skip
        if name not in ("unpatched", "selection"):
            ratio = common.speedup(base, result)
            row.update(time_ratio=1 / ratio.value, speedup=ratio.value, speedup_text=str(ratio))
        rows[name] = row
    return rows


def table(title: str, rows: dict) -> list[str]:
    header = "| config | tokens in -> out | kept | tower ms (median, min-max) | speedup (spread) | target |"
    lines = ["", title, "", header, "|---|---:|---:|---:|---|---|"]
    for name, row in rows.items():
        out = row["tokens_out"]
        kept = f"{out / row['tokens_in']:.0%}" if out is not None else ""
        tokens = f"{row['tokens_in']} -> {out}" if out is not None else "(selection alone)"
        spread = f"{row['ms']:.1f} ({row['min_ms']:.1f}-{row['max_ms']:.1f})"
        lines.append(f"| {name} | {tokens} | {kept} | {spread} | {row.get('speedup_text', '')} | "
                     f"{row.get('target', '')} |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per config (default: 10 cuda, 3 cpu)")
    parser.add_argument("--cpu-layers", type=int, default=2, help="Qwen tower blocks on a CPU")
    parser.add_argument("--cpu-clip-layers", type=int, default=24, help="CLIP blocks on a CPU (default: all)")
    parser.add_argument("--size", type=int, default=None, help="Qwen page side in px (default: 1344 cuda, 448 cpu)")
    parser.add_argument("--only", choices=["qwen2.5-vl", "qwen3-vl", "clip", "ttft"], default=None)
    parser.add_argument("--no-ttft", dest="ttft", action="store_false", help="towers only, no whole-model TTFT")
    parser.add_argument("--cpu-llm-layers", type=int, default=1, help="LLM layers of the TTFT models on a CPU")
    common.add_tiny(parser)
    args = parser.parse_args()
    if args.tiny:  # the smoke run: the CLIP tower alone, two blocks (ToMe merges in the first), a small page
        args.only, args.ttft, args.cpu_clip_layers, args.size = "clip", False, 2, 224
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)  # timed by thread CPU time (see clock_for)
    repeats = args.repeats or (10 if cuda else 3)
    layers, clip_layers = (None, None) if cuda else (args.cpu_layers, args.cpu_clip_layers)
    size = args.size or (1344 if cuda else 448)
    images = {"document": document_page(size, size), "natural": natural_image(size)}
    results, lines = {}, []
    for key, build in (("qwen2.5-vl", qwen25_tower), ("qwen3-vl", qwen3_tower)):
        if args.only not in (None, key):
            continue
        tower, shape = build(layers, device, dtype)
        depth = "full depth" if layers is None else f"cut to {layers} blocks"
        for name, image in images.items():
            pixels, grids = qwen_pixels(image, shape, size, device)
            title = f"{key} tower ({depth}), {name} image, grid t,h,w = {list(grids[0])}"
            results[title] = measure_qwen(tower, shape, pixels, grids, repeats, device, dtype)
            lines += table(title, results[title])
        del tower
    if args.only in (None, "clip"):
        tower, shape = clip_tower(clip_layers, device, dtype)
        depth = "full depth" if clip_layers in (None, 24) else f"cut to {clip_layers} blocks"
        for name, image in images.items():
            title = f"clip-l-336 tower ({depth}; feature layer: block {shape.feature_block}'s output), {name} image"
            results[title] = measure_clip(tower, shape, clip_pixels(image, shape, device), repeats, device, dtype)
            lines += table(title, results[title])
        del tower
    if args.ttft and args.only in (None, "ttft"):
        for key, (build, methods) in TTFT_MODELS.items():
            model, processor = build(layers, None if cuda else args.cpu_llm_layers, device, dtype, size)
            depth = "full depth" if cuda else f"LLM cut to {args.cpu_llm_layers} layer(s), tower as above"
            for name, image in images.items():
                title = f"{key} TTFT through vtoken.patch ({depth}), {name} image"
                rows = measure_ttft(model, processor, image, methods, repeats, device, dtype)
                target = None
                if key == "qwen3-vl-8b" and name == "document":
                    ratio = rows["pixelprune"]["ttft_ms"] / rows["unpatched"]["ttft_ms"]
                    verdict = ("met" if ratio <= 0.6 else "missed") if cuda else "a GPU target: not judged on a CPU"
                    target = (
                        f"Target (issue 41): TTFT <= 0.6x of unpatched at batch 1 on a GPU; {ratio:.2f}x: {verdict}"
                    )
                results[title] = rows
                lines += ttft_lines(title, rows, target)
            del model
    notes = [
        "",
        "PixelPrune's time includes its selection on the pixels' device (one read of the kept mask); the "
        "'selection' row times it alone. ToMe's counts hold at any depth; on a cut tower it merges in fewer blocks.",
        "On a CPU the times are the thread's CPU time with one torch thread (a shared machine's other load left out).",
    ]
    name = "tower_ttft" if args.only == "ttft" else "tower"  # the TTFT part alone: its own result files
    common.report(name, device, dtype, repeats, results, lines + notes, args.out)


if __name__ == "__main__":
    main()
