import sys

import pytest
import torch
from conftest import OTHER_TINY_MODELS

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
    assert "visual tokens: 576 -> 144 (25.0% kept)" in out
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
    assert "vtoken-mini" in out and question in out and "visual tokens: 144 -> 36 (25.0% kept)" in out
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
    assert quick_run("--model", model, "--method", "random", "--budget", "0.25") == 0
    assert "25.0% kept" in capsys.readouterr().out


@pytest.mark.parametrize(
    "model, expected",
    [
        ("tiny-qwen2-vl", "128 -> 32"),
        ("tiny-onevision", "784 -> 196"),
        ("tiny-llava-next-video", "576 -> 144"),
        ("tiny-video-llava", "1024 -> 256"),
        ("tiny-internvl", "1024 -> 256"),
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
    assert "clip.gif" in out and f"{expected} (25.0% kept)" in out


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
    from vtoken import Record
    from vtoken.cli import method_params
    from vtoken.records import llm_tokens

    assert method_params("fastervlm", 0.25) == {"budget": 0.25}
    assert method_params("fastv", 0.5) == {"keep": 0.5}
    assert method_params("mustdrop", 0.5) == {}  # its thresholds are the knob
    assert method_params("hired", None) == {"budget": 0.25} == method_params("fastervlm", None)  # one default
    assert method_params("fastv", None) == {}  # FastV keeps its own `keep`
    records = [
        Record("encoder.merge", "mustdrop", 0, 0, 576, 400, None, (24, 24), None),
        Record("encoder.keyset", "mustdrop", 0, 0, 400, 32, None, (1, 400), None),
        Record("prefill.layer2", "mustdrop", 0, 0, 400, 250, None, (1, 400), None),
        Record("decode.kv", "mustdrop", 0, 0, 2000, 1000, None, (1, 0), None),
    ]
    assert llm_tokens(records) == (576, 250)


def test_a_prefill_method_too_deep_for_the_model_exits_2(capsys):
    assert quick_run("--model", "tiny-llava", "--method", "fastv") == 2
    assert "layer=2 leaves no later layer" in capsys.readouterr().err


# --------------------------------------------------------------------------- bad arguments (issue 16, item 11)
def _no_model_load(monkeypatch):
    """Make loading a model fail loudly: arguments that can be checked without the model must be checked first."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("vtoken.cli.load", load)


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

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what an offline machine sees at once
    assert quick_run("--model", "foo/bar") == 2
    err = capsys.readouterr().err
    assert err.startswith("vtoken: error: ") and "cannot load model 'foo/bar'" in err and err.count("\n") == 1


def test_video_on_a_model_without_video_exits_2(tmp_path, capsys):
    from vtoken.images import example_clip

    clip = example_clip(3)
    path = tmp_path / "clip.gif"
    clip[0].save(path, save_all=True, append_images=clip[1:], duration=100, loop=0)
    assert quick_run("--model", "tiny-llava", "--video", str(path)) == 2
    err = capsys.readouterr().err
    assert "takes no videos" in err and "tiny-llava" in err
