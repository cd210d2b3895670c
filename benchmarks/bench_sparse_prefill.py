"""Sparse prefill: the block-sparse attention kernel against SDPA, and time to first token on a long video.

1. Kernel level: B=1, 28 query / 4 KV heads, head dim 128 (Qwen2.5-VL-7B's LLM), block 64: SDPA causal (flash on
   a GPU) against vtoken's block-sparse kernel (Triton on a GPU, the PyTorch reference on a CPU) and FlexAttention
   at densities 1.0 ... 0.05 (plans from `density_plan`: sink and diagonal blocks plus the top-ranked others), and
   the cost of the vertical-slash estimate (64 rows + plan). From these it fits the break-even model
   (`vtoken.kernels.sparse_speed.BreakEven`: time over SDPA = fixed + per_density * rho, plus the estimate) of the
   faster backend per density and prints it, with the density up to which sparse attention gains at each length:
   a GPU run's printout replaces `RECORDED` there.
2. End to end: a Qwen2.5-VL-7B-shaped model (random weights) on one long video: TTFT of the stock model, sparse
   prefill (vertical_slash, density 0.1) with its defaults (the break-even model decides per length) and forced
   (break_even=False), pruning (pool, 25 % of every frame) and pruning + sparse, each beside the whole-prefill
   bound 1 / (1 - a + a * rho), with `a` the share of the dense prefill spent in attention (SDPA timed alone at the
   same shape, times the layers, over the dense TTFT) and rho the achieved density; pruning + sparse is compared
   with pruning alone too. The records say which attention ran in each config. Plus the attention mass the plans
   recall per head (probabilities of 128 query rows of a middle layer inside the planned blocks): with random
   weights attention is diffuse, so recall here is a floor, not a quality claim.

On a GPU: bf16, 8k-128k tokens at kernel level, 8k/32k/64k end to end with the LLM at full depth (28 layers) and
the vision tower cut to 4 layers (it is not what sparse prefill speeds up). On a CPU a cut version runs: fp32, the
PyTorch reference backend (dense underneath: CPU times show overhead, not savings) and FlexAttention compiled by
inductor's CPU backend, short prompts, the LLM cut in width and depth (the table says how).

    python benchmarks/bench_sparse_prefill.py                 # CPU, cut
    python benchmarks/bench_sparse_prefill.py --device cuda   # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from bench_families import _build  # noqa: E402

import vtoken  # noqa: E402
from vtoken.kernels import block_mask_from_plan, block_sparse_attention, causal_rows_probs  # noqa: E402
from vtoken.kernels.block_sparse_flex import block_sparse_attention_flex, flex_unavailable  # noqa: E402
from vtoken.kernels.sparse_speed import BreakEven, fit_kernel  # noqa: E402
from vtoken.methods.sparse_prefill import (  # noqa: E402
    a_shape_blocks,
    density_plan,
    estimate_rows,
    prefill_bound,
    vertical_slash_scores,
)
from vtoken.zoo import build_prompt, tiny_qwen2_5_vl  # noqa: E402

DENSITIES = [1.0, 0.5, 0.2, 0.1, 0.05]
BLOCK = 64


def settings(cuda: bool, tiny: bool = False) -> dict:
    if tiny:  # the smoke run (`--tiny`): every path at a few blocks, tiny widths
        return dict(
            kernel_lengths=[192],
            video_tokens=[128],
            min_length=64,
            heads=(4, 2, 16),
            text=dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=152064,
            ),  # fmt: skip
            vision_depth=1,
            frame_side=224,
        )
    if cuda:
        return dict(
            kernel_lengths=[8192, 16384, 32768, 65536, 131072],
            video_tokens=[8192, 32768, 65536],
            min_length=4096,  # below the default: the break-even decides (and 'sparse (forced)' shows why)
            heads=(28, 4, 128),
            text=dict(
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                vocab_size=152064,
            ),  # fmt: skip
            vision_depth=4,
            frame_side=448,  # 16 x 16 merged tokens per temporal group
        )
    return dict(
        kernel_lengths=[512, 1024],
        video_tokens=[512, 1024],
        min_length=256,
        heads=(28, 4, 128),
        text=dict(
            hidden_size=448,
            intermediate_size=2368,
            num_hidden_layers=2,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),  # fmt: skip
        vision_depth=1,
        frame_side=224,  # 8 x 8 merged tokens per temporal group
    )


# --------------------------------------------------------------------- 1. kernel level
def kernel_level(device, dtype, lengths, heads, repeats, flex: bool = True) -> tuple[dict, list[str]]:
    """`flex`: time FlexAttention too where it runs (the smoke run leaves out its CPU compilation)."""
    hq, hkv, dim = heads
    scale = dim**-0.5
    flex = flex and flex_unavailable(device.type) is None
    own = "Triton kernel" if device.type == "cuda" else "reference"
    results, lines = {}, []
    lines += [
        "",
        f"Kernel level: B=1, {hq}/{hkv} heads, head dim {dim}, block {BLOCK}, {dtype}; ms per layer call; vtoken's "
        f"{own} and FlexAttention (compiled) per density; target on a GPU: within 1.2x of SDPA at density 1.0, "
        "speedup >= 0.7/density from 32k tokens.",
        "",
        "Times are medians of interleaved runs after a warm-up; a speedup whose min-max spread contains 1.0 reads "
        "'within noise'. rho' = the density the plan achieves (sink and diagonal blocks included).",
        "",
        "| tokens | SDPA ms | estimate ms | "
        + " | ".join(f"rho={r:g}: {own} ms (speedup) / flex ms (speedup)" for r in DENSITIES)
        + " |",
        "|---:|---:|---:|" + "---:|" * len(DENSITIES),
    ]
    for seq in lengths:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(1, hq, seq, dim, generator=g).to(device, dtype)
        k, v = (torch.randn(1, hkv, seq, dim, generator=g).to(device, dtype) for _ in range(2))
        mandatory = a_shape_blocks(seq, BLOCK, 64, 64, device)
        rows = estimate_rows(None, 1, seq, device)
        vertical, slash = vertical_slash_scores(q, k, rows, None, scale)
        plans = {rho: density_plan(vertical, slash, BLOCK, rho, mandatory) for rho in DENSITIES}
        qkv = (q, k, v)
        runs = {"sdpa": lambda t=qkv: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)}
        for rho, (counts, index) in plans.items():
            runs[f"own@{rho:g}"] = lambda c=counts, i=index, t=qkv: block_sparse_attention(*t, c, i, BLOCK, scale)
            if flex:
                runs[f"flex@{rho:g}"] = lambda c=counts, i=index, t=qkv: block_sparse_attention_flex(
                    *t, c, i, BLOCK, scale
                )

        def estimate(t=qkv, rows=rows, mandatory=mandatory):
            vs = vertical_slash_scores(t[0], t[1], rows, None, scale)
            density_plan(*vs, BLOCK, 0.1, mandatory)

        runs["estimate"] = estimate
        with torch.inference_mode():
            timed = common.interleaved(runs, repeats, device)
        sdpa = timed["sdpa"]["median_s"]
        n = mandatory.shape[0]
        row = {"sdpa_ms": sdpa * 1e3, "estimate_ms": timed["estimate"]["median_s"] * 1e3, "densities": {},
               "sdpa": timed["sdpa"]["timing"].to_dict()}  # fmt: skip
        cells = []
        for rho, (counts, _) in plans.items():
            achieved = float(counts.double().sum() / (hq * n * (n + 1) / 2))
            entry = {"achieved_density": achieved}
            cell = []
            for backend in ("own", "flex") if flex else ("own",):
                result = timed[f"{backend}@{rho:g}"]
                ratio = common.speedup(timed["sdpa"], result)
                entry[backend] = {"ms": result["median_s"] * 1e3, "speedup": ratio.value,
                                  "speedup_spread": ratio.to_dict()}  # fmt: skip
                cell.append(f"{result['median_s'] * 1e3:.2f} ({ratio})")
            row["densities"][f"{rho:g}"] = entry
            cells.append(" / ".join(cell) + f", rho'={achieved:.2f}")
        results[seq] = row
        lines.append(f"| {seq} | {row['sdpa_ms']:.2f} | {row['estimate_ms']:.2f} | " + " | ".join(cells) + " |")
        del q, k, v, qkv, runs, plans, vertical, slash
    model, fitted = break_even_from(results, device)
    lines += ["", *fitted]
    return {"lengths": results, "break_even": model}, lines


def break_even_from(results: dict, device) -> tuple[dict, list[str]]:
    """The break-even model of these measurements (`BreakEven`): per length, time over SDPA of the faster backend
    at each achieved density fitted as fixed + per_density * rho, and the estimate's time over SDPA; printed ready
    to paste into `vtoken.kernels.sparse_speed` after a GPU run."""
    lengths, fixed, per_density, estimate = [], [], [], []
    for seq, row in sorted(results.items()):
        densities = [entry["achieved_density"] for entry in row["densities"].values()]
        speedups = [max(v["speedup"] for k, v in entry.items() if k in ("own", "flex"))
                    for entry in row["densities"].values()]  # fmt: skip
        f, p = fit_kernel(densities, speedups)
        lengths.append(seq), fixed.append(round(f, 4)), per_density.append(round(p, 4))
        estimate.append(round(row["estimate_ms"] / row["sdpa_ms"], 4))
    source = f"bench_sparse_prefill --device {device.type}: {common.environment(device).get('gpu', 'CPU')}"
    model = BreakEven(tuple(lengths), tuple(fixed), tuple(per_density), tuple(estimate), source=source)
    lines = [
        "Break-even measured here (the faster backend per density; time over SDPA = fixed + per_density * rho, "
        "plus the estimate for vertical_slash; sparse runs where the prediction is below the margin):",
        "",
        "| tokens | fixed | per density | estimate | gains below density (vertical_slash) | (a_shape, grid) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for seq, f, p, e in zip(lengths, fixed, per_density, estimate, strict=True):
        with_estimate, without = model.density_limit(seq, True), model.density_limit(seq, False)
        lines.append(f"| {seq} | {f:.3f} | {p:.3f} | {e:.3f} | {with_estimate:.2f} | {without:.2f} |")
    lines += ["", "```text", repr(model), "```"]
    return {"lengths": lengths, "fixed": fixed, "per_density": per_density, "estimate": estimate,
            "margin": model.margin, "source": source}, lines  # fmt: skip


# --------------------------------------------------------------------- 2. end to end
def video(frames: int, side: int) -> list[Image.Image]:
    rng = np.random.default_rng(frames)
    base = rng.integers(0, 256, (side, side * 2, 3), dtype=np.uint8)
    return [Image.fromarray(base[:, i % side : i % side + side]) for i in range(frames)]


def build_model(cfg: dict, device, dtype):
    text = dict(cfg["text"], rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]  # the tiny config's list is 2 long
    if text["hidden_size"] // text["num_attention_heads"] != 128:
        half = text["hidden_size"] // text["num_attention_heads"] // 2
        text["rope_parameters"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    depth = cfg["vision_depth"]
    vision = dict(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                  out_hidden_size=text["hidden_size"], fullatt_block_indexes=[depth - 1])  # fmt: skip
    return _build(tiny_qwen2_5_vl, {"text_config": text, "vision_config": vision}, device, dtype)


def gpu_models() -> dict:
    """What `--device cuda` builds (see bench_families.gpu_models)."""
    return {"qwen2.5-vl-7b": lambda device, dtype: build_model(settings(True), device, dtype)}


def video_inputs(processor, tokens: int, side: int):
    per_group = (side // 28) ** 2
    frames = 2 * max(tokens // per_group, 1)  # two frames per temporal patch
    processor.video_processor.max_pixels = side * side
    processor.video_processor.min_pixels = side * side
    prompt = build_prompt(processor, "What happens in the video?", num_images=0, num_videos=1)
    return processor(videos=[video(frames, side)], text=[prompt], return_tensors="pt")


def recall_per_head(q, k, counts, index, scale, samples=128) -> list[float]:
    """Attention mass of `samples` query rows (evenly spread over the second half) inside the planned blocks."""
    seq = q.shape[2]
    rows = torch.linspace(seq // 2, seq - 1, samples, device=q.device).long()[None]
    probs = causal_rows_probs(q.gather(2, rows[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])), k, rows,
                              torch.ones(1, seq, dtype=torch.bool, device=q.device), scale)  # fmt: skip
    n = -(-seq // BLOCK)
    blocks = block_mask_from_plan(counts, index, n)[:, :, rows[0] // BLOCK]  # [1, H, R, Kb]
    inside = blocks.repeat_interleave(BLOCK, -1)[..., :seq]
    return (probs * inside).sum(-1).mean(-1)[0].tolist()


def end_to_end(cfg, device, dtype, repeats) -> tuple[dict, list[str]]:
    model, processor = build_model(cfg, device, dtype)
    text = model.config.text_config
    layers, hq, hkv = text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads
    dim = text.hidden_size // hq
    sparse = dict(pattern="vertical_slash", density=0.1, min_length=cfg["min_length"], block_size=BLOCK)
    configs = {
        "dense": [],
        "sparse": [vtoken.SparsePrefill(**sparse)],
        "sparse (forced)": [vtoken.SparsePrefill(**sparse, break_even=False)],
        "pruning": [vtoken.Pool(budget=0.25)],
        "pruning + sparse": [vtoken.Pool(budget=0.25), vtoken.SparsePrefill(**sparse)],
    }
    results, lines = {}, []
    depth = f"LLM {layers} layers x {text.hidden_size} wide ({hq}/{hkv} heads)"
    lines += [
        "",
        f"End to end: Qwen2.5-VL-7B shape, {depth}, vision tower cut to {cfg['vision_depth']} layer(s), one video, "
        "random weights; TTFT = generate(max_new_tokens=1). 'sparse' runs the defaults' break-even (the model "
        "decides per length), 'sparse (forced)' break_even=False. bound = 1 / (1 - a + a*rho) with a measured (SDPA "
        "alone x layers / dense TTFT, or / pruning's TTFT for pruning + sparse) at the sequence each config's LLM "
        "sees; 'of bound' = speedup over dense (pruning + sparse: over pruning alone) / bound (target on a GPU: "
        f">= 0.9). Recall: attention mass of 128 query rows of layer {layers // 2} inside the plan, per head "
        "(min / median).",
        "",
        "| tokens | config | LLM tokens | TTFT ms (median, min-max) | vs dense (spread) | vs pruning alone | "
        "attention ran | density | a | bound | of bound | recall min / median |",
        "|---:|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for tokens in cfg["video_tokens"]:
        inputs = video_inputs(processor, tokens, cfg["frame_side"]).to(device)
        for key, value in inputs.items():
            if value.is_floating_point():
                inputs[key] = value.to(dtype)

        @torch.inference_mode()
        def ttft(inputs=inputs):
            model.generate(**inputs, max_new_tokens=1, do_sample=False)

        facts, contexts = {}, {}
        for name, methods in configs.items():
            contexts[name] = (lambda m=methods: vtoken.patched(model, m)) if methods else None
            facts[name] = llm_facts(model, inputs, methods, layers // 2)
        if device.type == "cuda":  # what a deployment does first: this GPU's break-even (if none is recorded) and
            # the sparse kernels' compilation and tuning at these lengths, before any timed request
            with vtoken.patched(model, configs["sparse"]):
                lengths = sorted({facts[name]["llm_tokens"] for name in ("sparse", "pruning + sparse")})
                report = vtoken.warmup(model, lengths=lengths)
            warmed = {gpu: repr(fitted) for gpu, fitted in report.measured.items()}
            lines_warm = [f"warm-up measured the break-even on {gpu}: {fitted}" for gpu, fitted in warmed.items()]
            print("\n".join(lines_warm) or "warm-up: break-even recorded for this GPU", flush=True)
            results.setdefault("warmup", {}).update(measured=warmed, prepared=report.prepared)
        runs = dict.fromkeys(configs, ttft)
        timed = common.interleaved(runs, repeats, device, contexts={k: v for k, v in contexts.items() if v})
        base = timed["dense"]["median_s"]
        share = {}
        for name in configs:
            seq = facts[name]["llm_tokens"]
            if seq not in share:
                share[seq] = attention_seconds(seq, hq, hkv, dim, device, dtype, repeats) * layers
        results.setdefault(tokens, {})
        for name in configs:
            fact = facts[name]
            t = timed[name]["median_s"]
            after_pruning = name == "pruning + sparse"
            reference = timed["pruning"] if after_pruning else timed["dense"]
            a = min(share[fact["llm_tokens"]] / reference["median_s"], 1.0)
            rho = fact["density"]
            bound = prefill_bound(a, rho) if rho is not None else None
            speedup = reference["median_s"] / t  # pruning + sparse: against pruning alone, the prefill it sparsifies
            versus_pruning = common.speedup(timed["pruning"], timed[name]) if after_pruning else None
            row = {"llm_tokens": fact["llm_tokens"], **common.timing_row(timed["dense"], timed[name]),
                   "speedup_vs_dense": base / t, "speedup_vs_reference": speedup, "density": rho,
                   "attention_share": a, "bound": bound, "recall": fact["recall"], "attention_ran": fact["ran"],
                   "vs_pruning_alone": versus_pruning.to_dict() if versus_pruning else None}  # fmt: skip
            results[tokens][name] = row
            recall = fact["recall"]
            lines.append(
                f"| {tokens} | {name} | {fact['llm_tokens']} | {common.ttft_cell(row)} | "
                f"{'(baseline)' if name == 'dense' else row['speedup_text']} | "
                f"{versus_pruning if versus_pruning else ''} | {fact['ran']} | "
                + (f"{rho:.3f}" if rho is not None else "1")
                + f" | {a:.2f} | "
                + (f"{bound:.2f}x | {speedup / bound:.2f} |" if bound else " | |")
                + (f" {min(recall):.2f} / {statistics.median(recall):.2f} |" if recall else " |")
            )
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, lines


def llm_facts(model, inputs, methods, probe_layer) -> dict:
    """The LLM's sequence length, the achieved density, which attention ran (from the records) and per-head recall
    at `probe_layer`, from one forward."""
    seen = {}

    def grab(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        seen["llm_tokens"] = int(embeds.shape[1])

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            if not any(isinstance(m, vtoken.SparsePrefill) for m in methods):
                if methods:
                    with vtoken.patched(model, methods):
                        model(**inputs, logits_to_keep=1)  # not 64k x 152k logits
                else:
                    model(**inputs, logits_to_keep=1)  # not 64k x 152k logits
                return {"llm_tokens": seen["llm_tokens"], "density": None, "recall": None, "ran": "model's own"}
            with vtoken.patched(model, methods) as handle:
                stage = handle.adapter.sparse
                stock = stage._sparse

                def capture(index, scale, q, k, v, rows, call, verdict):
                    if index == probe_layer:
                        seen["qk"] = (q, k, scale)
                    return stock(index, scale, q, k, v, rows, call, verdict)

                stage._sparse = capture  # benchmark-only instance override, gone with the patch
                model(**inputs, logits_to_keep=1)  # not 64k x 152k logits
                records = [r for r in handle.records if "density" in r.extra]
                notes = [r.extra["dense"] for r in handle.records if "dense" in r.extra]
                method = next(m for m in methods if isinstance(m, vtoken.SparsePrefill))
                recall = None
                if "qk" in seen:  # not when the layer ran dense (short prompt, break-even)
                    q, k, scale = seen.pop("qk")
                    counts, index, _ = method.plan(q, k, None, scale)
                    recall = recall_per_head(q, k, counts, index, scale)
    finally:
        hook.remove()
    density = statistics.mean(r.extra["density"] for r in records) if records else None
    backends = sorted({r.extra["attention"] for r in records})
    sparse_layers = len({r.stage for r in records})
    ran = f"{'/'.join(backends)} x{sparse_layers} layers" if records else "model's own"
    if notes:
        ran += f" ({notes[0].removeprefix('dense: ')})" if not records else f"; dense: {len(notes)} note(s)"
    return {"llm_tokens": seen["llm_tokens"], "density": density, "recall": recall, "ran": ran.replace("|", "/")}


def attention_seconds(seq, hq, hkv, dim, device, dtype, repeats) -> float:
    """Median time of one causal SDPA call at the LLM's attention shape."""
    q = torch.randn(1, hq, seq, dim, device=device, dtype=dtype)
    k = torch.randn(1, hkv, seq, dim, device=device, dtype=dtype)
    with torch.inference_mode():
        timed = common.interleaved(
            {"sdpa": lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)},
            repeats,
            device,
        )
    return timed["sdpa"]["median_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--repeats",
        "--runs",
        type=int,
        default=None,
        help="timed runs per config, interleaved after a warm-up (default: 5 on cuda, 2 on cpu)",
    )
    parser.add_argument("--only", choices=["kernel", "e2e"], default=None)
    common.add_tiny(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = args.repeats or (5 if cuda else 2)
    cfg = settings(cuda, tiny=args.tiny)
    results, lines = {}, []
    start = time.perf_counter()
    if args.only in (None, "kernel"):
        results["kernel"], part = kernel_level(device, dtype, cfg["kernel_lengths"], cfg["heads"], repeats,
                                               flex=not args.tiny)  # fmt: skip
        lines += part
    if args.only in (None, "e2e"):
        results["end_to_end"], part = end_to_end(cfg, device, dtype, repeats)
        lines += part
    if not cuda:
        note = ("CPU: 'torch' is the dense reference (it costs more than SDPA here, not less) and auto switches to "
                "FlexAttention compiled for the CPU from 2^24 dense scores; no speed model is recorded for CPU, so "
                "min_length alone decides and 'sparse' runs what 'sparse (forced)' runs. On a shared CPU the spreads "
                "are wide: this cut shows that the pipeline runs. The GPU numbers (`--device cuda`) are pending: no "
                "GPU was lent for issue 32.")  # fmt: skip
        lines += ["", note]
    print(f"measured in {time.perf_counter() - start:.0f} s")
    env = common.environment(device)
    header = (f"Sparse prefill, {device.type} ({env.get('gpu', 'CPU')}), {dtype}, batch 1, median and min-max of "
              f"{repeats} interleaved runs after a warm-up.")  # fmt: skip
    table = "\n".join([header, *lines])
    payload = {"environment": env, "repeats": repeats, "results": results}
    json_path, md_path = common.write_results(f"sparse_prefill_{device.type}", payload, table, args.out)
    print(table)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
