"""Kernels, each beside a PyTorch reference with the same signature; dispatch picks Triton on CUDA.

The greedy selections (DivPrune, MMTok, SCOPE, VisPruner) and PixelPrune's anchored predictor are PyTorch custom
ops in the `vtoken` namespace (`torch.ops.vtoken.*`): the reference is their CPU implementation, the Triton kernels
their CUDA one.
"""

from .attention_columns import (
    attention_column_mean,
    attention_column_mean_reference,
    attention_column_mean_triton,
)
from .attention_rows import (
    attention_row_probs,
    attention_row_probs_reference,
    attention_row_probs_triton,
    causal_rows_probs,
    causal_rows_probs_reference,
    causal_rows_probs_triton,
)
from .block_sparse_attention import (
    block_mask_from_plan,
    block_sparse_attention,
    block_sparse_attention_reference,
    block_sparse_attention_triton,
)
from .coverage import (
    greedy_max_coverage,
    greedy_max_coverage_reference,
    greedy_max_coverage_triton,
    greedy_weighted_coverage,
    greedy_weighted_coverage_reference,
    greedy_weighted_coverage_triton,
)
from .diversity import max_min_diversity, max_min_diversity_reference, max_min_diversity_triton
from .dpp import dpp_greedy, dpp_greedy_reference, dpp_greedy_triton
from .duplicates import duplicate_removal, duplicate_removal_reference, duplicate_removal_triton
from .gram import gram_reference, gram_triton
from .greedy_picks import greedy_least_similar, greedy_least_similar_reference, greedy_least_similar_triton
from .pixel_prediction import anchored_prediction, anchored_prediction_reference, anchored_prediction_triton
from .segment_gaps import fill_gaps, fill_gaps_reference, fill_gaps_triton
from .static_windows import static_windows, static_windows_reference, static_windows_triton
from .visual_attention import (
    rotary_visual_attention,
    rotary_visual_attention_reference,
    rotary_visual_attention_triton,
    visual_attention,
    visual_attention_reference,
    visual_attention_triton,
)

__all__ = [
    "attention_column_mean",
    "attention_column_mean_reference",
    "attention_column_mean_triton",
    "static_windows",
    "fill_gaps",
    "fill_gaps_reference",
    "fill_gaps_triton",
    "static_windows_reference",
    "static_windows_triton",
    "block_mask_from_plan",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "block_sparse_attention_triton",
    "attention_row_probs",
    "attention_row_probs_reference",
    "attention_row_probs_triton",
    "causal_rows_probs",
    "causal_rows_probs_reference",
    "causal_rows_probs_triton",
    "dpp_greedy",
    "dpp_greedy_reference",
    "dpp_greedy_triton",
    "duplicate_removal",
    "duplicate_removal_reference",
    "duplicate_removal_triton",
    "gram_reference",
    "gram_triton",
    "greedy_max_coverage",
    "greedy_max_coverage_reference",
    "greedy_max_coverage_triton",
    "greedy_weighted_coverage",
    "greedy_weighted_coverage_reference",
    "greedy_weighted_coverage_triton",
    "max_min_diversity",
    "max_min_diversity_reference",
    "max_min_diversity_triton",
    "greedy_least_similar",
    "greedy_least_similar_reference",
    "greedy_least_similar_triton",
    "anchored_prediction",
    "anchored_prediction_reference",
    "anchored_prediction_triton",
    "visual_attention",
    "visual_attention_reference",
    "visual_attention_triton",
    "rotary_visual_attention",
    "rotary_visual_attention_reference",
    "rotary_visual_attention_triton",
]
