"""LLaVA-1.5-7B-shaped benchmark: time to first token and peak memory, FasterVLM (or `--methods`) vs unpatched vs
oracle.

Shapes are the real ones (CLIP ViT-L/14-336 tower: 24 layers, width 1024, 577 tokens; Llama-7B widths: 4096 wide,
11008 MLP, 32 heads, 32064 vocab) with random weights. On a GPU the LLM has its real 32 layers; on a CPU the LLM
depth is cut (default 2 layers) to fit a small machine, which makes the vision tower a larger share of time to
first token than in the real model: the table says which depth it ran.

Configurations, interleaved repetition by repetition in one process:
- unpatched: the stock model, all 576 visual tokens;
- fastervlm@b: `vtoken.patch(model, "fastervlm", budget=b)` (and every other method `--methods` names, e.g. all
  of LLaVA-1.5's encoder methods at batch 8 and 32, as `make bench-gpu` runs them);
- oracle@b: stock transformers only, the LLM fed k visual tokens with zero selection cost (the stock vision
  encoder, the first k features, a prompt with k placeholders made before timing): the best any k-token method
  can do.
Also: the cost of the [CLS] scores the official way (the vision tower in eager attention with
`output_attentions=True`) versus ours (SDPA tower, [CLS] row recomputed from hooked q/k).

    python benchmarks/bench_llava.py                 # CPU, LLM cut to 2 layers
    python benchmarks/bench_llava.py --device cuda   # GPU, full 32 layers, bf16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import vtoken  # noqa: E402
from vtoken.adapters import hf  # noqa: E402
from vtoken.adapters.probes import ClsAttentionProbe  # noqa: E402
from vtoken.budget import tokens_to_keep  # noqa: E402
from vtoken.images import example_image  # noqa: E402
from vtoken.zoo import build_prompt, llava_config, llava_processor, tiny_tokenizer  # noqa: E402

N = 576


def build_model(llm_layers: int, device: torch.device, dtype: torch.dtype):
    from transformers import LlavaForConditionalGeneration

    tokenizer = tiny_tokenizer()
    processor = llava_processor(tokenizer)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  projection_dim=768, hidden_act="quick_gelu")  # fmt: skip
    text = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=llm_layers, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32064)  # fmt: skip
    if common.TINY:  # the smoke run: tiny LLaVA's widths, these depths
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, projection_dim=32
        )
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=llm_layers, num_attention_heads=4,
                    num_key_value_heads=2)  # fmt: skip
    config = llava_config(tokenizer, vision=vision, text=text)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlavaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    vtoken.remember_tokenizer(model, processor)  # for methods that read the prompt's question (MMTok)
    return model, processor


def gpu_models() -> dict:
    """What `--device cuda` builds (see bench_families.gpu_models)."""
    return {"llava-1.5-7b": lambda device, dtype: build_model(32, device, dtype)}


def oracle_prompt(model, inputs, k: int) -> dict:
    """input_ids / attention_mask with each image's placeholder run cut to k (made before timing)."""
    ids = inputs["input_ids"][0]
    ph = (ids == model.config.image_token_id).nonzero().squeeze(1)
    cut = torch.cat([ids[: ph[0] + k], ids[ph[-1] + 1 :]])[None].expand(inputs["input_ids"].shape[0], -1)
    return {"input_ids": cut, "attention_mask": torch.ones_like(cut)}


ENCODER_METHODS = ("fastervlm", "hired", "mmtok", "fourier", "visionzip", "vispruner", "divprune", "random", "pool")


