"""Serving throughput with vtoken's vLLM plugin: pruning off, on, and the oracle, at concurrency 1, 8 and 32.

    .venv/bin/python benchmarks/bench_vllm.py --levels 1,4,12 --requests 12 --out benchmarks/results   # CPU cut
    .venv/bin/python benchmarks/bench_vllm.py --device cuda --model llava-hf/llava-1.5-7b-hf \\
        --oracle PATH_TO_A_CHECKPOINT_WHOSE_IMAGES_GIVE_K_TOKENS --python .venv-vllm/bin/python

Modes: "off" (the stock model), "on" (`--method`, default fastervlm at 25 %: 144 of 576 tokens per image), and
"oracle": a checkpoint whose images give k tokens to begin with (on CPU: the tiny LLaVA at 168 px, a 12 x 12
grid), so the LLM sees k tokens at zero selection cost: the best pruning can do. Each mode is one engine; each
concurrency level sends `--requests` prompts, each with an image no other request sent (a crop of the photo at
its own offset: vLLM's caches serve nothing), through vLLM's async engine, at most
`concurrency` in flight. The three engines run side by side and the rounds interleave the modes, `--repeats`
rounds per level: requests/s and output tokens/s are the median of the rounds with their range, TTFT p50/p99 over
every request, and ratios to "off". On a loaded CPU, `--levels 1,4,8 --requests 16` keeps the cut short.
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
PROMPT = "USER: <image>\nwhat is in the image? describe the image in detail. ASSISTANT:"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def crops(image, first: int, count: int) -> list:
    """`count` different images (crops of `image` at distinct offsets, numbered from `first`): each request of the
    benchmark sends an image no earlier request sent, so vLLM's encoder, processor and prefix caches never serve a
    prompt from a previous one (every request pays its image's encoding and prefill, as distinct users' would)."""
    width, height = image.size
    side = min(width, height) - 64
    offsets = [divmod(first + i, 64) for i in range(count)]
    return [image.crop((dx, dy, dx + side, dy + side)) for dy, dx in offsets]


async def measure(engine, images: list, concurrency: int, max_tokens: int, tag: str = "w") -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    ttft, tokens = [], []

    async def one(index: int) -> None:
        async with gate:
            start, first, count = time.perf_counter(), None, 0
            inputs = {"prompt": PROMPT, "multi_modal_data": {"image": images[index]}}
            async for out in engine.generate(inputs, params, request_id=f"r{tag}-{concurrency}-{index}"):
                first = first or time.perf_counter()
                count = len(out.outputs[0].token_ids)
            ttft.append(first - start)
            tokens.append(count)

    requests, start = len(images), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    rates = {"requests_per_s": requests / elapsed, "output_tokens_per_s": sum(tokens) / elapsed}
    return {"concurrency": concurrency, **rates, "ttft_s": ttft}


async def start_engine(model: str, override: dict | None, args):
    """(engine, seconds to start) for one mode."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(model=model, dtype=args.dtype, max_model_len=4096, enforce_eager=args.device == "cpu",
                                  hf_overrides={"vtoken": override} if override else {}, seed=0)  # fmt: skip
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args)
    return engine, time.perf_counter() - start


async def run_all(args) -> dict:
    """Every mode's engine up at once; rounds interleave the modes (off, on, oracle, off, ...) at each level, so the
    load other processes put on a shared machine falls on every mode alike."""
    from PIL import Image

    modes = {"off": (args.model, None), "on": (args.model, json.loads(args.method)), "oracle": (args.oracle, None)}
    image = Image.open(args.image).convert("RGB")
    engines, results = {}, {}
    try:
        for name, (model, override) in modes.items():
            engines[name], started = await start_engine(model, override, args)
            results[name] = {"engine_start_s": started, "rounds": {str(c): [] for c in args.levels}}
            await measure(engines[name], crops(image, 4000, 2), 1, args.max_tokens)  # warm-up
        first = 0
        for round_ in range(args.repeats):
            for level in args.levels:
                images, first = crops(image, first, args.requests), first + args.requests  # the same for every mode
                for name, engine in engines.items():
                    measured = await measure(engine, images, level, args.max_tokens, f"{round_}")
                    results[name]["rounds"][str(level)].append(measured)
                    print(f"bench_vllm: round {round_} concurrency {level} {name}: "
                          f"{measured['requests_per_s']:.2f} requests/s", flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
    return results


def worker(args) -> None:
    Path(args.worker_out).write_text(json.dumps(asyncio.run(run_all(args))))


def summary(rounds: list[dict]) -> dict:
    """Median and range over rounds of requests/s and output tokens/s; TTFT percentiles over every request."""
    rates = [r["requests_per_s"] for r in rounds]
    tokens = [r["output_tokens_per_s"] for r in rounds]
    ttft = [t for r in rounds for t in r["ttft_s"]]
    return {"requests_per_s": statistics.median(rates), "requests_per_s_min": min(rates),
            "requests_per_s_max": max(rates), "output_tokens_per_s": statistics.median(tokens),
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 0.99)}  # fmt: skip


