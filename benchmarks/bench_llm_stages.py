"""The LLM stages on a LLaVA-1.5-shaped model: MustDrop at the official threshold settings and FastV at 50/25 %,
next to the unpatched model: time to first token, decode tokens/s, KV-cache bytes after the prefill, peak
memory, and the visual tokens the LLM sees (entering it, and averaged over its layers as MustDrop reports).

A second table puts DART, PyramidDrop and SparseVLM (their papers' settings) next to FastV and the oracle at the
same layer-averaged visual tokens: FastV dropping at the method's first drop point to the count that gives the
same average, and the oracle feeding the LLM that average from its first layer with zero selection cost (the
stock model on a shorter prompt). It reports each one's TTFT, its speedup against both, and its selection time
(the prefill records' seconds) as a share of TTFT. On a CPU the LLM's 32 layers are cut to 16 and the drop layers
halved (PyramidDrop 4/8/12, SparseVLM 1/3/7; DART's layer 2 stays), and both tables time the process's CPU time
with one torch thread: on a shared machine the wall clock mostly measures the wait for a core.

A batch table (`--batches`, default 1, 8 and 32 on a GPU, 1 and 2 on a CPU) runs every LLM-stage method at its
issue-31 setting (FastV layer 2 at 25 %, DART 128, PyramidDrop, SparseVLM 192, MustDrop (0.011, 0.01)) on a batch of
the same image and prompt, next to the unpatched model and the oracle at the method's layer-averaged visual tokens,
at each batch size: TTFT and the two ratios the targets are stated in (>= 0.97x of unpatched at batch 1, >= 0.9x of
the oracle at batch 8 and 32).

A third table (its own results file, `llm_stages_video_*`) runs DyCoke on a LLaVA-OneVision-7B-shaped model and a
video (`--frames`, 196 pooled tokens a frame + 1 newline): the official settings, the same with p = 0 (its stage 1
and the decode stage's per-step row, nothing masked: what the decode stage costs), VidCom2, FastVID and HoliTom at
DyCoke's retention (their other settings official; FastVID and HoliTom merge, so their counts follow the data) and
the oracle (the first tokens of every frame at that retention, zero selection cost); TTFT, decode tokens/s and
selection time (the encoder and decode records' seconds). A selecting step gathers the kept entries of layers
L and later (as the official code does), so its attention reads only them; a step whose row did not move attends to
everything, and every step reads one attention row.

On a GPU: CLIP ViT-L/14-336 + Vicuna-7B at full depth, bf16. On a CPU the widths and depths are cut (the table
says how): the LLM keeps 16 layers so that MustDrop's drop points 2, 6, 10, 14 all exist; the tower keeps 4
(the merge after layer 0, the feature layer, the key set from the last). Random weights: the thresholds drop
what random attention maps make them drop, so the token columns matter as much as the times.

    python benchmarks/bench_llm_stages.py                  # CPU, cut shapes
    python benchmarks/bench_llm_stages.py --device cuda    # GPU, real shapes
    python benchmarks/bench_llm_stages.py --video-only     # only the video methods table
"""

from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from bench_families import _build, first_k, qwen_7b_lm  # noqa: E402

import vtoken  # noqa: E402
from vtoken.adapters import hf  # noqa: E402
from vtoken.images import example_clip, example_image  # noqa: E402
from vtoken.timing import Timing, compare  # noqa: E402
from vtoken.zoo import build_prompt, tiny_llava, tiny_onevision  # noqa: E402

QUESTION = "What is in the image? Describe every object, its colour and its position."
CONFIGS = {
    "unpatched": None,
    "mustdrop (0.001, 0.001)": lambda: vtoken.MustDrop(global_thr=0.001, individual_thr=0.001),
    "mustdrop (0.0012, 0.001)": lambda: vtoken.MustDrop(global_thr=0.0012, individual_thr=0.001),
    "mustdrop (0.011, 0.01)": lambda: vtoken.MustDrop(global_thr=0.011, individual_thr=0.01),
    "fastv 50%": lambda: vtoken.FastV(layer=2, keep=0.5),
    "fastv 25%": lambda: vtoken.FastV(layer=2, keep=0.25),
}


def shapes(cuda: bool) -> dict:
    if cuda:
        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
        text = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32064)  # fmt: skip
    else:
        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16)
        text = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=16, num_attention_heads=8,
                    num_key_value_heads=8, vocab_size=32064)  # fmt: skip
    return {"vision_config": {**vision, "projection_dim": 768}, "text_config": text}


