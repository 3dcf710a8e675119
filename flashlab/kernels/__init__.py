"""The Triton kernels, each checked against ``flashlab.reference``.

- ``runtime`` -- what the kernels share on the host: accepted inputs, shared-memory fit, the CPU interpreter.
- ``softmax_step`` -- the device functions they share: the band's element mask and one online-softmax step.
- ``ladder`` -- the forward kernel as rungs a learner can run and time, slowest first: ``lesson_loop`` (every key
  tile loaded and masked, as the lesson writes the loop), ``skip_split`` (only the key tiles the mask leaves
  visible, the tiles every row sees without a mask; the default prefill kernel).
- ``forward`` -- ``flash_attention``, the entry point: checks, a plan per call signature, the launch.
- ``split_kv`` -- the decode path (Flash-Decoding): key chunks in parallel, merged by their log-sum-exps.
- ``kvcache`` -- the same path against a serving engine's KV cache: ragged lengths, paged blocks, a block table.
- ``op`` -- both registered as PyTorch custom operators, so ``torch.compile(fullgraph=True)`` traces them.
"""

from flashlab.kernels import op  # noqa: F401  (registers the operators that torch.compile traces)
from flashlab.kernels.forward import flash_attention
from flashlab.kernels.kvcache import flash_attention_with_kvcache

__all__ = ["flash_attention", "flash_attention_with_kvcache"]
