"""Runs vLLM engines for tests/test_vllm*.py and benchmarks/bench_vllm.py, inside the vllm venv (.venv-vllm).

    .venv-vllm/bin/python tests/vllm_driver.py JOB.json OUT.json

JOB: {"engines": [{"model": DIR, "override": {...} | null, "requests": [{"prompt": str, "images": [PNG],
"videos": [NPY of [T, H, W, 3] uint8 frames], "fps": float (with videos)}],
"batch": bool, "max_tokens": int, "tp": int, "limit_mm": {...} | null}], "sys_path": [DIR] (put first on sys.path:
a folder with a test distribution's entry points), "setup": ["module:function"] (called before the engines:
registering a method at run time)}. Every engine runs in this one process
(the engine core in process, VLLM_ENABLE_V1_MULTIPROCESSING=0): the ~30 s of imports are paid once, each engine
then starts in a few seconds. "batch": all requests in one `generate` call, else one call per request. OUT: per
engine the start time and, per request, the prompt length, greedy ids and top-5 logprobs per step; or the error
raised at start. Per request run alone, also "kept": what every method's outermost `select` call during it chose
(per call, per crop: the indices of the tokens that reach the LLM unchanged, or None for a pure merge); a call
answered from vLLM's encoder cache selects nothing.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


SELECTIONS: list[list[list[int] | None]] = []  # per outermost `select` call in this process, per crop
# select calls that are no selection of a request's tokens: the Qwen plugin's plans made before the encoder (on
# stand-in features), and a merge re-run on the DeepStack companion features
DRY_RUNS = ("plan", "data_independent", "same_selection")
# a tower method's selection of a request's images: the one its tower runs on (the processor's and the positions'
# selections of the same pixels are the same call again)
TOWER_RUNS = ("_process_image_input",)


def record_selections() -> None:
    """Wrap `select` of every method class so each outermost call appends its choice to SELECTIONS (the engine core
    runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vtoken.methods.base import EncoderMethod
    from vtoken.registry import load_methods

    load_methods()
    depth = [0]

    def called_from(names) -> bool:
        """Whether a vtoken function named in `names` is on the stack above the wrapped call."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name in names and frame.f_globals.get("__name__", "").startswith("vtoken."):
                return True
            frame = frame.f_back
        return False

    def wrap(select):
        @functools.wraps(select)
        def recorded(self, tokens):
            depth[0] += 1
            try:
                selection = select(self, tokens)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and not called_from(DRY_RUNS):
                unchanged = [selection.unchanged_of(c) for c in range(tokens.num_crops)]
                SELECTIONS.append([None if u is None else u.tolist() for u in unchanged])
            return selection

        return recorded

    def wrap_input(select_input):
        @functools.wraps(select_input)
        def recorded(self, pixels, grids, tower):
            selected = select_input(self, pixels, grids, tower)
            if called_from(TOWER_RUNS):  # per image, its kept units (the LLM-level tokens that reach the LLM)
                SELECTIONS.append([selected.kept_of(i).tolist() for i in range(len(selected.counts))])
            return selected

        return recorded

    from vtoken.methods.base import TowerMethod

    for cls in TowerMethod.__subclasses__():
        if "select_input" in cls.__dict__:
            cls.select_input = wrap_input(cls.__dict__["select_input"])
    classes, seen = [EncoderMethod], set()
    while classes:
        cls = classes.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if "select" in cls.__dict__:
            cls.select = wrap(cls.__dict__["select"])
        classes += cls.__subclasses__()


def video_item(frames, fps: float) -> tuple:
    """(frames, metadata): every frame, at `fps` (tests/vllm_support.py's reference gives transformers the same)."""
    count = len(frames)
    metadata = {"fps": fps, "duration": count / fps, "total_num_frames": count, "frames_indices": list(range(count))}
    return frames, dict(metadata, video_backend="opencv", do_sample_frames=False)


def run_engine(spec: dict) -> dict:
    import numpy
    from PIL import Image
    from vllm import LLM, SamplingParams

    overrides = {"vtoken": spec["override"]} if spec.get("override") is not None else None
    start = time.perf_counter()
    try:
        llm = LLM(model=spec["model"], dtype="float32", max_model_len=4096, enforce_eager=True, seed=0,
                  hf_overrides=overrides, limit_mm_per_prompt=spec.get("limit_mm", {"image": 2, "video": 1}),
                  tensor_parallel_size=spec.get("tp", 1))  # fmt: skip
    except Exception as failure:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(failure).__name__}: {failure}"}
    started = time.perf_counter() - start
    params = SamplingParams(max_tokens=spec.get("max_tokens", 5), temperature=0.0, logprobs=5)
    prompts = []
    for r in spec["requests"]:
        data = {"image": [Image.open(p).convert("RGB") for p in r["images"]]} if r["images"] else {}
        if r.get("videos"):  # [T, H, W, 3] uint8 frames, every one sent (vLLM's Qwen video parser needs metadata)
            data["video"] = [video_item(numpy.load(p), r["fps"]) for p in r["videos"]]
        prompts.append({"prompt": r["prompt"], "multi_modal_data": data} if data else {"prompt": r["prompt"]})
    if spec.get("batch"):
        outputs, kept = llm.generate(prompts, params, use_tqdm=False), [None] * len(prompts)
    else:
        outputs, kept = [], []
        for p in prompts:
            SELECTIONS.clear()
            outputs.append(llm.generate(p, params, use_tqdm=False)[0])
            kept.append(list(SELECTIONS))
    results = []
    for out, chosen in zip(outputs, kept, strict=True):
        completion = out.outputs[0]
        steps = [{str(i): lp.logprob for i, lp in step.items()} for step in completion.logprobs]
        results.append({"prompt_len": len(out.prompt_token_ids), "ids": list(completion.token_ids), "logprobs": steps,
                        "kept": chosen})  # fmt: skip
    # one full collection to close the engine: vLLM's shutdown collects twice itself, each ~1 s over this process's
    # vLLM and torch objects (45 engines: ~2 min of a test run)
    collect, gc.collect = gc.collect, lambda *args, **kwargs: 0
    try:
        del llm
        collect()
    finally:
        gc.collect = collect
    return {"start_s": started, "results": results}


def main() -> None:
    job = json.load(open(sys.argv[1]))
    sys.path[:0] = job.get("sys_path", [])
    for target in job.get("setup", []):
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)()
    record_selections()
    out = [run_engine(spec) for spec in job["engines"]]
    json.dump({"engines": out}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