def equal_average_methods(cuda: bool) -> dict:
    """The issue-26 methods at their papers' settings, drop layers halved on the CPU's 16-layer LLM."""

    def layers(*official: int) -> tuple[int, ...]:
        return official if cuda else tuple(k // 2 for k in official)

    return {
        "dart 128 (keep 0.222)": lambda: vtoken.DART(layer=2, keep=0.222),
        "dart 64 (keep 64)": lambda: vtoken.DART(layer=2, keep=64),
        "pyramiddrop (0.5, 0.25, 0.125)": lambda: vtoken.PyramidDrop(layers=layers(8, 16, 24)),
        "sparsevlm 192": lambda: vtoken.SparseVLM(budget=192, layers=layers(2, 6, 15)),
        "sparsevlm 64": lambda: vtoken.SparseVLM(budget=64, layers=layers(2, 6, 15)),
    }


def fastv_at_average(first_drop: int, average: float, layers: int, visual: int) -> int:
    """FastV's count after layer `first_drop` giving `average` visual tokens over `layers` layers."""
    full = first_drop + 1
    return max(1, round((average * layers - full * visual) / (layers - full)))


def oracle_call(model, inputs, k: int):
    """The stock model on the prompt with its placeholder run cut to k and the first k image features: the LLM
    fed k visual tokens from its first layer, with no selection at all (the cut prompt is made before timing).
    Every row of a batch holds the same prompt."""
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.image_token_id).nonzero().squeeze(1)
    cut = torch.cat([ids[: placeholders[0] + k], ids[placeholders[-1] + 1 :]])[None]
    cut = cut.expand(inputs["input_ids"].shape[0], -1).contiguous()
    mask = torch.ones_like(cut)

    @torch.inference_mode()
    def run():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
        mm = {"image": hf.encoder_output([f[:k] for f in features])}
        model.generate(input_ids=cut, attention_mask=mask, **{hf.ENCODER_OUTPUTS: mm}, max_new_tokens=1,
                       do_sample=False)  # fmt: skip

    return run


