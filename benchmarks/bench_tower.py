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

    python benchmarks/bench_tower.py --device cuda --out benchmarks/results    # full depth, bf16, 1344 px pages
    python benchmarks/bench_tower.py --out benchmarks/results                  # CPU cut (results/tower_cpu.md)

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
    parser.add_argument("--only", choices=["qwen2.5-vl", "qwen3-vl", "clip"], default=None)
    args = parser.parse_args()
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
    notes = [
        "",
        "PixelPrune's time includes its selection on the pixels' device (one read of the kept mask); the "
        "'selection' row times it alone. ToMe's counts hold at any depth; on a cut tower it merges in fewer blocks.",
        "On a CPU the times are the thread's CPU time with one torch thread (a shared machine's other load left out).",
    ]
    common.report("tower", device, dtype, repeats, results, lines + notes, args.out)


if __name__ == "__main__":
    main()
