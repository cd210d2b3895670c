"""Methods, one file each; importing this package registers them."""

from .base import EncoderMethod, Method, PrefillMethod, ScoreMethod
from .cdpruner import CDPruner
from .dart import DART
from .divprune import DivPrune
from .dycoke import DyCoke
from .fastervlm import FasterVLM
from .fastv import FastV
from .fastvid import FastVID
from .fourier import FourierDCT
from .hiprune import HiPrune
from .hired import HiRED
from .holitom import HoliTom
from .holov import HoloV
from .mmtok import MMTok
from .mustdrop import MustDrop
from .pool import Pool
from .pyramiddrop import PyramidDrop
from .random import Random
from .scope import SCOPE
from .sparse_prefill import SparsePrefill
from .sparsevlm import SparseVLM
from .vidcom2 import VidCom2
from .visionzip import VisionZip
from .vispruner import VisPruner

__all__ = [
    "Method",
    "EncoderMethod",
    "PrefillMethod",
    "ScoreMethod",
    "DART",
    "DyCoke",
    "FasterVLM",
    "FastV",
    "FourierDCT",
    "HiRED",
    "MMTok",
    "MustDrop",
    "Pool",
    "PyramidDrop",
    "Random",
    "SparsePrefill",
    "SparseVLM",
    "VisionZip",
    "VisPruner",
    "DivPrune",
    "VidCom2",
    "FastVID",
    "HoliTom",
    "CDPruner",
    "HoloV",
    "HiPrune",
    "SCOPE",
]