def equal_average_table(model, inputs, device, repeats: int, clock) -> tuple[dict, list[str]]:
    """Each issue-26 method against FastV and the oracle at its own layer-averaged visual tokens."""
    layers = model.config.text_config.num_hidden_layers
    visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    runs, contexts, facts, selection = {}, {}, {}, {}

    def ttft():
        return model.generate(**inputs, max_new_tokens=1, do_sample=False)

    @contextmanager
    def patched(make, name):
        with vtoken.patched(model, make()) as handle:
            yield
            seconds = sum(r.seconds for r in handle.records if r.stage.startswith("prefill"))
            selection.setdefault(name, []).append(seconds)

    runs["unpatched"] = ttft
    for name, make in equal_average_methods(device.type == "cuda").items():
        with vtoken.patched(model, make()) as handle, torch.no_grad():
            model(**inputs)
            prefill = [r for r in handle.records if r.stage.startswith("prefill")]
        average = prefill[0].extra["layer_average"]
        first = int(prefill[0].stage.removeprefix("prefill.layer"))
        k = fastv_at_average(first, average, layers, visual)
        facts[name] = {"layer_average": average, "fastv": f"fastv layer {first} keep {k}", "oracle": round(average)}

        def make_fastv(first=first, k=k):
            return vtoken.FastV(layer=first, keep=k)

        runs[name], contexts[name] = ttft, functools.partial(patched, make, name)
        runs[f"{name}/fastv"], contexts[f"{name}/fastv"] = ttft, functools.partial(patched, make_fastv, "fastv")
        runs[f"{name}/oracle"] = oracle_call(model, inputs, round(average))
    timed = common.interleaved(runs, repeats, device, contexts=contexts, clock=clock)
    lines = [
        "",
        f"DART, PyramidDrop and SparseVLM against FastV (dropping after the method's first drop layer) and the oracle "
        f"(the LLM fed that many visual tokens from layer 0, no selection) at the same layer-averaged visual tokens; "
        f"TTFT of one token, {visual} visual tokens entering the LLM, {layers} LLM layers. Selection: the prefill "
        "records' seconds (wall clock: on a shared CPU an upper bound of its CPU time, so its share is one too).",
        "",
        "| config | layer-averaged | TTFT ms (median, min-max) | speedup | FastV at equal average | vs FastV | "
        "oracle (k) | vs oracle | selection ms | selection / TTFT |",
        "|---|---:|---:|---|---|---|---:|---|---:|---:|",
    ]
    results = {"unpatched": common.timing_row(timed["unpatched"], timed["unpatched"])}
    for name, fact in facts.items():
        row = common.timing_row(timed["unpatched"], timed[name], oracle=timed[f"{name}/oracle"])
        versus_fastv = common.speedup(timed[f"{name}/fastv"], timed[name])
        seconds = sorted(selection[name])[len(selection[name]) // 2]
        row.update(
            layer_average=fact["layer_average"],
            fastv=fact["fastv"],
            fastv_ttft_ms=timed[f"{name}/fastv"]["timing"].median * 1e3,
            vs_fastv=versus_fastv.value,
            vs_fastv_text=str(versus_fastv),
            oracle_tokens=fact["oracle"],
            oracle_ttft_ms=timed[f"{name}/oracle"]["timing"].median * 1e3,
            selection_ms=seconds * 1e3,
            selection_share=seconds / (row["ttft_ms"] / 1e3),
        )
        results[name] = row
        lines.append(
            f"| {name} | {fact['layer_average']:.1f} | {common.ttft_cell(row)} | {row['speedup_text']} | "
            f"{fact['fastv']} ({row['fastv_ttft_ms']:.1f} ms) | {versus_fastv} | {row['oracle_ttft_ms']:.1f} "
            f"({fact['oracle']}) | {row['vs_oracle_text']} | {row['selection_ms']:.1f} | {row['selection_share']:.1%} |"
        )
    return results, lines


def batch_methods(cuda: bool) -> dict:
    """Every LLM-stage method at the setting issue 31 states its targets for (drop layers halved on the CPU)."""

    def layers(*official: int) -> tuple[int, ...]:
        return official if cuda else tuple(k // 2 for k in official)

    return {
        "fastv L2 25%": lambda: vtoken.FastV(layer=2, keep=0.25),
        "dart 128": lambda: vtoken.DART(layer=2, keep=0.222),
        "pyramiddrop": lambda: vtoken.PyramidDrop(layers=layers(8, 16, 24)),
        "sparsevlm 192": lambda: vtoken.SparseVLM(budget=192, layers=layers(2, 6, 15)),
        "mustdrop (0.011, 0.01)": lambda: vtoken.MustDrop(global_thr=0.011, individual_thr=0.01),
    }


def batch_table(model, processor, device, dtype, repeats: int, clock, batches: list[int]) -> tuple[dict, list[str]]:
    """Every LLM-stage method against the unpatched model and the oracle at its layer-averaged visual tokens, at
    each batch size (the same image and prompt in every row): TTFT of one token and the targets' two ratios."""
    prompt = build_prompt(processor, QUESTION)
    layers = model.config.text_config.num_hidden_layers
    results, lines = (
        {},
        [
            "",
            f"Every LLM-stage method by batch size (the same image and prompt in every row; {layers} LLM layers): "
            "TTFT of one token against the unpatched model (target at batch 1: >= 0.97x) and against the oracle fed "
            "the method's layer-averaged visual tokens from layer 0 (target at batch 8 and 32: >= 0.9x).",
            "",
            "| batch | config | layer-averaged | TTFT ms (median, min-max) | vs unpatched | oracle (k) ms "
            "| vs oracle |",
            "|---:|---|---:|---:|---|---:|---|",
        ],
    )
    for batch in batches:
        inputs = processor(images=[example_image()] * batch, text=[prompt] * batch, return_tensors="pt").to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)

        def ttft(inputs=inputs):
            return model.generate(**inputs, max_new_tokens=1, do_sample=False)

        runs, contexts, averages = {"unpatched": ttft}, {}, {}
        for name, make in batch_methods(device.type == "cuda").items():
            with vtoken.patched(model, make()) as handle, torch.no_grad():
                model(**inputs)
                prefill = [r for r in handle.records if r.stage.startswith("prefill") and r.image == 0]
            averages[name] = prefill[0].extra["layer_average"]
            runs[name] = ttft
            contexts[name] = functools.partial(vtoken.patched, model, make())
            runs[f"{name}/oracle"] = oracle_call(model, inputs, round(averages[name]))
        timed = common.interleaved(runs, repeats, device, contexts=contexts, clock=clock)
        results[batch] = {"unpatched": common.timing_row(timed["unpatched"], timed["unpatched"])}
        for name, average in averages.items():
            row = common.timing_row(timed["unpatched"], timed[name], oracle=timed[f"{name}/oracle"])
            row.update(layer_average=average, oracle_tokens=round(average),
                       oracle_ttft_ms=timed[f"{name}/oracle"]["timing"].median * 1e3)  # fmt: skip
            results[batch][name] = row
            lines.append(
                f"| {batch} | {name} | {average:.1f} | {common.ttft_cell(row)} | {row['speedup_text']} | "
                f"{row['oracle_ttft_ms']:.1f} ({round(average)}) | {row['vs_oracle_text']} |"
            )
    return results, lines


def video_shapes(cuda: bool) -> dict:
    """LLaVA-OneVision-7B: SigLIP-so400m + Qwen2-7B; on a CPU the tower keeps 1 layer at 384 wide and the LLM 8
    layers at 512 wide (8 query, 4 key/value heads: Qwen2's GQA ratio halved)."""
    if cuda:
        vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16)
        return {"vision_config": vision, "text_config": qwen_7b_lm(None)}
    vision = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=6)
    text = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=152064)  # fmt: skip
    return {"vision_config": vision, "text_config": text}


