"""The NumPy reference: the ground truth every kernel, notebook and exercise in flashlab is checked against.

- ``softmax``, ``online_softmax``, ``online_attention`` -- one row of scores, whole or a block at a time
  (``online_softmax``).
- ``attention`` -- materialised attention: the whole score matrix, then softmax, then P V (``attention``).
- ``tiled_attention`` -- the tiled FlashAttention loop, never holding more than one score tile (``tiled``).
- ``merge_partials`` -- combine results over disjoint key ranges by their log-sum-exps (``merge``).
- ``attention_backward``, ``tiled_attention_backward``, ``backward_delta`` -- the gradients dQ, dK, dV: built
  from the whole P, dP and dS, and FlashAttention-2's tiled backward that recomputes P tile by tile from the saved
  log-sum-exp (``backward``).

Shapes are ``(..., N, D)``; k/v may have fewer heads than q (GQA). Masks follow ``flashlab.core.masking``.
``flashlab.reference.torch_float64.attention_float64`` is the same materialised attention in float64 torch, on
the inputs' own device, for GPU-sized checks (imported on demand: it needs torch).
Everything computes in float64; float64 in gives float64 out.
"""

from flashlab.reference.attention import attention
from flashlab.reference.backward import attention_backward, backward_delta, tiled_attention_backward
from flashlab.reference.merge import merge_partials
from flashlab.reference.online_softmax import (
    OnlineAttentionStep,
    OnlineSoftmaxStep,
    online_attention,
    online_softmax,
    softmax,
)
from flashlab.reference.tiled import tiled_attention

__all__ = [
    "softmax",
    "online_softmax",
    "online_attention",
    "OnlineSoftmaxStep",
    "OnlineAttentionStep",
    "attention",
    "tiled_attention",
    "merge_partials",
    "attention_backward",
    "tiled_attention_backward",
    "backward_delta",
]
