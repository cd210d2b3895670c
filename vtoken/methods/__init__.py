"""Methods, one file each; importing this package registers them."""

from .base import Method, ScoreMethod
from .fastervlm import FasterVLM
from .fourier import FourierDCT
from .hired import HiRED
from .mmtok import MMTok
from .pool import Pool
from .random import Random

__all__ = ["Method", "ScoreMethod", "FasterVLM", "FourierDCT", "HiRED", "MMTok", "Pool", "Random"]
