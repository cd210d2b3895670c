"""Methods, one file each; importing this package registers them."""

from .base import EncoderMethod, Method, PrefillMethod, ScoreMethod
from .fastervlm import FasterVLM
from .fastv import FastV
from .fourier import FourierDCT
from .hired import HiRED
from .mmtok import MMTok
from .mustdrop import MustDrop
from .pool import Pool
from .random import Random
from .sparse_prefill import SparsePrefill

__all__ = [
    "Method",
    "EncoderMethod",
    "PrefillMethod",
    "ScoreMethod",
    "FasterVLM",
    "FastV",
    "FourierDCT",
    "HiRED",
    "MMTok",
    "MustDrop",
    "Pool",
    "Random",
    "SparsePrefill",
]
