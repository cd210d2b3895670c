"""Each model family's token geometry, in one place: pure functions of sizes and shapes, no model access.

The transformers adapters (`vtoken.adapters`) and the vLLM plugin (`vtoken.serving.vllm`) both build on them, so a
family's crop grids, counts per crop, packings, newline tokens and positions are written once:

- `anyres`: LLaVA-NeXT (and LLaVA-NeXT-Video's images) and LLaVA-OneVision: crop grids, the window that survives
  unpadding, valid tokens per crop, placeholder counts, and the native and official packings of kept tokens;
- `llava`: LLaVA-1.5: the token grid, the pad-to-square border, the encoder layer a feature layer reads;
- `qwen`: Qwen2-VL / Qwen2.5-VL / Qwen3-VL: token grids of `grid_thw`, counts per item, kept offsets in a run;
- `tables`: small integer tables on the device from host integers (one non-blocking copy from pinned memory, or
  views of one `arange` concatenated), so that per-crop and per-image constants reach the GPU without a sync.

Counts are host integers computed from sizes (known before the encoder runs); index tensors for the device are
built from Python scalars, a fixed handful of kernels however many crops or images a call has.
"""
