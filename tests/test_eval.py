"""lmms-eval integration: the real lmms-eval CLI (subprocesses, offline) against direct `generate` of the same model.

Every lmms-eval run costs an interpreter start and lmms-eval's import (~10 s of CPU), so one process runs the four
batch/method settings and the video one through lmms-eval's own `--config` list (each entry is a full run: model
built from its --model_args, tasks, evaluation, samples log).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import vtoken
from vtoken.eval import data, tasks_path
from vtoken.eval.options import build_methods
from vtoken.images import load_video
from vtoken.zoo import build_prompt, load

LIMIT = 8
METHODS = {"fastervlm": "method=fastervlm,budget=0.25", "fastv": "method=fastv,keep=0.25"}


def lmms_eval(args: list[str], cache: Path, launcher: list[str] | None = None, timeout: int = 600):
    """Run `python -m lmms_eval ARGS` offline (optionally under a launcher) and return the completed process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", VTOKEN_CACHE=str(cache),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    command = [*(launcher or [sys.executable]), "-m", "lmms_eval", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cache)


def samples(out: Path, task: str) -> list[dict]:
    """The samples log lmms-eval wrote under `out` for `task`, in document order."""
    (path,) = out.rglob(f"*_samples_{task}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["doc_id"])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("vtoken_cache")
    os.environ["VTOKEN_CACHE"] = str(path)  # this process's data (the references) from the same cache
    yield path
    os.environ.pop("VTOKEN_CACHE", None)


@pytest.fixture(scope="module")
def cli_runs(cache):
    """One lmms-eval process, five runs: vtoken-mini x {fastervlm, fastv} x batch {1, 4}, and a video model."""
    configs = []
    for name, args in METHODS.items():
        for batch in (1, 4):
            configs.append({"model": "vtoken", "model_args": f"pretrained=vtoken-mini,{args}",
                            "tasks": "vtoken_mini_vqa", "batch_size": batch, "limit": LIMIT,
                            "output_path": str(cache / f"out-{name}-{batch}")})  # fmt: skip
    configs.append({"model": "vtoken", "model_args": "pretrained=tiny-llava-next-video,method=pool,budget=0.5,"
                    "max_frames=4", "tasks": "vtoken_mini_vqa_video", "batch_size": 2, "limit": 2,
                    "output_path": str(cache / "out-video")})  # fmt: skip
    config = cache / "runs.yaml"
    config.write_text(yaml.safe_dump(configs))
    done = lmms_eval(["--config", str(config), "--include_path", str(tasks_path()), "--log_samples"], cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cache


def direct_answers(model, processor, rows: list[dict]) -> tuple[list[str], list[dict]]:
    """Batch-1 greedy answers (max 3 new tokens, cut at a newline, as the task asks) and per-stage records."""
    answers, stages = [], []
    for row in rows:
        image = data.vqa.render(data.vqa.scene(data.SPLIT, row["index"]))
        inputs = processor(images=[image], text=[build_prompt(processor, row["question"])], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
        answers.append(text.split("\n")[0])
        per_stage: dict = {}
        for r in vtoken.handle_of(model).records:
            entry = per_stage.setdefault(r.stage, {"tokens_in": 0, "tokens_out": 0})
            entry["tokens_in"] += r.tokens_in
            entry["tokens_out"] += r.tokens_out
        stages.append(per_stage)
    return answers, stages


def test_entry_point_registered():
    """`pip install vtoken[eval]` registers the lmms-eval model id `vtoken` (a chat class)."""
    (entry,) = [e for e in importlib.metadata.entry_points(group="lmms_eval.models") if e.name == "vtoken"]
    from lmms_eval.models import get_model

    (manifest,) = entry.load()()
    assert manifest.model_id == "vtoken"
    cls = get_model("vtoken")
    from vtoken.eval.lmms_model import VTokenLMM

    assert cls is VTokenLMM and cls.is_simple is False


def test_tasks_path_command(capsys):
    """`python -m vtoken.eval --tasks-path` prints the task pack's directory, which holds the task YAMLs."""
    from vtoken.eval.__main__ import main

    assert main(["--tasks-path"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tasks_path() and (path / "vtoken_mini_vqa.yaml").exists()


@pytest.mark.parametrize("name", list(METHODS))
def test_cli_matches_direct_generate(cli_runs, name):
    """lmms-eval at batch 1 and 4 answers every sample exactly as `generate` on the patched model does, and its
    samples log carries the same per-stage token counts as the patch handle's records."""
    rows = data.questions("image")[:LIMIT]
    model, processor = load("vtoken-mini")
    params = dict(item.split("=") for item in METHODS[name].split(",")[1:])
    vtoken.patch(model, build_methods(name, {k: float(v) for k, v in params.items()}, []))
    try:
        expected, stages = direct_answers(model, processor, rows)
    finally:
        vtoken.unpatch(model)
    assert any(stage for stage in stages), "the patched model recorded nothing"
    for batch in (1, 4):
        logged = samples(cli_runs / f"out-{name}-{batch}", "vtoken_mini_vqa")
        assert [s["doc_id"] for s in logged] == list(range(LIMIT))
        assert [s["filtered_resps"] for s in logged] == expected, f"batch {batch}"
        assert [s["token_counts"][0]["stages"] for s in logged] == stages, f"batch {batch}"
        assert [s["accuracy"] for s in logged] == [float(a.split()[:1] == [r["answer"]]) for a, r in
                                                   zip(expected, rows, strict=True)]  # fmt: skip
        for s in logged:
            counts = s["token_counts"][0]
            assert counts["visual_tokens"] == 144 and counts["ttft_ms"] > 0 and counts["selection_ms"] >= 0
    results = json.loads(next((cli_runs / f"out-{name}-4").rglob("*_results.json")).read_text())
    means = results["throughput"]
    kept = [s["token_counts"][0]["visual_kept"] for s in logged]
    assert means["avg_vtoken_samples"] == LIMIT
    assert means["avg_vtoken_visual_kept"] == pytest.approx(sum(kept) / LIMIT)


def test_cli_video_family(cli_runs, cache):
    """A video family (tiny LLaVA-NeXT-Video) answers MP4 clips of the task pack as `generate` does on frames
    decoded from the same files."""
    rows = data.questions("video")[:2]
    model, processor = load("tiny-llava-next-video")
    expected = []
    with vtoken.patched(model, "pool", budget=0.5) as handle:
        for row in rows:
            frames = load_video(data.video_path(row), 4)
            prompt = build_prompt(processor, row["question"], num_images=0, num_videos=1)
            inputs = processor(videos=[frames], text=[prompt], return_tensors="pt")
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
            text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
            expected.append(text.split("\n")[0])
            assert {r.modality for r in handle.records if r.stage == "encoder"} == {"video"}
    logged = samples(cli_runs / "out-video", "vtoken_mini_vqa_video")
    assert [s["filtered_resps"] for s in logged] == expected
    for s in logged:
        encoder = s["token_counts"][0]["stages"]["encoder"]
        assert encoder["tokens_out"] < encoder["tokens_in"]
    assert data.video_path(rows[0]).read_bytes()[4:8] == b"ftyp"  # a real MP4 in the cache


def test_cli_bad_model_args_fails_with_vtoken_message(cache):
    """A misspelt method parameter stops lmms-eval (non-zero exit) naming the key and what is accepted."""
    args = "pretrained=vtoken-mini,method=fastervlm,budgt=0.5"
    done = lmms_eval(["--model", "vtoken", "--model_args", args, "--tasks", "vtoken_mini_vqa",
                      "--include_path", str(tasks_path()), "--limit", "2"], cache)  # fmt: skip
    assert done.returncode != 0
    assert "vtoken: unknown model_args entry 'budgt'" in done.stderr
    assert "fastervlm: budget, scope" in done.stderr


def test_two_processes_match(cli_runs, cache):
    """`accelerate launch --multi_gpu --num_processes 2` (CPU, gloo) answers as the one-process run does, and the
    run-level means cover both ranks' samples."""
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                str(port)]  # fmt: skip
    out = cache / "out-2proc"
    done = lmms_eval(["--model", "vtoken", "--model_args", f"pretrained=vtoken-mini,{METHODS['fastervlm']}",
                      "--tasks", "vtoken_mini_vqa", "--include_path", str(tasks_path()), "--limit", str(LIMIT),
                      "--batch_size", "2", "--output_path", str(out), "--log_samples"], cache, launcher)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one = samples(cli_runs / "out-fastervlm-1", "vtoken_mini_vqa")
    two = samples(out, "vtoken_mini_vqa")
    assert [s["filtered_resps"] for s in two] == [s["filtered_resps"] for s in one]
    assert [s["token_counts"][0]["stages"] for s in two] == [s["token_counts"][0]["stages"] for s in one]
    results = json.loads(next(out.rglob("*_results.json")).read_text())
    assert results["throughput"]["avg_vtoken_samples"] == LIMIT


# ---- in-process: the model class, its options, records of batches, the sweep


def requests_for(lm, docs: list[dict], messages) -> list:
    """lmms-eval chat requests for `docs` of a task "t" whose `messages(doc)` builds each doc's chat turn."""
    from lmms_eval.api.instance import Instance

    lm.task_dict = {"t": {"test": docs}}
    return [
        Instance(
            "generate_until",
            ("", messages, {"max_new_tokens": 2, "until": ["\n"]}, i, "t", "test"),
            0,
            metadata={"task": "t", "doc_id": i, "repeats": 1},
        )  # fmt: skip
        for i in range(len(docs))
    ]


def test_options_route_parameters_and_name_bad_keys():
    """Composition: unprefixed parameters go to the one method that accepts them, `name.param` to that method;
    an unknown, ambiguous or misplaced key fails naming itself and what is accepted."""
    hired, fastv = build_methods("hired+fastv", {"budget": 0.2, "fastv.layer": 3, "keep": 0.5}, ["pretrained"])
    assert (type(hired).__name__, hired.budget) == ("HiRED", 0.2)
    assert (type(fastv).__name__, fastv.layer, fastv.keep) == ("FastV", 3, 0.5)
    (mustdrop,) = build_methods("mustdrop", {"layers": "[1,2]", "global_thr": 0.01}, [])
    assert mustdrop.layers == (1, 2) and mustdrop.global_thr == 0.01
    hired, pdrop = build_methods("hired+pyramiddrop", {"budget": 0.5, "layers": "[1,2]", "ratios": "[0.5,0.25]"}, [])
    assert (hired.budget, pdrop.layers, pdrop.ratios) == (0.5, (1, 2), (0.5, 0.25))
    dart, sparse = build_methods("dart", {"keep": 64}, []) + build_methods("sparsevlm", {"budget": 128}, [])
    assert (dart.keep, sparse.counts) == (64, (303, 110, 36))
    with pytest.raises(vtoken.VTokenError, match=r"'budget' is a parameter of hired and fastervlm"):
        build_methods("hired+fastervlm", {"budget": 0.2}, [])
    with pytest.raises(vtoken.VTokenError, match=r"unknown model_args entry 'kep'.*fastv: layer, keep"):
        build_methods("fastv", {"kep": 0.5}, ["pretrained"])
    with pytest.raises(vtoken.VTokenError, match=r"'pool' is not one of the methods"):
        build_methods("fastv", {"pool.budget": 0.5}, [])
    with pytest.raises(vtoken.VTokenError, match=r"method parameters need method="):
        build_methods(None, {"budget": 0.5}, ["pretrained"])
    with pytest.raises(vtoken.UnknownMethodError, match=r"unknown method 'fastvlm'; available: .*fastervlm"):
        build_methods("fastvlm", {}, [])


def test_model_args_fail_before_loading():
    """Through lmms-eval's constructor path a bad entry stops the run (SystemExit) with vtoken's message; the
    class itself raises the VTokenError; `budget=1.0` arrives as the float 1.0 (keep all), `1` as one token."""
    from lmms_eval.utils import simple_parse_args_string

    from vtoken.eval.lmms_model import RunAborted, VTokenLMM

    with pytest.raises(RunAborted, match=r"vtoken: model_args layout='offical'; accepted: native, official"):
        VTokenLMM.create_from_arg_string("pretrained=vtoken-mini,method=fastervlm,layout=offical")
    with pytest.raises(vtoken.VTokenError, match=r"batch_size=0"):
        VTokenLMM(pretrained="vtoken-mini", batch_size=0)
    assert simple_parse_args_string("budget=1.0,b=1") == {"budget": 1.0, "b": 1}


def test_failing_sample_stops_the_run():
    """A sample vtoken cannot take stops `generate_until` with vtoken's message, never an empty answer."""
    from vtoken.eval.lmms_model import RunAborted, VTokenLMM

    lm = VTokenLMM(pretrained="tiny-llava", method="fastervlm", budget=0.5)

    def messages(doc):
        return [{"role": "user", "content": [{"type": "audio", "url": "a.wav"}, {"type": "text", "text": "hi"}]}]

    message = r"generation failed \(task t, doc 0\): InputError: vtoken models take images and videos"
    with pytest.raises(RunAborted, match=message):
        lm.generate_until(requests_for(lm, [{}], messages))


def test_batch_records_map_back_to_samples(photos):
    """LLaVA-NeXT (anyres crops) at batch 3 with 2, 1 and 0 images per sample: answers and per-sample stage
    records equal those of each sample run alone."""
    from vtoken.eval.lmms_model import VTokenLMM

    docs = [{"images": ["astronaut", "rocket"]}, {"images": ["coffee"]}, {"images": []}]

    def messages(doc):
        content = [{"type": "image", "url": photos[name]} for name in doc["images"]]
        return [{"role": "user", "content": [*content, {"type": "text", "text": "what is in the image?"}]}]

    lm = VTokenLMM(pretrained="tiny-llava-next", method="fastervlm", budget=0.25, batch_size=3)
    batched = lm.generate_until(requests_for(lm, docs, messages))
    lm.batch_size_per_gpu = 1
    alone = lm.generate_until(requests_for(lm, docs, messages))
    assert [r.text for r in batched] == [r.text for r in alone]
    stages = [r.token_counts.stages for r in alone]
    assert [r.token_counts.stages for r in batched] == stages
    assert stages[0]["encoder"]["tokens_in"] > stages[1]["encoder"]["tokens_in"] > 0 and stages[2] == {}
    assert [r.token_counts.visual_tokens for r in batched] == [r.token_counts.visual_tokens for r in alone]
    # the LLM's input, measured per row of the padded batch as alone: kept patches + the newline separators kept
    kept = [r.token_counts.visual_kept for r in batched]
    assert kept == [r.token_counts.visual_kept for r in alone]
    for row in (0, 1):
        assert stages[row]["encoder"]["tokens_out"] < kept[row] < batched[row].token_counts.visual_tokens
    assert kept[2] == batched[2].token_counts.visual_tokens == 0


def test_vtoken_eval_sweep(cache, tmp_path, monkeypatch):
    """`vtoken eval` loads the model once and scores every setting as `vtoken.mini.evaluate` does on the same
    questions; it writes JSON, Markdown and the plot."""
    import vtoken.eval.lmms_model as lmms_model
    from vtoken.cli import main
    from vtoken.mini import vqa
    from vtoken.mini.evaluate import evaluate

    loads = []
    monkeypatch.setattr(lmms_model, "load", lambda *a, **k: loads.append(a) or load(*a, **k))
    out = tmp_path / "sweep"
    assert main(["eval", "--model", "vtoken-mini", "--methods", "fastervlm,pool", "--budgets", "0.25",
                 "--limit", "10", "--batch-size", "5", "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    assert len(loads) == 1
    report = json.loads((out / "sweep.json").read_text())
    model, processor = load("vtoken-mini")
    pairs = vqa.question_set("test", 10)
    correct = {}
    for setting in report["settings"]:
        method = setting["method"]
        if method != "none":
            vtoken.patch(model, method, budget=0.25)
        try:
            result = evaluate(model, processor, pairs, batch=5)
        finally:
            if method != "none":
                vtoken.unpatch(model)
        expected = result.accuracy()["all"]
        assert setting["scores"]["vtoken_mini_vqa/accuracy"] == pytest.approx(expected), method
        assert setting["means"]["vtoken_visual_kept"] == (144 if method == "none" else 36)
        # n, standard error and 95 % interval beside the accuracy and the retention, recomputed by hand
        right = np.array(result.correct, dtype=float)
        correct[method] = right
        found = setting["estimates"]["vtoken_mini_vqa/accuracy"]
        assert found["score"]["n"] == 10 and found["score"]["value"] == pytest.approx(right.mean())
        assert found["score"]["se"] == pytest.approx(right.std(ddof=1) / np.sqrt(10))
        low, high = found["score"]["ci95"]
        assert low <= right.mean() <= high
        base = correct["none"]
        assert found["retention"]["value"] == pytest.approx(right.mean() / base.mean())
        residual = right - found["retention"]["value"] * base
        assert found["retention"]["se"] == pytest.approx(residual.std(ddof=1) / np.sqrt(10) / base.mean())
    env = report["environment"]
    assert {"date", "vtoken", "commit", "torch", "transformers", "device", "lmms_eval"} <= set(env)
    assert [s["method"] for s in report["settings"]] == ["none", "fastervlm", "pool"]
    for i, setting in enumerate(report["settings"]):  # TTFT under the timing rule: n runs, median, spread
        ttft = setting["ttft"]
        assert ttft["n"] == 2 and ttft["min_ms"] <= ttft["median_ms"] <= ttft["max_ms"]
        ratio = setting["ttft_vs_unpatched"]
        assert (ratio is None) == (i == 0)
        if ratio:
            assert ratio["low"] <= ratio["ratio"] <= ratio["high"]
            assert ratio["verdict"] == ("within noise" if ratio["low"] <= 1 <= ratio["high"] else
                                        "faster" if ratio["low"] > 1 else "slower")  # fmt: skip
    table = (out / "sweep.md").read_text()
    assert "retention" in table and "(n=10)" in table and " ± " in table and "n=10 |" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("family", ["tiny-llava", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-onevision",
                                    "tiny-video-llava", "tiny-llava-next-video"])  # fmt: skip
def test_every_family_answers_as_generate(family, photos):
    """Each built-in family through the `vtoken` model (pool at 50 %, batch 2, chat template) answers as a
    batch-1 `generate` of the same patched model with the family's own prompt."""
    from vtoken.eval.lmms_model import VTokenLMM

    names = ["chelsea", "rocket"]

    def messages(doc):
        image = {"type": "image", "url": photos[doc["name"]]}
        return [{"role": "user", "content": [image, {"type": "text", "text": "what is in the image?"}]}]

    lm = VTokenLMM(pretrained=family, method="pool", budget=0.5, batch_size=2)
    answers = [r.text for r in lm.generate_until(requests_for(lm, [{"name": n} for n in names], messages))]
    model, processor = lm.model, lm.processor
    expected = []
    for name in names:
        prompt = build_prompt(processor, "what is in the image?")
        inputs = processor(images=[photos[name]], text=[prompt], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        text = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
        expected.append(text.split("\n")[0])
    assert answers == expected


@pytest.mark.parametrize("family", ["tiny-video-llava", "tiny-qwen2-vl", "tiny-onevision"])
def test_batch_of_a_video_and_an_image(family, cache):
    """A batch with an MP4 sample and an image sample: answers and per-sample records (image and video records
    are indexed per modality) equal those of each sample run alone."""
    from vtoken.eval.lmms_model import VTokenLMM
    from vtoken.images import example_image

    video, image = str(data.video_path(data.questions("video")[0])), example_image()

    def messages(doc):
        item = {"type": "video", "url": video} if doc["video"] else {"type": "image", "url": image}
        return [{"role": "user", "content": [item, {"type": "text", "text": "what is it?"}]}]

    docs = [{"video": True}, {"video": False}]
    lm = VTokenLMM(pretrained=family, method="pool", budget=0.5, batch_size=2, max_frames=4)
    batched = lm.generate_until(requests_for(lm, docs, messages))
    lm.batch_size_per_gpu = 1
    alone = lm.generate_until(requests_for(lm, docs, messages))
    assert [r.text for r in batched] == [r.text for r in alone]
    assert [r.token_counts.stages for r in batched] == [r.token_counts.stages for r in alone]
    video_stages, image_stages = (r.token_counts.stages for r in alone)
    assert video_stages["encoder"] != image_stages["encoder"]


def test_sweep_plot_keeps_equal_lines_apart():
    """Methods with identical scores at identical token counts stay visible: own marker and line style, and
    x positions offset from each other."""
    from vtoken.eval.sweep import Setting, figure

    key = "t/accuracy"
    samples = {key: {i: float(i % 2) for i in range(10)}}
    points = [Setting("none", None, {}, {key: 0.5}, {"vtoken_visual_kept": 144.0}, samples)]
    points += [Setting(m, b, {}, {key: 0.5}, {"vtoken_visual_kept": 144.0 * b}, samples)
               for m in ("fastervlm", "hired") for b in (0.5, 0.25)]  # fmt: skip
    fig = figure(points, "t")
    bars = {c.get_label(): c.lines[0] for c in fig.axes[0].containers}
    a, b = bars["fastervlm"], bars["hired"]
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())
    assert all(x != y for x, y in zip(a.get_xdata(), b.get_xdata(), strict=True))
    assert list(a.get_ydata()) == list(b.get_ydata()) == [0.5, 0.5]


def two_videos_batched_as_alone(method: str, params: dict) -> list:
    """Two MP4 samples through lmms-eval's `vtoken` model on tiny OneVision, batched and one by one: the answers and
    token counts must agree; returns the one-by-one results."""
    from vtoken.eval.lmms_model import VTokenLMM

    videos = [str(data.video_path(row)) for row in data.questions("video")[:2]]

    def messages(doc):
        item = {"type": "video", "url": videos[doc["i"]]}
        return [{"role": "user", "content": [item, {"type": "text", "text": "what happens?"}]}]

    docs = [{"i": 0}, {"i": 1}]
    lm = VTokenLMM(pretrained="tiny-onevision", method=method, batch_size=2, max_frames=4, **params)
    batched = lm.generate_until(requests_for(lm, docs, messages))
    lm.batch_size_per_gpu = 1
    alone = lm.generate_until(requests_for(lm, docs, messages))
    assert [r.text for r in batched] == [r.text for r in alone]
    assert [r.token_counts.stages for r in batched] == [r.token_counts.stages for r in alone]
    return alone


@pytest.mark.parametrize("method", ["fastvid", "holitom", "prunevid"])
def test_the_video_mergers_through_the_vtoken_model(method, cache):
    """FastVID, HoliTom and PruneVid's encoder stage through lmms-eval's `vtoken` model (`method=...,budget=...`;
    PruneVid: `layer=None`, no budget): two MP4 samples batched answer and count as each alone; every frame has its
    record; the count follows the data (no planned count)."""
    params = {"layer": None, "min_tokens": 6} if method == "prunevid" else {"budget": 0.3}
    alone = two_videos_batched_as_alone(method, params)
    assert all(r.token_counts.stages["encoder"] for r in alone)


@pytest.mark.parametrize("method", ["prunevid", "framefusion"])
def test_the_video_reducers_inside_the_llm_through_the_vtoken_model(method, cache):
    """PruneVid with its cut inside the LLM (`layer=0` on the 2-layer tiny LLM) and FrameFusion through lmms-eval's
    `vtoken` model: two MP4 samples batched answer and count as each alone, with the LLM stage's records."""
    params = {"layer": 0, "min_tokens": 6} if method == "prunevid" else {"cost": 0.5}
    alone = two_videos_batched_as_alone(method, params)
    prefix = "prefill.layer0" if method == "prunevid" else "prefill."
    assert all(any(s.startswith(prefix) for s in r.token_counts.stages) for r in alone)
