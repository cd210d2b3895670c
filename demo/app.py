"""Gradio demo: ask a question about an image, with and without visual-token reduction, and see what was kept.

pip install -e ".[demo]" && python demo/app.py [--model vtoken-mini] [--port 7860]

The default model, vtoken-mini, is trained on generated scenes: it opens on one of them with its question, so the
answer is checkable and the kept patches show whether the object that answers it survived.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

import vtoken
from vtoken.images import example_image
from vtoken.overlay import kept_overlay, model_view
from vtoken.records import summarize
from vtoken.zoo import MINI, build_prompt, load

DEFAULT_QUESTION = "What is in the image?"


def compare(model, processor, image, question: str, method: str, budget: float, max_new_tokens: int = 24) -> dict:
    """Answer unpatched and patched; returns answers, times, token counts and an overlay of the kept patches."""
    image = image if image is not None else example_image()
    inputs = processor(images=[image], text=[build_prompt(processor, question)], return_tensors="pt").to(model.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    budget = int(budget) if budget > 1 else float(budget)
    results = {}
    with torch.inference_mode():
        for name in ("unpatched", "patched"):
            with vtoken.patched(model, method, budget=budget) if name == "patched" else nullcontext() as handle:
                start = time.perf_counter()
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
                seconds = time.perf_counter() - start
                records = list(handle.records) if handle else []
            text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
            results[name] = {"answer": text.strip(), "seconds": seconds, "records": records}
    record = results["patched"]["records"][0]  # the first crop: LLaVA's image, or the anyres base view
    pixels = next((inputs[k] for k in ("pixel_values", "pixel_values_images") if k in inputs), None)
    if pixels is not None and pixels.dim() in (4, 5):  # image-shaped: show exactly what the model saw
        crop = pixels[0] if pixels.dim() == 4 else pixels[0, 0]
        view = model_view(crop, processor.image_processor.image_mean, processor.image_processor.image_std)
    else:  # patch rows (Qwen): the kept grid drawn on the uploaded image
        view = image.convert("RGB")
    results["overlay"] = kept_overlay(view, record.kept, record.grid)
    results["summary"] = summarize(results["patched"]["records"])
    return results


def starting_example(model_name: str) -> tuple:
    """(image, question) the demo opens on: vtoken-mini's generated example, else the generic scene."""
    if model_name == MINI:
        from vtoken.mini import example

        image, question, _ = example()
        return image, question
    return example_image(), DEFAULT_QUESTION


def build_demo(model, processor, start: tuple | None = None):
    import gradio as gr

    start_image, start_question = start or (example_image(), DEFAULT_QUESTION)

    def run(image, question, method, budget):
        r = compare(model, processor, image, question, method, budget)
        p, u = r["patched"], r["unpatched"]
        kept = sum(x.tokens_out for x in p["records"])
        total = sum(x.tokens_in for x in p["records"])
        stats = (
            f"visual tokens {total} -> {kept}; generate {u['seconds'] * 1e3:.0f} ms unpatched, "
            f"{p['seconds'] * 1e3:.0f} ms patched"
        )
        return u["answer"], p["answer"], r["overlay"], stats + "\n\n" + r["summary"]

    with gr.Blocks(title="vtoken") as demo:
        gr.Markdown("# vtoken: visual-token reduction, side by side")
        with gr.Row():
            with gr.Column():
                image = gr.Image(type="pil", value=start_image, label="image")
                question = gr.Textbox(value=start_question, label="question")
                method = gr.Dropdown(vtoken.available_methods(), value="fastervlm", label="method")
                budget = gr.Slider(0.01, 1.0, value=0.25, step=0.01, label="budget (fraction of visual tokens kept)")
                button = gr.Button("Run")
            with gr.Column():
                overlay = gr.Image(type="pil", label="kept patches (dropped ones dimmed)")
                unpatched = gr.Textbox(label="answer, unpatched")
                patched = gr.Textbox(label="answer, patched")
                stats = gr.Textbox(label="records", lines=6)
        button.click(run, [image, question, method, budget], [unpatched, patched, overlay, stats])
    return demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=MINI)
    parser.add_argument("--port", type=int, default=7860)
    args = parser.parse_args()
    model, processor = load(args.model)
    build_demo(model, processor, starting_example(args.model)).launch(server_name="127.0.0.1", server_port=args.port)


if __name__ == "__main__":
    main()