def versus(results: dict, mode: str, level: int) -> str:
    """`mode`'s throughput over "off"'s at `level` as a `vtoken.timing.Ratio` of seconds per request per round."""
    from vtoken.timing import Timing, compare

    def per_request(name: str) -> Timing:
        return Timing(tuple(1 / r["requests_per_s"] for r in results[name]["rounds"][str(level)]))

    return str(compare(per_request("off"), per_request(mode)))


def table(results: dict, meta: dict) -> str:
    lines = [f"# vLLM serving: pruning off / on / oracle ({meta['device']})", "",
             f"Model: {meta['model']}; on: `{meta['method']}`; oracle: {meta['oracle']}; {meta['requests']} requests "
             f"per round, {meta['max_tokens']} output tokens each, {meta['repeats']} rounds per mode and level, "
             f"modes interleaved; vLLM {meta['vllm']}; {meta['machine']}.", "",
             "requests/s and output tok/s: median of the rounds [min–max]; TTFT over every request of every round; "
             "req/s vs off: ratio of the medians, with the interval the rounds allow and vtoken.timing's verdict "
             "(an interval containing 1.0 reads 'within noise').", "",
             "| mode | concurrency | req/s [min–max] | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | req/s vs off |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode in ("off", "on", "oracle"):
        for level in meta["levels"]:
            row = summary(results[mode]["rounds"][str(level)])
            lines.append(
                f"| {mode} | {level} | {row['requests_per_s']:.2f} [{row['requests_per_s_min']:.2f}–"
                f"{row['requests_per_s_max']:.2f}] | {row['output_tokens_per_s']:.1f}"
                f" | {row['ttft_p50_s'] * 1e3:.0f} | {row['ttft_p99_s'] * 1e3:.0f} |"
                f" {'1.00' if mode == 'off' else versus(results, mode, level)} |"
            )
    starts = ", ".join(f"{m} {results[m]['engine_start_s']:.1f} s" for m in ("off", "on", "oracle"))
    return "\n".join(lines + ["", f"Engine start: {starts}."]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", help="checkpoint (default on CPU: the tiny LLaVA-1.5, saved now)")
    parser.add_argument("--oracle", help="checkpoint whose images give k tokens (default on CPU: tiny LLaVA, 168 px)")
    parser.add_argument("--method", default='{"method": "fastervlm", "budget": 0.25}')
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per mode and level")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--image")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, help="only rewrite the Markdown table of this results JSON")
    sys.path.insert(0, str(Path(__file__).parent))
    if "--worker" not in sys.argv:
        import common

        common.add_out(parser)
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.levels = [int(c) for c in str(args.levels).split(",")]
    if args.worker:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        worker(args)
        return
    if args.render:
        saved = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(table(saved["results"], saved["meta"]))
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
        command = [args.python, __file__, "--worker", "--worker-out", str(out), "--device", args.device,
                   "--model", args.model, "--oracle", args.oracle, "--method", args.method,
                   "--requests", str(args.requests), "--levels", ",".join(map(str, args.levels)),
                   "--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype,
                   "--image", args.image]  # fmt: skip
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        results = json.loads(out.read_text())
    probe = "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"
    version, torch_version, transformers_version = subprocess.run([args.python, "-c", probe], capture_output=True,
                                                                  text=True).stdout.split()  # fmt: skip
    tiny = args.model.startswith(tempfile.gettempdir())
    meta = {"device": args.device, "model": "tiny LLaVA-1.5 (zoo)" if tiny else args.model, "method": args.method,
            "oracle": "tiny LLaVA-1.5 at 168 px (144 tokens)" if tiny else args.oracle, "requests": args.requests,
            "max_tokens": args.max_tokens, "vllm": version, "levels": args.levels, "repeats": args.repeats,
            "vllm_venv": {"torch": torch_version, "transformers": transformers_version},
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}  # fmt: skip
    payload = {"environment": common.environment(args.device), "meta": meta, "results": results}
    for path in common.write_results(f"vllm_{args.device}", payload, table(results, meta), args.out):
        print("wrote", path)
    print(table(results, meta))


if __name__ == "__main__":
    sys.exit(main())
