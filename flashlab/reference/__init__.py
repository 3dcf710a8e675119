"""The NumPy reference: the ground truth every kernel, notebook and exercise in flashlab is checked against.

- ``softmax``, ``online_softmax``, ``online_attention`` -- one row of scores, whole or a block at a time
  (``online_softmax``).
- ``attention`` -- materialised attention: the whole score matrix, then softmax, then P V (``attention``).
- ``flash_attention`` -- the tiled FlashAttention loop, never holding more than one score tile (``tiled``).
- ``merge_partials`` -- combine results over disjoint key ranges by their log-sum-exps (``merge``).

Shapes are ``(..., N, D)``; k/v may have fewer heads than q (GQA). Masks follow ``flashlab.masking``.
Everything computes in float64; float64 in gives float64 out.
"""

from flashlab.reference.attention import attention
from flashlab.reference.merge import merge_partials
from flashlab.reference.online_softmax import (
    OnlineAttentionStep,
    OnlineSoftmaxStep,
    online_attention,
    online_softmax,
    softmax,
)
from flashlab.reference.tiled import flash_attention

__all__ = [
    "softmax",
    "online_softmax",
    "online_attention",
    "OnlineSoftmaxStep",
    "OnlineAttentionStep",
    "attention",
    "flash_attention",
    "merge_partials",
]
