"""The GPU run, checked on a CPU: `make bench-gpu` (benchmarks/run_gpu.py) runs end to end at tiny shapes
(`--device cpu`: every step, the same summary), refuses a machine it cannot run on naming what is missing, and
judges its targets as stated; every model a GPU benchmark builds (`gpu_models()` of each script) is built at full
depth on the meta device (shapes only, no weights allocated), so a configuration that cannot be built (Qwen2.5-VL's
per-layer attention types kept at the tiny model's length) fails here, not on the GPU."""

import importlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GPU_BENCHMARKS = ["bench_methods", "bench_llava", "bench_llm_stages", "bench_sparse_prefill", "bench_families",
                  "bench_qwen3_vl", "bench_tower"]  # fmt: skip


def _module(name):
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _cases():
    return [(script, model) for script in GPU_BENCHMARKS for model in _module(script).gpu_models()]


def _depth(config, name):
    """The configured layers of every stack in `config` that has a count (LLM, tower)."""
    found = {}
    for section in ("text_config", "vision_config"):
        sub = getattr(config, section, None)
        for key in ("num_hidden_layers", "depth"):
            if sub is not None and getattr(sub, key, None) is not None:
                found[section] = getattr(sub, key)
    return found


@pytest.mark.parametrize("script, model", _cases())
def test_every_gpu_configuration_builds_at_full_depth_on_meta(script, model):
    built = _module(script).gpu_models()[model](torch.device("meta"), torch.bfloat16)
    module = built[0] if isinstance(built, tuple) else built
    parameters = list(module.parameters())
    assert parameters and all(p.device.type == "meta" for p in parameters)
    assert all(p.dtype == torch.bfloat16 for p in parameters if p.is_floating_point())
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "text_config"):
        text = config.text_config
        layers = module.model.language_model.layers
        assert len(layers) == text.num_hidden_layers >= 26, _depth(config, model)  # a 7B/8B LLM's full depth
        types = getattr(text, "layer_types", None)
        assert types is None or len(types) == text.num_hidden_layers


def test_make_bench_gpu_is_one_offline_command_running_every_gpu_benchmark():
    """`make bench-gpu` needs nothing but the interpreter it is given (no venv, no install, no download) and runs
    run_gpu.py, whose steps run every GPU benchmark and the CUDA tests, into benchmarks/results."""
    makefile = (ROOT / "Makefile").read_text()
    rule = makefile.split("\nbench-gpu:", 1)[1]
    prerequisites, recipe = rule.split("\n", 1)[0], rule.split("\n\n", 1)[0]
    assert prerequisites.strip() == "", f"bench-gpu depends on {prerequisites.strip()!r}: it must run offline"
    assert "$(PYTHON) benchmarks/run_gpu.py --device cuda --out benchmarks/results" in recipe
    assert "pip" not in recipe and "venv" not in recipe and "$(BIN)" not in recipe
    run_gpu = _module("run_gpu")
    scripts = {Path(step.argv("cuda", False, 3, Path("/out"))[0]).stem for step in run_gpu.STEPS[1:]}
    assert scripts == set(GPU_BENCHMARKS)
    tests = run_gpu.STEPS[0].argv("cuda", False, 3, Path("/out"))
    assert tests[:2] == ["-m", "pytest"] and all((ROOT / "tests" / name).exists() for name in run_gpu.CUDA_TEST_FILES)


def test_the_gpu_run_end_to_end_on_cpu_at_tiny_shapes(tmp_path):
    """The same entry point, `--device cpu`: every step runs (the CUDA tests collected, every benchmark at tiny
    shapes), each result file and the summary are written, and the archive holds them. Run from a folder without
    `vtoken/`, as on the GPU machine (the repository is put on the path here only because a worktree's vtoken is
    not the installed one)."""
    out, archive = tmp_path / "results", tmp_path / "results.tar.gz"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(BENCH / "run_gpu.py"), "--device", "cpu", "--out", str(out),
                           "--archive", str(archive)], capture_output=True, text=True, timeout=1800, cwd=tmp_path,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary_cpu.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["ok"] * len(_module("run_gpu").STEPS), summary["steps"]
    assert summary["smoke"] and summary["environment"]["vtoken_from"] == str(ROOT / "vtoken")
    assert summary["tests"]["failures"] == summary["tests"]["errors"] == 0
    for stem in ("methods", "llava15_batch", "llm_stages", "llm_stages_video", "sparse_prefill", "families",
                 "qwen3_vl"):  # fmt: skip
        assert (out / f"{stem}_cpu.json").exists() and (out / f"{stem}_cpu.md").exists(), stem
    markdown = (out / "summary_cpu.md").read_text()
    for heading in ("## Encoder methods at 25%", "## LLM stages", "## Sparse prefill vs dense", "## Targets"):
        assert heading in markdown
    assert {"fastervlm", "divprune", "random"} <= set(summary["encoder"]["LLaVA-1.5 b1"])
    assert summary["targets"] and summary["sparse_prefill"]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "summary_cpu.md" in names and "methods_cpu.json" in names and "logs/methods_cpu.log" in names


