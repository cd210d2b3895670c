import sys

import pytest
import torch
from conftest import OTHER_TINY_MODELS

import vtoken
from vtoken.cli import main
from vtoken.images import example_image


def quick_run(*args: str) -> int:
    """`vtoken run` with one timing repeat and one new token."""
    return main(["run", *args, "--repeats", "1", "--max-new-tokens", "1"])


def test_run_on_builtin_tiny_model_with_an_image_file(tmp_path, capsys):
    path = tmp_path / "scene.png"
    example_image(300).save(path)
    code = main(
        [
            "run",
            "--model",
            "tiny-llava",
            "--image",
            str(path),
            "--method",
            "fastervlm",
            "--budget",
            "0.25",
            "--repeats",
            "1",
            "--max-new-tokens",
            "2",
            "--prompt",
            "What colour is the circle?",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "visual tokens (the LLM's input): 576 -> 144 (25.0% kept)" in out
    assert "time to first token (median of 1 interleaved runs" in out and "answer (patched)" in out
    assert "no spread, within noise" in out  # one run: no claim


@pytest.mark.parametrize(
    "unpatched, patched, verdict",
    [
        ((0.020, 0.021, 0.022), (0.010, 0.0105, 0.011), "2.00x faster (1.82-2.20)"),
        ((0.020, 0.018, 0.025), (0.019, 0.021, 0.024), "within noise"),  # keep-all: the spreads overlap
    ],
)
def test_run_prints_the_timing_rule(monkeypatch, capsys, unpatched, patched, verdict):
    """The speed line follows vtoken.timing's rule: median, min-max, n, and 'within noise' when spreads overlap
    (synthetic timings in place of the measured ones)."""
    from vtoken.timing import Timing

    seen = {}

    def fake(model, inputs, settings, repeats):
        seen.update(settings=list(settings), repeats=repeats)
        return {"unpatched": Timing(unpatched), "patched": Timing(patched)}

    monkeypatch.setattr("vtoken.cli.time_to_first_token", fake)
    assert main(["run", "--model", "tiny-llava", "--budget", "1.0", "--repeats", "3", "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert seen == {"settings": ["unpatched", "patched"], "repeats": 3}
    assert f"unpatched  {Timing(unpatched).ms()}" in out and "n=3)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("patched"))
    assert verdict in line and ("faster" in line) == ("faster" in verdict)


def test_default_is_vtoken_mini_on_its_generated_example(capsys):
    """With no arguments: the shipped trained model, a generated scene and its question, the expected answer
    (from the drawing parameters) beside the model's, and a map of the patches FasterVLM kept at 25 %."""
    from vtoken.mini import example

    _, question, answer = example()
    assert main(["run", "--repeats", "1", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "vtoken-mini" in out and question in out and "visual tokens (the LLM's input): 144 -> 36 (25.0% kept)" in out
    assert f"expected answer:    {answer!r}" in out
    assert f"answer (unpatched): {answer!r}" in out  # the example is one the shipped model answers right
    grid = [line.strip() for line in out.split("'#' kept):")[1].strip().splitlines()[:12]]
    assert all(len(row) == 12 and set(row) <= {"#", "."} for row in grid) and "".join(grid).count("#") == 36


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "1.5"], "outside (0, 1]"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--model", "nope"], "neither a built-in model"),
        (["--image", "/no/such/file.png"], "cannot read image"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(argv, message, capsys):
    assert quick_run(*argv) == 2
    assert message in capsys.readouterr().err


def test_count_budget_is_parsed_as_a_count(capsys):
    assert quick_run("--model", "tiny-llava", "--method", "pool", "--budget", "29") == 0
    assert "576 -> 29 (5.0% kept)" in capsys.readouterr().out


@pytest.mark.parametrize("model", OTHER_TINY_MODELS)
def test_every_builtin_family_runs(model, capsys):
    import re

    assert quick_run("--model", model, "--method", "random", "--budget", "0.25") == 0
    found = re.search(r"visual tokens \(the LLM's input\): (\d+) -> (\d+) \(", capsys.readouterr().out)
    assert found and int(found[2]) < int(found[1]) / 3  # a quarter of the patches (+ separators that stay)


@pytest.mark.parametrize(
    "model, expected",
    [
        ("tiny-qwen2-vl", "128 -> 32 (25.0% kept)"),
        ("tiny-onevision", "785 -> 197 (25.1% kept)"),  # + the one newline after the video's frames
        ("tiny-llava-next-video", "576 -> 144 (25.0% kept)"),
        ("tiny-video-llava", "1028 -> 260 (25.3% kept)"),  # + every frame's [CLS], which reaches the LLM
        ("tiny-internvl", "1024 -> 256 (25.0% kept)"),
    ],
)
def test_video_from_a_gif(tmp_path, capsys, model, expected):
    from vtoken.images import example_clip

    clip = example_clip(6)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    video = ("--video", str(path), "--frames", "4")
    assert quick_run("--model", model, *video, "--method", "pool", "--budget", "0.25") == 0
    out = capsys.readouterr().out
    assert "clip.gif" in out and f"visual tokens (the LLM's input): {expected}" in out


@pytest.mark.parametrize(
    "argv, shown",
    [
        ([], "fastervlm(budget=25%)"),  # the one default budget
        (["--budget", "25"], "fastervlm(budget=25 tokens)"),  # an int is a count, and says so
        (["--budget", "0.5"], "fastervlm(budget=50%)"),
        (["--method", "hired"], "hired(budget=25%)"),  # the same default for every method with a budget
        (["--method", "pool", "--budget", "36"], "pool(budget=36 tokens)"),
    ],
)
def test_run_shows_the_budget_it_applied(capsys, argv, shown):
    assert quick_run("--model", "vtoken-mini", *argv) == 0
    out = capsys.readouterr().out
    assert f"method:  {shown}\n" in out


def test_budget_reaches_each_methods_own_knob():
    from vtoken.cli import method_params

    assert method_params("fastervlm", 0.25) == {"fastervlm.budget": 0.25}
    assert method_params("fastv", 0.5) == {"fastv.keep": 0.5}
    assert method_params("mustdrop", 0.5) == {}  # its thresholds are the knob
    assert method_params("hired", None) == {"hired.budget": 0.25}  # one default
    assert method_params("fastervlm", None) == {"fastervlm.budget": 0.25}
    assert method_params("fastv", None) == {}  # FastV keeps its own `keep`
    assert method_params("dart", 0.222) == {"dart.keep": 0.222} and method_params("dart", None) == {}
    assert method_params("pyramiddrop", 0.5) == {}  # its ratios are the knob
    assert method_params("sparsevlm", 128) == {"sparsevlm.budget": 128}  # an official table
    assert method_params("sparsevlm", 0.25) == method_params("sparsevlm", None) == {}  # its default table (192)


def test_a_prefill_method_too_deep_for_the_model_exits_2(capsys):
    assert quick_run("--model", "tiny-llava", "--method", "fastv") == 2
    assert "layer=2 leaves no later layer" in capsys.readouterr().err
    assert quick_run("--model", "tiny-llava", "--method", "pyramiddrop") == 2
    assert "at most 1" in capsys.readouterr().err


def test_issue_26_methods_run_by_name(capsys):
    assert quick_run("--model", "vtoken-mini", "--method", "dart", "--budget", "0.25") == 0
    out = capsys.readouterr().out
    assert "method:  dart(layer=2, keep=25%)" in out
    assert "after LLM layer 1: 36" in out  # DART at layer 2 drops after layer 1: 4 pivots + 8 x int(144 / 32)
    assert quick_run("--model", "vtoken-mini", "--method", "sparsevlm", "--budget", "0.5") == 2  # defaults too deep
    assert "sparsevlm: layers=(2, 6, 15)" in capsys.readouterr().err


# --------------------------------------------------------------------------- bad arguments (issue 16, item 11)
def _no_model_load(monkeypatch):
    """Make loading a model fail loudly: arguments that can be checked without the model must be checked first."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("vtoken.zoo.load", load)


def _unavailable_device() -> str:
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--frames", "0", "--video", "clip.gif"], ["--frames 0", ">= 1"]),
        (["--frames", "-2", "--video", "clip.gif"], ["--frames -2", ">= 1"]),
        (["--dtype", "float17"], ["--dtype 'float17'", "float32", "bfloat16", "float16"]),
        (["--device", "nope"], ["--device 'nope'"]),
        (["--device", _unavailable_device()], [f"--device {_unavailable_device()!r}", "not available"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens 0", ">= 1"]),
        (["--repeats", "0"], ["--repeats 0", ">= 1"]),
        (["--budget", "nan"], ["budget=nan", "(0, 1]"]),
        (["--method", "fastv", "--budget", "0"], ["keep=0"]),
        (["--video", "missing.gif"], ["missing.gif", "no such file"]),
        (["--image", "missing.png"], ["missing.png", "no such file"]),
        (["--image", "scene.png", "--video", "clip.gif"], ["--image", "--video", "not both"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_loading_the_model(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    example_image(64).save("scene.png")
    example_image(64).save("clip.gif")
    _no_model_load(monkeypatch)
    assert main(["run", "--model", "tiny-llava", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vtoken: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


def test_missing_video_blames_the_file_not_pyav(monkeypatch, capsys):
    """Without PyAV installed, a missing file is still reported as missing (not as 'install PyAV')."""
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` fails as when it is not installed
    assert quick_run("--model", "tiny-qwen2-vl", "--video", "/no/such/clip.mp4") == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "PyAV" not in err


def test_hub_id_offline_exits_2_naming_the_model(monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what an offline machine sees at once
    _no_model_load(monkeypatch)
    assert quick_run("--model", "foo/bar") == 2
    err = capsys.readouterr().err
    assert err.startswith("vtoken: error: ") and err.count("\n") == 1
    assert "HF_HUB_OFFLINE is set and 'foo/bar' is not in the local Hugging Face cache" in err
    assert "local checkpoint directory" in err


def test_an_unreachable_hub_fails_at_once_naming_hf_hub_offline(monkeypatch, capsys):
    """A hub id with the hub unreachable (here: a closed local port as the endpoint) fails after one connection
    attempt, before any `from_pretrained` (whose retries take about a minute), saying what to do."""
    import socket

    import transformers

    with socket.socket() as s:  # a port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: calls.append(a))  # fmt: skip
    for argv in (["run", "--model", "foo/bar"], ["demo-load"]):
        if argv[0] == "run":
            assert main(argv) == 2
            err = capsys.readouterr().err
        else:  # the zoo's loader (demo, eval) takes the same path
            from vtoken.zoo import load

            with pytest.raises(vtoken.VTokenError) as caught:
                load("foo/bar")
            err = str(caught.value)
        assert f"cannot reach the Hugging Face Hub at http://127.0.0.1:{port}" in err
        assert "HF_HUB_OFFLINE=1" in err and "local checkpoint directory" in err and "'foo/bar'" in err
    assert calls == []


def test_video_on_a_model_without_video_exits_2(tmp_path, capsys):
    from vtoken.images import example_clip

    clip = example_clip(3)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    assert quick_run("--model", "tiny-llava", "--video", str(path)) == 2
    err = capsys.readouterr().err
    assert "takes no videos" in err and "tiny-llava" in err


# --------------------------------------------------------------------------- parity with `vtoken eval`, light --help
HEAVY = ("torch", "transformers", "lmms_eval", "gradio", "timm")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["eval", "--help"], ["demo", "--help"]])
def test_help_imports_no_heavy_module(argv):
    """`vtoken --help` stays fast because it imports neither torch nor transformers (checked in a fresh
    interpreter, not by timing)."""
    import json
    import subprocess

    code = (
        "import json, sys\n"
        "from vtoken.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "usage: vtoken" in done.stdout and json.loads(lines[-1]) == [], lines[-1]


def test_import_vtoken_is_light_and_names_load_on_use():
    import json
    import subprocess

    code = (
        "import json, sys, vtoken\n"
        "light = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "cls = vtoken.FasterVLM\n"
        "print(json.dumps([light, cls.__module__, 'torch' in sys.modules, 'patch' in dir(vtoken)]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[], "vtoken.methods.fastervlm", True, True]


def test_default_model_is_the_zoos_mini():
    from vtoken.cli import DEFAULT_MODEL
    from vtoken.zoo import MINI

    assert DEFAULT_MODEL == MINI


def test_run_composes_methods_with_eval_syntax(capsys):
    """`--method hired+fastv --param fastv.keep=0.5`, the syntax of `vtoken eval`: both stages applied, with the
    parameters given, and the same records as patching with those objects by hand."""
    from vtoken.zoo import load

    argv = ["--model", "vtoken-mini", "--method", "hired+fastv", "--param", "fastv.keep=0.5", "--param", "alpha=0.3"]
    assert quick_run(*argv) == 0
    out = capsys.readouterr().out
    assert "method:  hired(budget=25%, alpha=0.3) + fastv(layer=2, keep=50%)\n" in out
    model, processor = load("vtoken-mini")
    from vtoken.mini import example
    from vtoken.prompts import build_prompt

    image, question, _ = example()
    inputs = processor(images=[image], text=[build_prompt(processor, question)], return_tensors="pt")
    methods = [vtoken.HiRED(budget=0.25, alpha=0.3), vtoken.FastV(keep=0.5)]
    with torch.inference_mode(), vtoken.patched(model, methods) as handle:
        out_ids = model.generate(**inputs, max_new_tokens=1, do_sample=False)
        stages = [r.stage for r in handle.records]
    answer = processor.batch_decode(out_ids[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()
    assert "encoder" in stages and "prefill.layer2" in stages
    assert f"answer (patched):   {answer!r}" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--method", "hired+fastv", "--param", "fastv.kep=1"], ["--param entry 'fastv.kep'", "layer, keep"]),
        (["--method", "hired+nope"], ["--method 'hired+nope'", "unknown method 'nope'", "fastervlm"]),
        (["--param", "keep"], ["--param 'keep'", "NAME=VALUE"]),
        (["--method", "hired", "--param", "fastv.keep=0.5"], ["'fastv' is not one of the methods in --method 'hired'"]),
        (["--method", "hired+mmtok", "--param", "alpha=0.5"], ["hired and mmtok", "hired.alpha=..."]),
        (["--method", "fastervlm", "--param", "budget=1.5"], ["budget=1.5", "(0, 1]"]),
    ],
)
def test_bad_method_specs_exit_2_naming_the_flag(argv, words, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    assert main(["run", "--model", "tiny-llava", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vtoken: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


def test_param_wins_over_budget():
    from vtoken.cli import method_params

    assert method_params("hired+fastv", 0.5, ["fastv.keep=0.25"]) == {"hired.budget": 0.5, "fastv.keep": 0.25}
    assert method_params("hired+fastv", None, []) == {"hired.budget": 0.25}  # FastV keeps its own keep
    assert method_params("fastervlm", 144, ["budget=0.1"]) == {"budget": 0.1}


def test_unsupported_model_error_is_short_and_lists_families():
    with pytest.raises(vtoken.UnsupportedModelError) as caught:
        vtoken.patch(torch.nn.Linear(2, 2), "random")
    message = str(caught.value)
    assert len(message) < 400 and "llava-1.5" in message and "qwen2-vl" in message and "vtoken list" in message
    assert "ForConditionalGeneration" not in message  # families, not every class


@pytest.mark.parametrize("method", ["fastvid", "holitom"])
def test_the_video_mergers_run_on_a_video_and_images_are_refused(tmp_path, capsys, method):
    """`vtoken run --method fastvid|holitom --video clip.gif` on LLaVA-OneVision: 4 frames x 49 (25 %) + the newline
    for FastVID's onevision form; HoliTom's windows follow the clip. On an image, refused at the call."""
    import re

    from vtoken.images import example_clip

    clip = example_clip(6)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    assert quick_run("--model", "tiny-onevision", "--video", str(path), "--frames", "4", "--method", method) == 0
    out = capsys.readouterr().out
    found = re.search(r"visual tokens \(the LLM's input\): (\d+) -> (\d+) \(", out)
    assert f"method:  {method}(budget=25%)" in out and found and int(found[1]) == 785
    if method == "fastvid":
        assert int(found[2]) == 4 * 49 + 1
    else:
        assert int(found[2]) < 785 // 2
    assert main(["run", "--model", "tiny-onevision", "--method", method, "--max-new-tokens", "1"]) == 2
    assert f"{method} acts on video inputs only" in capsys.readouterr().err


def test_prunevid_and_framefusion_run_on_a_clip(tmp_path, capsys):
    """`vtoken run --method prunevid` on LLaVA-OneVision: its encoder stage alone (`prunevid.layer=none`) and with its
    cut inside the LLM (`prunevid.layer=0`, the deepest a 2-layer LLM allows; the default 10 is refused naming why);
    `--method framefusion` merges inside the LLM (the LLM's input unchanged, the tokens after its call points)."""
    import re

    from vtoken.images import example_clip

    clip = example_clip(6)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    args = ("--model", "tiny-onevision", "--video", str(path), "--frames", "4", "--method", "prunevid")
    assert quick_run(*args, "--param", "prunevid.layer=none") == 0
    found = re.search(r"visual tokens \(the LLM's input\): (\d+) -> (\d+) \(", capsys.readouterr().out)
    assert found and int(found[1]) == 785 and int(found[2]) < 785
    assert quick_run(*args, "--param", "prunevid.layer=0") == 0
    found = re.search(r"-> (\d+) \(.*; after LLM layer 0: (\d+)", capsys.readouterr().out)
    assert found and int(found[2]) < int(found[1])
    assert quick_run(*args) == 2
    assert "layer=10 leaves no later layer" in capsys.readouterr().err
    assert quick_run(*args[:-1], "framefusion") == 0
    out = capsys.readouterr().out
    assert "all 785 kept; at the LLM's input:" in out, out


@pytest.mark.parametrize("model", ["tiny-onevision", "tiny-llava-next"])
def test_a_tower_method_runs_in_the_flat_layout_and_the_native_one_is_refused_before_any_run(model, capsys):
    """`--layout official`: ToMe merges in the tower of a family that takes it only in the flat layout (its kept
    count printed); the model's own layout is refused, naming the layout, before the unpatched answer is made."""
    assert quick_run("--model", model, "--method", "tome", "--param", "tome.r=8", "--layout", "official") == 0
    out = capsys.readouterr().out
    assert "method:  tome(" in out and "[layout=official]" in out
    assert quick_run("--model", model, "--method", "tome") == 2
    captured = capsys.readouterr()
    assert "layout" in captured.err and "answer (unpatched)" not in captured.out


def test_an_unknown_layout_exits_2_naming_the_accepted(capsys):
    with pytest.raises(SystemExit) as exit_:
        quick_run("--layout", "flat")
    assert exit_.value.code == 2 and "native" in capsys.readouterr().err
