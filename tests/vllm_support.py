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


def run_driver(job: dict, folder: Path, timeout: int = 900) -> list[dict]:
    """Run the engines of `job` in one vllm-venv process; their results in order."""
    job_path, out_path = folder / "job.json", folder / "out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
    try:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
    finally:
        hook.remove()
    encoder = [r for r in handle.records if r.stage == "encoder"] if handle else []
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
        "kept": [None if r.kept is None else r.kept.tolist() for r in handle.records if r.stage == "encoder"]
        if handle
        else None,
        "ids": out.sequences[0, length:].tolist(),
        "logprobs": [torch.log_softmax(step[0].float(), -1) for step in out.logits],
    }


def assert_same(got: dict, ref: dict, tolerance: float = 1e-4) -> None:
    """vLLM's greedy ids equal the reference's, its top-5 logprobs too (within `tolerance`), and its prompt is
    the one the reference's LLM ran on: shorter by the visual tokens the method dropped (and by the placeholders
    that are no visual tokens and that the layout leaves out: LLaVA-NeXT's newlines under layout="official")."""
    lengths = (got["prompt_len"], ref["prompt_len"], ref["llm_len"], ref["dropped"], ref["uncounted"])
    assert got["prompt_len"] == ref["llm_len"] == ref["prompt_len"] - ref["dropped"] - ref["uncounted"], lengths
    assert got["ids"] == ref["ids"][: len(got["ids"])], (got["ids"], ref["ids"])
    for step, (mine, theirs) in enumerate(zip(got["logprobs"], ref["logprobs"], strict=False)):
        top = set(theirs.topk(5).indices.tolist())
        assert top <= {int(i) for i in mine} or len(set(theirs.topk(6).values.tolist())) < 6, (step, mine, top)
        for token, value in mine.items():
            assert abs(value - float(theirs[int(token)])) <= tolerance, (step, token, value, float(theirs[int(token)]))


def save_checkpoints(folder: Path, families: tuple[str, ...]) -> dict[str, Path]:
    """Tiny checkpoints; "FAMILY-sharp": FAMILY with the scored CLIP layer's queries x30 (`save_tiny`'s
    query_scale: [CLS] scores well apart)."""
    from vtoken.serving.vllm.checkpoints import save_tiny

    def save(family: str) -> Path:
        if family.endswith("-sharp"):
            return save_tiny(family.removesuffix("-sharp"), folder / family, query_scale=30.0)
        return save_tiny(family, folder / family)

    return {family: save(family) for family in families}
