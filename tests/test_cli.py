import pytest
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
    assert "time to first token: unpatched" in out and "answer (patched)" in out


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


def test_budget_reaches_each_methods_own_knob():
    from vtoken import Record
    from vtoken.cli import llm_tokens, method_params

    assert method_params("fastervlm", 0.25) == {"budget": 0.25}
    assert method_params("fastv", 0.5) == {"keep": 0.5}
    assert method_params("mustdrop", 0.5) == {}  # its thresholds are the knob
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