def measure_ttft(
    model, processor, batch: int, budgets, repeats: int, device, dtype, methods=("fastervlm",)
) -> tuple[dict, dict]:
    """TTFT and peak memory of unpatched / method@b / oracle@b for one batch size; returns (rows, inputs)."""
    prompt = build_prompt(processor, "What is in the image? Describe every object, its colour and its position.")
    inputs = processor(images=[example_image()] * batch, text=[prompt] * batch, return_tensors="pt").to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    generate = dict(max_new_tokens=1, do_sample=False)

    configs, contexts, ks = {}, {}, {}
    selection_seconds: dict[str, list[float]] = {}

    @torch.inference_mode()
    def stock_generate():
        model.generate(**inputs, **generate)

    configs["unpatched"], ks["unpatched"] = stock_generate, N
    for budget in budgets:
        k = tokens_to_keep(budget, N)
        for method in methods:
            name = f"{method}@{budget:g}"

            @contextmanager
            def patched(budget=budget, name=name, method=method):
                with vtoken.patched(model, vtoken.make_method(method, budget=budget)) as handle:
                    yield
                    selection_seconds.setdefault(name, []).append(sum(r.seconds for r in handle.records))

            configs[name], contexts[name], ks[name] = stock_generate, patched, k
        cut = {key: v.to(device) for key, v in oracle_prompt(model, inputs, k).items()}

        @torch.inference_mode()
        def oracle(cut=cut, k=k):
            feats = model.model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
            mm = {"image": hf.encoder_output([f[:k] for f in feats])}
            model.generate(**cut, **{hf.ENCODER_OUTPUTS: mm}, **generate)

        configs[f"oracle@{budget:g}"], ks[f"oracle@{budget:g}"] = oracle, k

    timed = common.interleaved(configs, repeats, device, warmup=1, contexts=contexts)
    rows = {}
    for name, result in timed.items():
        oracle = timed["oracle@" + name.split("@")[1]] if name in contexts else None
        rows[name] = {
            "visual_tokens": ks[name],
            **common.timing_row(timed["unpatched"], result, oracle),
            "ttft_runs_ms": [t * 1e3 for t in result["times_s"]],
            "peak_mb": result["peak_bytes"] / 2**20,
        }
        if name in selection_seconds:
            rows[name]["selection_ms"] = statistics.median(selection_seconds[name][1:]) * 1e3

    return rows, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--llm-layers", type=int, default=None, help="default: 32 on cuda, 2 on cpu")
    parser.add_argument(
        "--repeats",
        "--runs",
        type=int,
        default=None,
        help="timed runs per config, interleaved after a warm-up (default: 20 on cuda, 3 on cpu)",
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1, 0.05])
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default: 1 8 32 on cuda, 1)")
    parser.add_argument("--name", default=None, help="results file stem (default llava15_<device>)")
    parser.add_argument("--methods", nargs="+", default=["fastervlm"], choices=[*ENCODER_METHODS, "all"],
                        help="encoder methods to time (all: every one LLaVA-1.5 takes)")  # fmt: skip
    common.add_tiny(parser)
    args = parser.parse_args()
    common.set_tiny(args)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    llm_layers = args.llm_layers or (32 if cuda else 2)
    repeats = args.repeats or (20 if cuda else 3)
    if not cuda:
        torch.set_num_threads(max(1, torch.get_num_threads()))

    model, processor = build_model(llm_layers, device, dtype)
    batches = args.batch or ([1, 8, 32] if cuda else [1])
    results = {}
    for batch in batches:
        methods = ENCODER_METHODS if "all" in args.methods else args.methods
        results[batch], inputs = measure_ttft(model, processor, batch, args.budgets, repeats, device, dtype, methods)
    prompt_tokens = int(inputs["input_ids"].shape[1])
    inputs = processor(images=[example_image()], text=[build_prompt(processor, "hi")], return_tensors="pt").to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)

    # [CLS] scores: official eager + output_attentions vs ours
    tower = model.model.vision_tower
    eager = copy.deepcopy(tower)
    eager.config._attn_implementation = "eager"
    pixel_values = inputs["pixel_values"]
    probe = ClsAttentionProbe(tower.encoder.layers[-2].self_attn)

    @torch.inference_mode()
    def tower_sdpa():
        tower(pixel_values, output_hidden_states=True)

    @torch.inference_mode()
    def tower_ours():
        with probe:
            tower(pixel_values, output_hidden_states=True)
        probe.scores  # noqa: B018

    @torch.inference_mode()
    def tower_official():
        out = eager(pixel_values, output_hidden_states=True, output_attentions=True)
        out.attentions[-2][:, :, 0, 1:].mean(dim=1)

    @torch.inference_mode()
    def scores_only():
        probe.scores  # noqa: B018  (captured q/k of the last tower_ours run)

    scoring = common.interleaved(
        {
            "tower_sdpa": tower_sdpa,
            "tower_ours": tower_ours,
            "tower_official": tower_official,
            "scores_only": scores_only,
        },
        repeats=repeats,
        device=device,
    )
    base = scoring["tower_sdpa"]["median_s"]
    ours_cost = max(scoring["tower_ours"]["median_s"] - base, scoring["scores_only"]["median_s"])
    official_cost = scoring["tower_official"]["median_s"] - base

    environment = common.environment(device)
    lines = [
        f"LLaVA-1.5-7B shapes, random weights, {device.type} ({environment.get('gpu', 'CPU')}), {dtype}, "
        f"LLM {llm_layers}/32 layers, prompt {prompt_tokens} tokens per sample, median and min-max of {repeats} "
        "interleaved runs after a warm-up; a speedup whose spread contains 1.0 is within noise.",
    ]
    targets = {}
    for batch, rows in results.items():
        unpruned = rows["unpatched"]["ttft_ms"]
        lines += [
            "",
            f"Batch {batch}:",
            "",
            "| config | visual tokens / image | TTFT ms (median, min-max) | speedup (spread) | vs oracle's TTFT "
            "| selection ms (% of unpruned TTFT) | peak MB above weights |",
            "|---|---:|---:|---|---|---:|---:|",
        ]
        for name, row in rows.items():
            rel, sel = "", ""
            if "@" in name and not name.startswith("oracle@"):
                row["selection_share"] = row["selection_ms"] / unpruned
                rel = row["vs_oracle_text"]
                sel = f"{row['selection_ms']:.2f} ({row['selection_share']:.2%})"
                targets[f"batch{batch}/{name}"] = {  # within noise of the oracle counts as reaching it
                    "speedup>=0.95*oracle": row["vs_oracle_high"] >= 0.95,
                    "selection<=3%": row["selection_share"] <= 0.03,
                }
            speed = "(baseline)" if name == "unpatched" else row["speedup_text"]
            lines.append(
                f"| {name} | {row['visual_tokens']} | {common.ttft_cell(row)} | {speed} | {rel} | {sel} | "
                f"{row['peak_mb']:.0f} |"
            )
    # the scores' cost: the whole tower with them against the official eager path (ratio under the timing rule);
    # the extra costs below are differences of medians and mean something only when the towers differ beyond noise
    towers = common.speedup(scoring["tower_official"], scoring["tower_ours"])
    measurable = ours_cost > 0 and official_cost > 0 and not towers.within_noise
    ratio = official_cost / ours_cost if measurable else None
    targets["scoring>=3x cheaper"] = ratio is not None and ratio >= 3
    missed = [
        f"{name}: {goal}"
        for name, goals in targets.items()
        if isinstance(goals, dict)
        for goal, ok in goals.items()
        if not ok
    ] + ([] if targets["scoring>=3x cheaper"] else ["scoring"])
    verdict = "all met" if not missed else "missed " + "; ".join(missed)
    lines += [
        "",
        "[CLS] scores for the whole 24-layer tower (one image):",
        "",
        "| path | tower ms | extra cost of the scores ms |",
        "|---|---:|---:|",
        f"| SDPA tower, no scores | {base * 1e3:.2f} | - |",
        f"| official: eager + output_attentions | {scoring['tower_official']['median_s'] * 1e3:.2f} | "
        f"{official_cost * 1e3:.2f} |",
        f"| vtoken: SDPA + [CLS] row from hooked q/k | {scoring['tower_ours']['median_s'] * 1e3:.2f} | "
        f"{ours_cost * 1e3:.3f} |",
        "",
        f"Whole tower, vtoken's path vs the official eager path: {towers}. "
        + (
            f"Extra cost of the scores: {ratio:.1f}x lower than the eager path's. "
            if ratio is not None
            else "Extra cost of the scores: not measurable here (a cost at or below 0, or towers within noise). "
        )
        + f"Targets (speedup >= 0.95 x oracle's, selection <= 3 % of unpruned TTFT, scoring >= 3x cheaper): "
        f"{verdict}.",
    ]
    table = "\n".join(lines)
    payload = {
        "environment": environment,
        "shape": {
            "vision": "CLIP ViT-L/14-336",
            "llm": "Llama-7B widths",
            "llm_layers": llm_layers,
            "dtype": str(dtype),
            "prompt_tokens": prompt_tokens,
        },
        "repeats": repeats,
        "ttft": {f"batch{b}": rows for b, rows in results.items()},
        "scoring": {k: v["timing"].to_dict() for k, v in scoring.items()}
        | {
            "ours_cost_s": ours_cost,
            "official_cost_s": official_cost,
            "ratio": ratio,
            "tower_ours_vs_official": towers.to_dict(),
        },
        "targets": targets,
    }
    json_path, md_path = common.write_results(args.name or f"llava15_{device.type}", payload, table, args.out)
    print(table)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
