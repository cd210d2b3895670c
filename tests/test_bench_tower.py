"""benchmarks/bench_tower.py's `--device cuda` towers, built at full depth on the meta device (shapes only): a
configuration that cannot be built fails here, not on a lent GPU."""

import importlib
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_towers_build_at_full_depth_on_meta():
    sys.path.insert(0, str(BENCH))
    try:
        bench = importlib.import_module("bench_tower")
    finally:
        sys.path.remove(str(BENCH))
    depths = {"qwen2.5-vl-7b": 32, "qwen3-vl-8b": 27, "clip-l-336": 24}
    for name, build in bench.gpu_towers().items():
        tower, shape = build(torch.device("meta"), torch.bfloat16)
        blocks = tower.blocks if hasattr(tower, "blocks") else tower.encoder.layers
        assert len(blocks) == depths[name], name
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in tower.parameters())
        assert shape.family in ("qwen2.5-vl", "qwen3-vl", "llava-1.5")
    assert bench.clip_tower(None, "meta", torch.bfloat16)[1].feature_block == 22
