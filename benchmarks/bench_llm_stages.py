"""The LLM stages on a LLaVA-1.5-shaped model: MustDrop at the official threshold settings and FastV at 50/25 %,
next to the unpatched model: time to first token, decode tokens/s, KV-cache bytes after the prefill, peak
memory, and the visual tokens the LLM sees (entering it, and averaged over its layers as MustDrop reports).

On a GPU: CLIP ViT-L/14-336 + Vicuna-7B at full depth, bf16. On a CPU the widths and depths are cut (the table
says how): the LLM keeps 16 layers so that MustDrop's drop points 2, 6, 10, 14 all exist; the tower keeps 4
(the merge after layer 0, the feature layer, the key set from the last). Random weights: the thresholds drop
what random attention maps make them drop, so the token columns matter as much as the times.

    python benchmarks/bench_llm_stages.py                  # CPU, cut shapes
    python benchmarks/bench_llm_stages.py --device cuda    # GPU, real shapes
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from bench_families import _build  # noqa: E402
from vtoken.adapters import hf  # noqa: E402

import vtoken  # noqa: E402
from vtoken.images import example_image  # noqa: E402
from vtoken.timing import Timing, compare  # noqa: E402
from vtoken.zoo import build_prompt, tiny_llava  # noqa: E402

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


def cache_bytes(model, inputs) -> int:
    """Bytes of the KV cache after a prefill of `inputs`."""
    with torch.no_grad():
        cache = hf.cache_out(model(**inputs, use_cache=True))
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    parser = common.ttft_parser(__doc__, "unused: the CPU shapes are fixed (see the docstring)")
    parser.add_argument("--decode-tokens", type=int, default=16)
    args = parser.parse_args()
    device, dtype, _, repeats = common.run_settings(args)
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
    timed = common.interleaved(runs, repeats, device, contexts=contexts)
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
        f"x {width} wide; {steps} decode tokens.",
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
    common.report("llm_stages", device, dtype, repeats, results, lines, args.out)


if __name__ == "__main__":
    main()
