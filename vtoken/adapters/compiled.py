"""A patched model under `torch.compile`: vtoken's hooks run eagerly.

Every hook vtoken installs (the model's pre/post-forward hooks, the LLM stages' layer hooks and probes, the sparse
attention function, Qwen3-VL's DeepStack wrapper) is marked `eager`: dynamo graph-breaks around it and runs it as
plain Python, as in an uncompiled call. Their bookkeeping is data-dependent (token counts, per-call state, hooks
registered while the vision tower runs), which tracing would not keep; the model's own modules in between still
compile. So `torch.compile` after `patch` gives the uncompiled patched model's results. (`patch` refuses
torch.compile's wrapper itself: see `vtoken.api`.)
"""

from __future__ import annotations

import torch

eager = torch.compiler.disable
