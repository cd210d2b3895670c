"""Third-party methods for tests/test_plugins.py, written with vtoken's public API only, as a paper's author would.

`NormPrune` is defined here and registered at run time (`register`); `DISTRIBUTION` is the source of a tiny
installed package whose entry point (group `vtoken.methods`) brings `plugin_cls`, built into a folder by
`build_distribution` (a dist-info with entry_points.txt on sys.path is what pip would leave: no network, no pip).
No pytest here: the vLLM driver imports this module in the vllm venv (`register`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import vtoken
from vtoken.params import Real


@dataclass
class NormPrune(vtoken.ScoreMethod):
    """Keep each crop's tokens with the largest feature p-norm."""

    power: float = 2.0

    name = "plugin_norm"
    requires = ("vision_features",)
    params = {"power": Real("(0, inf)", hint="the norm's order")}
    layouts = ("native", "official")

    def score(self, tokens: vtoken.VisualTokens) -> torch.Tensor:
        return tokens.signals["vision_features"].float().norm(p=self.power, dim=-1)


def register() -> None:
    """Register `NormPrune` (what a user's script does before `vtoken.patch` or `LLM(...)`)."""
    vtoken.register_method(NormPrune)


PACKAGE = "vtoken_plugin_demo"
ENTRY_POINT = "plugin_cls"
# the installed package's module: a [CLS]-attention method mixed with the feature norm (needs [CLS])
DISTRIBUTION = '''
"""A third-party vtoken method, installed as a package."""

from dataclasses import dataclass

import vtoken
from vtoken.params import Real


@dataclass
class ClsKeep(vtoken.ScoreMethod):
    """Keep each crop's tokens by [CLS] attention, plus `mix` times their normalised feature norm."""

    mix: float = 0.0

    name = "plugin_cls"
    requires = ("cls_attention", "vision_features")
    params = {"mix": Real("[0, 1]", hint="the feature norm's weight")}

    def score(self, tokens):
        cls = tokens.signals["cls_attention"].float()
        norm = tokens.signals["vision_features"].float().norm(dim=-1)
        return cls + self.mix * norm / norm.amax(dim=-1, keepdim=True)
'''


def build_distribution(folder: Path, name: str = ENTRY_POINT, target: str = "ClsKeep",
                       package: str = PACKAGE) -> Path:  # fmt: skip
    """A folder holding `package` (its `prune` module) and its dist-info with the entry point
    `name = package.prune:target` in the group `vtoken.methods`; put it on sys.path (or PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / package).mkdir(exist_ok=True)
    (folder / package / "__init__.py").write_text("")
    (folder / package / "prune.py").write_text(DISTRIBUTION)
    info = folder / f"{package}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vtoken.methods]\n{name} = {package}.prune:{target}\n")
    return folder
