"""The `--device cuda` benchmark paths, checked on a CPU: every model a GPU benchmark builds (`gpu_models()` of each
script) is built at full depth on the meta device (shapes only, no weights allocated), so a configuration that
cannot be built (Qwen2.5-VL's per-layer attention types kept at the tiny model's length) fails here, not on the
GPU. `make bench-gpu` runs every one of them."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GPU_BENCHMARKS = ["bench_methods", "bench_llava", "bench_llm_stages", "bench_sparse_prefill", "bench_families",
                  "bench_qwen3_vl"]  # fmt: skip


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


def test_make_bench_gpu_runs_every_gpu_benchmark_on_cuda_into_the_results_folder():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nbench-gpu:", 1)[1].split("\n\n", 1)[0]
    ran = re.findall(r"benchmarks/(bench_\w+)\.py", recipe)
    assert set(ran) == set(GPU_BENCHMARKS)
    assert "--device cuda" in makefile and "--out benchmarks/results" in makefile
