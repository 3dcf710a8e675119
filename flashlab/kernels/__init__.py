"""The Triton kernels: device code, and one plain launch per kernel a learner can read.

- ``ladder`` -- the forward kernel as rungs a learner can run and time, slowest first: ``rung1_lesson_loop``
  (every key tile loaded and masked, as the lesson writes the loop), ``rung2_skip_split`` (only the key tiles the
  mask leaves visible, the tiles every row sees without a mask), ``rung3_hopper`` (whole tiles copied by the
  tensor-memory accelerator), ``rung4_overlap`` (one warpgroup's softmax under the other's products), and the
  overlap rung's ``tile_schedule``.
- ``decode`` -- ``split_kv`` (Flash-Decoding: key chunks in parallel, merged by their log-sum-exps) and
  ``kvcache`` (the same against a serving engine's paged KV cache).
- ``varlen`` -- the skip-and-split forward and the two-pass backward over a batch of sequences of different
  lengths packed without padding (each program reads its sequence's bounds from ``cu_seqlens``), and ``hopper``
  beside them: the same with tiles by the tensor-memory accelerator, for head dim 128 on Hopper.
- ``backward`` -- the backward's ladder: ``rung1_two_pass`` (the FlashAttention-2 backward kernels) and
  ``rung2_hopper`` (the same loops fed by the tensor-memory accelerator, warp-specialised).
- ``softmax_step`` -- the ``@triton.jit`` steps they share: the band's element mask, one online-softmax step, the
  chunks' merge.
- ``device`` -- what the kernels accept and ask of the device; ``interpreter`` -- Triton's interpreter for CPU
  tensors.

Each is checked against ``flashlab.reference``. The entry points, the checks, the plans and the direct launches
are the host engine's (``flashlab.host``), which imports this package; nothing here imports it.
"""