def dycoke_table(device, dtype, repeats: int, clock, frames: int, steps: int) -> tuple[dict, list[str]]:
    """DyCoke (official settings; and p = 0) against VidCom2, FastVID, HoliTom and the oracle at its retention:
    TTFT, decode tok/s, selection time."""
    model, processor = _build(tiny_onevision, video_shapes(device.type == "cuda"), device, dtype)
    prompt = build_prompt(processor, "What happens in the video? Describe it step by step.", num_images=0, num_videos=1)
    inputs = processor(videos=[example_clip(frames, size=384)], text=[prompt], return_tensors="pt").to(device)
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(dtype)
    total = int((inputs["input_ids"] == model.config.video_token_id).sum()) - 1  # the newline is no frame's
    kept = sum(vtoken.DyCoke().frame_counts(frames, total // frames))
    retention = kept / total
    cut = min(10, model.config.text_config.num_hidden_layers - 2)  # PruneVid's official layer 10, on a cut LLM less
    configs = {
        "unpatched": None,
        "dycoke (k 0.7, layer 3, p 0.7)": lambda: vtoken.DyCoke(),
        "dycoke p 0 (decode stage: row only)": lambda: vtoken.DyCoke(p=0.0),
        f"vidcom2 {retention:.3f}": lambda: vtoken.VidCom2(budget=retention),
        f"fastvid {retention:.3f}": lambda: vtoken.FastVID(budget=retention),
        f"holitom {retention:.3f}": lambda: vtoken.HoliTom(budget=retention),
        "prunevid (encoder stage, official settings)": lambda: vtoken.PruneVid(layer=None),
        f"prunevid (official, cut after layer {cut})": lambda: vtoken.PruneVid(layer=cut),
        "framefusion (official: cost 0.3)": lambda: vtoken.FrameFusion(),
        "oracle (first tokens of each frame)": lambda: first_k(retention),
    }
    runs, contexts, selection, tokens, held = {}, {}, {}, {}, {}

    def generate(count: int):
        return lambda: model.generate(**inputs, max_new_tokens=count, min_new_tokens=count, do_sample=False)

    def context(make, name):
        @contextmanager
        def patched():
            with vtoken.patched(model, make()) as handle:
                yield
                selection.setdefault(name, []).append(sum(r.seconds for r in handle.records))
                records = list(handle.records)
                encoder = [r for r in records if r.stage == "encoder"]
                tokens[name] = sum(r.tokens_out for r in encoder) if encoder else total  # an LLM-stage method's: all
                inside = [r for r in records if r.stage.startswith("prefill")]  # in layer order: the last holds
                held[name] = inside[-1].tokens_out if inside else tokens[name]

        return patched if make else nullcontext

    for name, make in configs.items():
        runs[f"{name}/ttft"], runs[f"{name}/generate"] = generate(1), generate(1 + steps)
        contexts[f"{name}/ttft"] = context(make, f"{name}/ttft")
        contexts[f"{name}/generate"] = context(make, f"{name}/generate")
    with torch.no_grad():
        timed = common.interleaved(runs, repeats, device, contexts=contexts, clock=clock)
    layers = model.config.text_config.num_hidden_layers
    lines = [
        "",
        f"Video methods on a LLaVA-OneVision-7B shape: a {frames}-frame video, {total} frame tokens + 1 newline; tower "
        f"{model.config.vision_config.num_hidden_layers} layer(s) x {model.config.vision_config.hidden_size}, LLM "
        f"{layers} layers x {model.config.text_config.hidden_size}; {steps} decode tokens. Selection: the encoder "
        "and decode records' seconds of a generate (wall clock).",
        "",
        "| config | visual tokens entering the LLM | after the LLM's drops and merges | TTFT ms (median, min-max) | "
        "TTFT speedup | decode tok/s | decode speedup | selection ms (generate) | selection / generate |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]

    def decode_timing(name: str) -> Timing:
        pairs = zip(timed[f"{name}/generate"]["times_s"], timed[f"{name}/ttft"]["times_s"], strict=True)
        return Timing(tuple(max(g - t, 1e-9) for g, t in pairs))

    base_decode, results = decode_timing("unpatched"), {}
    for name in configs:
        decode = decode_timing(name)
        row = common.timing_row(timed["unpatched/ttft"], timed[f"{name}/ttft"])
        spent = sorted(selection.get(f"{name}/generate", [0.0]))
        seconds = spent[len(spent) // 2]
        generate_s = timed[f"{name}/generate"]["timing"].median
        row.update(visual_tokens=tokens.get(f"{name}/ttft", total), visual_tokens_held=held.get(f"{name}/ttft", total),
                   decode_tokens_per_s=steps / decode.median,
                   decode_speedup=compare(base_decode, decode).to_dict(), selection_ms=seconds * 1e3,
                   selection_share=seconds / generate_s)  # fmt: skip
        results[name] = row
        first = name == "unpatched"
        lines.append(
            f"| {name} | {row['visual_tokens']} | {row['visual_tokens_held']} | {common.ttft_cell(row)} | "
            f"{'(baseline)' if first else row['speedup_text']} | {row['decode_tokens_per_s']:.1f} | "
            f"{'(baseline)' if first else compare(base_decode, decode)} | "
            + ("| |" if first else f"{row['selection_ms']:.1f} | {row['selection_share']:.1%} |")
        )
    return results, lines


def gpu_models() -> dict:
    """What `--device cuda` builds (see bench_families.gpu_models)."""
    return {
        "llava-1.5-7b": lambda device, dtype: _build(tiny_llava, shapes(True), device, dtype),
        "llava-onevision-7b": lambda device, dtype: _build(tiny_onevision, video_shapes(True), device, dtype),
    }


def cache_bytes(model, inputs) -> int:
    """Bytes of the KV cache after a prefill of `inputs`."""
    with torch.no_grad():
        cache = hf.cache_out(model(**inputs, use_cache=True))
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    parser = common.ttft_parser(__doc__, "unused: the CPU shapes are fixed (see the docstring)")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--skip-equal-average", action="store_true", help="only the MustDrop/FastV table")
    parser.add_argument("--video-only", action="store_true", help="only the video methods table")
    parser.add_argument("--skip-video", action="store_true", help="no video methods table")
    parser.add_argument("--batches", default=None, help="batch sizes of the batch table (default: 1,8,32 on a GPU, "
                        "1,2 on a CPU); 'none' skips it")  # fmt: skip
    parser.add_argument("--frames", type=int, default=None, help="video frames (default: 32 on a GPU, 8 on a CPU)")
    args = parser.parse_args()
    device, dtype, _, repeats = common.run_settings(args)
    clock = time.perf_counter
    if device.type == "cpu":  # a shared CPU: the work done (one thread's CPU time), not the wait for a core
        torch.set_num_threads(1)
        clock = time.thread_time
    steps = args.decode_tokens
    if not args.skip_video:
        frames = args.frames or (32 if device.type == "cuda" else 8)
        video, video_lines = dycoke_table(device, dtype, repeats, clock, frames, steps)
        if device.type == "cpu":
            video_lines += [
                "",
                "CPU times (one torch thread) on a shared, busy machine: compare ratios within one run.",
            ]
        common.report("llm_stages_video", device, dtype, repeats, {"dycoke": video}, video_lines, args.out)
    if args.video_only:
        return
    model, processor = _build(tiny_llava, shapes(device.type == "cuda"), device, dtype)
    inputs = processor(images=[example_image()], text=[build_prompt(processor, QUESTION)], return_tensors="pt")
    inputs = inputs.to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    steps = args.decode_tokens

    def generate(tokens: int):
        return lambda: model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    def context(make):
        return (lambda: vtoken.patched(model, make())) if make else nullcontext

    runs, contexts, facts = {}, {}, {}
    for name, make in CONFIGS.items():
        runs[f"{name}/ttft"], runs[f"{name}/generate"] = generate(1), generate(1 + steps)
        contexts[f"{name}/ttft"] = contexts[f"{name}/generate"] = context(make)
        with context(make)() as handle, torch.no_grad():
            kv = cache_bytes(model, inputs)
            records = handle.records if handle is not None else []
        entering = sum(r.tokens_out for r in records if r.stage == "encoder.merge") or 576
        averages = [r.extra["layer_average"] for r in records if "layer_average" in r.extra]
        facts[name] = {"entering": entering, "layer_average": averages[-1] if averages else entering, "kv": kv}
    start = time.perf_counter()
    timed = common.interleaved(runs, repeats, device, contexts=contexts, clock=clock)
    print(f"measured in {time.perf_counter() - start:.0f} s")

    def decode_timing(name: str) -> Timing:
        """Seconds of the `steps` decode steps, per repetition: a generate minus the TTFT run of the same
        repetition (interleaved, so the two saw the same machine state)."""
        pairs = zip(timed[f"{name}/generate"]["times_s"], timed[f"{name}/ttft"]["times_s"], strict=True)
        return Timing(tuple(max(g - t, 1e-9) for g, t in pairs))

    base_decode = decode_timing("unpatched")
    results, lines = {}, []
    layers = model.config.text_config.num_hidden_layers
    width = model.config.text_config.hidden_size
    lines += [
        "",
        f"LLaVA-1.5 shape: CLIP-L tower ({model.config.vision_config.num_hidden_layers} layers), LLM {layers} layers "
        f"x {width} wide; {steps} decode tokens"
        + ("." if device.type == "cuda" else "; times are the process's CPU time (one torch thread)."),
        "",
        "| config | visual tokens entering the LLM | layer-averaged | TTFT ms (median, min-max) | TTFT speedup "
        "| decode tok/s | decode speedup | KV cache MB | KV vs unpatched | peak MB |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for name in CONFIGS:
        decode = decode_timing(name)
        decode_ratio = compare(base_decode, decode)
        row = {
            **facts[name],
            **common.timing_row(timed["unpatched/ttft"], timed[f"{name}/ttft"]),
            "decode_tokens_per_s": steps / decode.median,
            "decode_speedup": decode_ratio.to_dict(),
            "kv_ratio": facts[name]["kv"] / facts["unpatched"]["kv"],
            "peak_mb": timed[f"{name}/generate"]["peak_bytes"] / 2**20,
        }
        results[name] = row
        first = name == "unpatched"
        lines.append(
            f"| {name} | {row['entering']} | {row['layer_average']:.1f} | {common.ttft_cell(row)} | "
            f"{'(baseline)' if first else row['speedup_text']} | {row['decode_tokens_per_s']:.1f} | "
            f"{'(baseline)' if first else decode_ratio} | {row['kv'] / 2**20:.1f} | {row['kv_ratio']:.2f} | "
            f"{row['peak_mb']:.0f} |"
        )
    if not args.skip_equal_average:
        equal, equal_lines = equal_average_table(model, inputs, device, repeats, clock)
        results["equal_average"] = equal
        lines += equal_lines
    batches = args.batches or ("1,8,32" if device.type == "cuda" else "1,2")
    if batches != "none":
        by_batch, batch_lines = batch_table(model, processor, device, dtype, repeats, clock,
                                            [int(b) for b in batches.split(",")])  # fmt: skip
        results["by_batch"] = by_batch
        lines += batch_lines
    lines += ["", "CPU runs share a busy machine (2 cores, many processes): the tables give CPU time, not wall time; "
              "still noisy, compare ratios within one run."] * (device.type == "cpu")  # fmt: skip
    common.report("llm_stages", device, dtype, repeats, results, lines, args.out)


if __name__ == "__main__":
    main()