def test_the_gpu_run_refuses_a_machine_it_cannot_run_on(monkeypatch):
    """No CUDA GPU, or a transformers outside vtoken's tested range (the lent machines' own 5.17): one message
    naming each problem and what to do, before any step."""
    import pytest
    import torch
    import transformers

    run_gpu = _module("run_gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(SystemExit) as refused:
        run_gpu.environment("cuda")
    message = str(refused.value)
    assert "torch sees no CUDA GPU" in message
    assert "transformers 5.17.0 is outside vtoken's tested range" in message and "--no-deps" in message


def test_the_summary_judges_each_target_as_stated(tmp_path):
    """Targets from hand-made results: a ratio whose spread reaches the bound passes (within noise), DivPrune has
    its own bound, selection shares and the LLM stages' two bounds, sparse prefill never slower than dense."""
    summary = _module("gpu_summary")

    def row(value, high, share=None):
        return {"speedup": 2.0, "speedup_high": high, "vs_oracle": value, "vs_oracle_high": high,
                "selection_share": share}  # fmt: skip

    def write(stem, payload):
        (tmp_path / f"{stem}_cuda.json").write_text(json.dumps(payload))

    write("llava15_batch", {"ttft": {"batch8": {"unpatched": {}, "oracle@0.25": {},
                                                "fastervlm@0.25": row(0.94, 0.96, 0.01),
                                                "divprune@0.25": row(0.92, 0.935, 0.03)},
                                     "batch32": {"hired@0.25": row(0.90, 0.92, 0.01)}}})  # fmt: skip
    by_batch = {"1": {"fastv": {"speedup": 0.96, "speedup_high": 0.98}},
                "8": {"fastv": {"vs_oracle": 0.85, "vs_oracle_high": 0.88}}}  # fmt: skip
    write("llm_stages", {"results": {"by_batch": by_batch}})
    write("sparse_prefill", {"results": {"end_to_end": {"32768": {"sparse": {"speedup_vs_reference": 0.99,
                                                                             "speedup_high": 1.01}},
                                                        "warmup": {"measured": {}}}}})  # fmt: skip
    checks = {c["check"]: c["met"] for c in summary.targets(tmp_path, "cuda")}
    assert checks == {
        "LLaVA-1.5 batch8 fastervlm@0.25: TTFT vs oracle": True,  # 0.94, spread up to 0.96: within noise
        "LLaVA-1.5 batch8 fastervlm@0.25: selection / TTFT": True,
        "LLaVA-1.5 batch8 divprune@0.25: TTFT vs oracle": True,  # its own bound, 0.93
        "LLaVA-1.5 batch8 divprune@0.25: selection / TTFT": False,  # 3 % > 2 %
        "LLaVA-1.5 batch32 hired@0.25: TTFT vs oracle": False,
        "LLaVA-1.5 batch32 hired@0.25: selection / TTFT": True,
        "LLM stage fastv b1: TTFT vs unpatched": True,
        "LLM stage fastv b8: TTFT vs equal-average oracle": False,
        "sparse prefill 32768 tokens, sparse: TTFT vs dense": True,
    }
    table = summary.write_summary(tmp_path, "cuda", {"gpu": "NVIDIA H100 80GB HBM3"}, [])["markdown"]
    assert table.startswith("# vtoken on NVIDIA H100 80GB HBM3") and "| FAIL |" in table and "| pass |" in table
