"""Context parallelism: one attention call over a sequence split across processes (GPUs), by ring or all-gather.

Each rank of a ``torch.distributed`` process group holds a slice of the sequence: its queries, keys and values
``(B, H, N / world, D)`` in flashlab's layout. Every query still has to see every key the mask allows, so the keys
must reach it. Two ways:

- ``ring_attention``: the K/V slices travel around the ring of ranks (rank r sends to r + 1 and receives from
  r - 1, ``dist.batch_isend_irecv``: NCCL on GPUs, gloo on CPUs). While the next slice is in flight, each rank
  runs ``flashlab.flash_attention`` on the slice it has and folds the result into its running output with the
  log-sum-exp merge of split-KV decoding (``flashlab.reference.merge_partials``). After ``world`` steps every
  query has seen every key, and no rank ever held more than two K/V slices. The backward pass recomputes (nothing
  of size N^2 is kept): K/V travel the ring again, each rank runs the backward kernel against the slice it holds
  with the *global* output and log-sum-exp, and the dK/dV partial sums ride along with their slice until they are
  back home.
- ``all_gather_attention``: every rank gathers all of K and V, then runs one ``flash_attention`` call per local
  query chunk (Megatron-Core's and Llama 3's context parallelism). More memory (the whole K/V on every rank), no
  overlap, simple.

Which positions a rank holds is its layout (``LAYOUTS``). Under a causal mask, the contiguous split gives the last
rank N/world queries that see everything and the first rank queries that see almost nothing: it waits for the
others. ``"head_tail"`` cuts the sequence into 2 * world chunks and gives rank r chunks r and 2 * world - 1 - r
(one early, one late), so every rank does the same work. ``shard_sequence`` and ``unshard_sequence`` convert a
whole sequence to a rank's slice and back.

Masks are exact in global positions. flashlab's kernels align a mask to the bottom-right corner of the score
matrix (``flashlab.core.masking``), so each (query chunk, key chunk) pair is cut down to the rows that see some key
and the keys some row sees (``block_call``); the global band then lands on the pair's bottom-right corner as a
causal mask or a window the kernel takes. Pairs the mask hides entirely are skipped: no kernel call.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from flashlab import flash_attention
from flashlab.core.masking import visible_band
from flashlab.kernels.backward.rung1_two_pass import attention_backward

LAYOUTS = ("head_tail", "contiguous")
INF = float("inf")

# ----------------------------------------------------------------------------------------------------------------
# Which positions each rank holds
# ----------------------------------------------------------------------------------------------------------------


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}; got {layout!r}")
    return layout


def chunks_per_rank(layout) -> int:
    """Equal chunks each rank holds: 2 for head-tail (one early, one late), 1 for contiguous."""
    return 2 if check_layout(layout) == "head_tail" else 1


def rank_chunks(n: int, world: int, rank: int, layout: str = "head_tail") -> list[tuple[int, int]]:
    """The global positions ``[start, stop)`` rank ``rank`` holds, in its local order.

    contiguous: ``[(r c, (r + 1) c)]`` with c = n / world. head_tail: chunks r and 2 world - 1 - r of size
    c = n / (2 world), concatenated in that order. A length that does not split evenly is a ValueError."""
    parts = world * chunks_per_rank(layout)
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world) with world >= 1; got rank {rank!r}, world {world!r}")
    if n < parts or n % parts:
        raise ValueError(
            f"a sequence of {n} positions does not split evenly for layout {layout!r} over {world} ranks: "
            f"its length must be a multiple of {parts} (pad the sequence)"
        )
    c = n // parts
    if layout == "contiguous":
        return [(rank * c, (rank + 1) * c)]
    tail = 2 * world - 1 - rank
    return [(rank * c, (rank + 1) * c), (tail * c, (tail + 1) * c)]


def shard_sequence(x, world: int, rank: int, layout: str = "head_tail", dim: int = 2):
    """Rank ``rank``'s slice of the whole sequence ``x`` (positions along ``dim``), in its local order."""
    n = x.shape[dim]
    return torch.cat([x.narrow(dim, a, b - a) for a, b in rank_chunks(n, world, rank, layout)], dim=dim)


def unshard_sequence(shards, layout: str = "head_tail", dim: int = 2):
    """The whole sequence from every rank's slice (``shards[r]`` is rank r's), the inverse of ``shard_sequence``."""
    world = len(shards)
    if world == 0:
        raise ValueError("unshard_sequence needs one slice per rank; got none")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1:
        raise ValueError(f"every rank's slice must have the same length along dim {dim}; got {sorted(lengths)}")
    n = lengths.pop() * world
    pieces = []
    for rank, shard in enumerate(shards):
        local = 0
        for a, b in rank_chunks(n, world, rank, layout):
            pieces.append((a, shard.narrow(dim, local, b - a)))
            local += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)


# ----------------------------------------------------------------------------------------------------------------
# One (query chunk, key chunk) pair as a bottom-right-aligned kernel call
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockCall:
    """What to run for one pair of chunks: query rows ``[q0, q1)`` and keys ``[k0, k1)`` (counted from each
    chunk's start) with ``causal`` and ``window`` in the kernel's bottom-right convention."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: tuple | None


def global_band(n: int, causal: bool, window) -> tuple[float, float]:
    """``(left, right)``: in the whole n x n sequence, query i sees keys ``[i - left, i + right]`` (inf: no
    bound). The full score matrix is square, so its bottom-right diagonal is the main one."""
    _, left, right = visible_band(n, n, causal, window)
    return left, right


def block_call(q_chunk, k_chunk, band) -> BlockCall | None:
    """The kernel call for queries at global positions ``q_chunk = (qs, qe)`` against keys ``k_chunk = (ks, ke)``
    under the global ``band = (left, right)``; None when the mask hides the whole pair (no call).

    The kernel puts the diagonal on the bottom-right corner: its last query row meets its last key. The pair is cut
    to the rows that see some key, ``[max(qs, ks - right), min(qe, ke + left))``, and the keys those rows see, ``[
    max(ks, qa - left), min(ke, qb + right))``. The corners then differ by s = qb - kb positions, and the global
    band, seen from the bottom-right corner, is the window ``(left - s, right + s)``. Cutting that tightly keeps
    both sides >= 0 for every pair, so flashlab's kernels express every band exactly; a side that cannot bind
    inside the pair is dropped, and a right side of 0 is the causal mask.
    """
    (qs, qe), (ks, ke) = q_chunk, k_chunk
    left, right = band
    qa, qb = max(qs, ks - right), min(qe, ke + left)  # rows that see at least one key of the chunk
    if qa >= qb:
        return None
    ka, kb = max(ks, qa - left), min(ke, qb + right)  # keys at least one of those rows sees
    if ka >= kb:
        return None
    qa, qb, ka, kb = int(qa), int(qb), int(ka), int(kb)
    shift = qb - kb
    left_b, right_b = left - shift, right + shift
    if left_b < 0 or right_b < 0:
        raise NotImplementedError(
            f"queries [{qa}, {qb}) against keys [{ka}, {kb}) under the band (left {left}, right {right}) need a "
            f"window ({left_b}, {right_b}) from the bottom-right corner, which flashlab's kernels cannot take"
        )
    nq, nk = qb - qa, kb - ka
    if right_b >= nq - 1:  # row 0 already reaches the last key
        right_b = INF
    if left_b >= nk - 1:  # the last row already reaches the first key
        left_b = INF
    causal = right_b == 0
    if left_b == INF and (causal or right_b == INF):
        window = None
    else:
        window = (None if left_b == INF else int(left_b), None if right_b == INF or causal else int(right_b))
    return BlockCall(qa - qs, qb - qs, ka - ks, kb - ks, causal, window)


def _sees_all(call, q_chunk, k_chunk) -> bool:
    """Every query of the chunk sees every key of the other: the pair needs no mask."""
    return (call is not None and not call.causal and call.window is None and call.q1 - call.q0 == q_chunk[1] -
            q_chunk[0] and call.k1 - call.k0 == k_chunk[1] - k_chunk[0])  # fmt: skip


def chunk_pairs(q_chunks, k_chunks, band):
    """``(rows, keys, call)`` for each pair of a rank's query chunks and a slice's key chunks that the mask does
    not hide: ``rows`` and ``keys`` are slices into the local query tensor and the K/V slice.

    A key chunk that every local query sees whole is one call for all the local rows, and a query chunk that sees
    every key of the slice whole is one call for the whole slice: under head-tail's causal mask that halves the
    calls of every step but the diagonal one (fewer, larger launches)."""
    calls = [[block_call(qc, kc, band) for kc in k_chunks] for qc in q_chunks]
    q_start = [sum(b - a for a, b in q_chunks[:i]) for i in range(len(q_chunks))]  # each chunk's first local row
    k_start = [sum(b - a for a, b in k_chunks[:j]) for j in range(len(k_chunks))]
    n_q, n_k = sum(b - a for a, b in q_chunks), sum(b - a for a, b in k_chunks)
    whole = BlockCall(0, 0, 0, 0, False, None)
    full = [[_sees_all(calls[i][j], q_chunks[i], k_chunks[j]) for j in range(len(k_chunks))] for i in
            range(len(q_chunks))]  # fmt: skip
    if all(all(row) for row in full):
        return [(slice(0, n_q), slice(0, n_k), whole)]
    pairs = []
    for i, row in enumerate(full):
        if all(row) and len(k_chunks) > 1:  # this query chunk sees the whole slice
            pairs.append((slice(q_start[i], q_start[i] + q_chunks[i][1] - q_chunks[i][0]), slice(0, n_k), whole))
            calls[i] = [None] * len(k_chunks)
    for j in range(len(k_chunks)):
        if len(q_chunks) > 1 and all(full[i][j] and calls[i][j] is not None for i in range(len(q_chunks))):
            pairs.append((slice(0, n_q), slice(k_start[j], k_start[j] + k_chunks[j][1] - k_chunks[j][0]), whole))
            for i in range(len(q_chunks)):
                calls[i][j] = None
    for i, j in itertools.product(range(len(q_chunks)), range(len(k_chunks))):
        call = calls[i][j]
        if call is not None:
            rows = slice(q_start[i] + call.q0, q_start[i] + call.q1)
            keys = slice(k_start[j] + call.k0, k_start[j] + call.k1)
            pairs.append((rows, keys, call))
    return pairs


# ----------------------------------------------------------------------------------------------------------------
# Checks: every rank must call with the same kind of inputs
# ----------------------------------------------------------------------------------------------------------------

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_FIELDS = 16  # entries of a rank's signature: a flag, q/k/v shapes, dtype, causal, window, scale, layout


def _local_problem(q, k, v, causal, window, scale, layout):
    """The exception this rank's own inputs raise, or None."""
    try:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
            if x.ndim != 4:
                raise ValueError(f"{name} must be (B, H, N_local, D); got shape {tuple(x.shape)}")
        if not (q.shape[2] == k.shape[2] == v.shape[2]):
            raise ValueError(
                f"q, k and v must hold the same positions of the sequence; got local lengths {q.shape[2]}, "
                f"{k.shape[2]} and {v.shape[2]}"
            )
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False; got {causal!r}")
        visible_band(2, 2, causal, window)  # a malformed window is a ValueError naming it
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"scale must be a number or None; got {type(scale).__name__}")
        layout = check_layout(layout)
        if q.shape[2] % chunks_per_rank(layout):
            raise ValueError(
                f"layout 'head_tail' holds two equal chunks per rank, so the local length must be even; got "
                f"{q.shape[2]} (pad the sequence to a multiple of 2 * world)"
            )
    except (TypeError, ValueError) as err:
        return err
    return None


def _signature(q, k, v, causal, window, scale, layout, problem) -> list[int]:
    if problem is not None:
        return [1] + [0] * (_FIELDS - 1)
    sides = [-1 if w is None else int(w) for w in (window or (None, None))]
    scale_bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    return [0, *q.shape, *k.shape[1:2], *v.shape[1:2], k.shape[3], v.shape[3], _DTYPE_CODES.get(q.dtype, 0),
            int(k.dtype == q.dtype == v.dtype), int(causal), *sides, scale_bits, LAYOUTS.index(layout)]  # fmt: skip


def check_group(group):
    """``(world, rank)`` of ``group`` (None: the default group); a clear error when torch.distributed is not
    running."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context parallelism needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment it reads)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def check_inputs(q, k, v, causal, window, scale, group, layout, who: str):
    """Check the inputs on every rank at once: one small all-gather of each rank's signature (shapes, dtype, mask,
    scale, layout), so that a bad input on one rank is an error on all of them instead of a hang. Returns
    ``(world, rank)``."""
    world, rank = check_group(group)
    problem = _local_problem(q, k, v, causal, window, scale, layout)
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mine = torch.tensor(_signature(q, k, v, causal, window, scale, layout, problem), dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if problem is not None:
        raise type(problem)(f"{who}: {problem}")
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"{who}: the inputs of rank(s) {bad} are invalid (see the error there)")
    if any(row != rows[0] for row in rows):
        shapes = {r: (tuple(row[1:5]), row[5], row[6]) for r, row in enumerate(rows)}
        lengths = sorted({row[3] for row in rows})
        if len(lengths) > 1:
            raise ValueError(
                f"{who}: uneven sequence slices, local lengths {lengths} across ranks; every rank must hold "
                f"N / world positions (pad the sequence to a multiple of {world * chunks_per_rank(layout)})"
            )
        raise ValueError(
            f"{who}: every rank must call with the same shapes, dtype, causal, window, scale and layout; got (q "
            f"shape, K heads, V heads) by rank {shapes} and the full signatures {rows}"
        )
    return world, rank  # what only the kernel checks (dtype, head dim) fails the same way on every rank


# ----------------------------------------------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------------------------------------------


def merge_pair(o_a, lse_a, o_b, lse_b):
    """``merge_partials`` for two partial results in torch (float32): ``o (..., N, D)``, ``lse (..., N)``.

    Each part is weighted by its share of the total sum, ``exp(lse_c - lse)``; a part with lse = -inf adds
    nothing, and a row that saw no key in either comes out as zeros with lse = -inf."""
    m = torch.maximum(lse_a, lse_b)  # (..., N)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)  # (..., N) each part's share, up to a factor
    total = w_a + w_b
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, -INF))
    return o, lse


class Ring:
    """The two neighbours of a rank on the ring, and the messages it has posted to them."""

    def __init__(self, group, world, rank):
        self.group = group
        self.send_to = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.recv_from = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def pass_on(self, tensors):
        """Post sends of ``tensors`` to the next rank and receives of as many like them from the previous one.
        Returns ``(received, works)``: the receive buffers are valid after every work is waited on."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.recv_from, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops)


def wait(works):
    for w in works:
        w.wait()


def ring_forward(q, k, v, causal, window, scale, group, layout, world, rank):
    """``(o, lse)`` for this rank's queries: o like q, lse float32 ``(B, Hq, N_local)``."""
    n = q.shape[2] * world
    band = global_band(n, causal, window)
    q_chunks = rank_chunks(n, world, rank, layout)
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, Hq, N_local, D) the running output
    lse = torch.full(q.shape[:3], -INF, dtype=torch.float32, device=q.device)  # (B, Hq, N_local)
    ring = Ring(group, world, rank) if world > 1 else None
    kv = [k.contiguous(), v.contiguous()]
    for step in range(world):
        source = (rank - step) % world  # whose K/V slice this rank holds at this step
        if step < world - 1:
            incoming, works = ring.pass_on(kv)  # the next slice travels while this one is computed on
        k_now, v_now = kv
        for rows, keys, call in chunk_pairs(q_chunks, rank_chunks(n, world, source, layout), band):
            o_part, lse_part = flash_attention(
                q[:, :, rows], k_now[:, :, keys], v_now[:, :, keys], call.causal, call.window, scale, return_lse=True
            )
            o[:, :, rows], lse[:, :, rows] = merge_pair(o[:, :, rows], lse[:, :, rows], o_part.float(), lse_part)
        if step < world - 1:
            wait(works)
            kv = incoming
    return o.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, causal, window, scale, group, layout, world, rank):
    """``(dq, dk, dv)`` for this rank's slice. K/V go round the ring once more; each slice's dK/dV partial sums
    (float32) follow it one step behind and arrive at their owner after the last step."""
    n = q.shape[2] * world
    band = global_band(n, causal, window)
    q_chunks = rank_chunks(n, world, rank, layout)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, Hq, N_local, D)
    ring = Ring(group, world, rank) if world > 1 else None
    kv = [k.contiguous(), v.contiguous()]
    grads_in, grad_works = None, []  # the dK/dV sums of the slice this rank holds, on their way from rank - 1
    for step in range(world):
        source = (rank - step) % world
        if step < world - 1:
            incoming, works = ring.pass_on(kv)
        k_now, v_now = kv
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (B, Hk, N_local, D)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for rows, keys, call in chunk_pairs(q_chunks, rank_chunks(n, world, source, layout), band):
            dq_part, dk_part, dv_part = attention_backward(
                do[:, :, rows], q[:, :, rows], k_now[:, :, keys], v_now[:, :, keys], o[:, :, rows],
                lse[:, :, rows], call.causal, call.window, scale,
            )  # fmt: skip
            dq[:, :, rows] += dq_part
            dk[:, :, keys] += dk_part
            dv[:, :, keys] += dv_part
        if grads_in is not None:
            wait(grad_works)
            dk += grads_in[0]
            dv += grads_in[1]
        if world > 1:
            grads_in, grad_works = ring.pass_on([dk, dv])  # on to the next holder; after the last step, the owner
        if step < world - 1:
            wait(works)
            kv = incoming
    if world > 1:
        wait(grad_works)
        dk, dv = grads_in
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """``o = RingAttention.apply(q, k, v, causal, window, scale, group, layout, world, rank)`` on checked inputs;
    saves q, k, v, o and the global lse (nothing of size N^2)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale, group, layout, world, rank):
        o, lse = ring_forward(q, k, v, causal, window, scale, group, layout, world, rank)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, window, scale, group, layout, world, rank)
        ctx.set_materialize_grads(False)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        if do is None:
            return (None,) * 10
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do, q, k, v, o, lse, *ctx.args)
        return (dq, dk, dv) + (None,) * 7


def ring_attention(q, k, v, causal=False, window=None, scale=None, group=None, layout="head_tail"):
    """Attention over a sequence split across the ranks of ``group``, by passing K/V around a ring.

    Each rank passes its own slice: q ``(B, Hq, N_local, D)``, k and v ``(B, Hk, N_local, D)`` (grouped-query
    attention as in ``flash_attention``: K/V are never repeated), holding the positions ``rank_chunks(N, world,
    rank, layout)`` of the whole sequence of N = world * N_local positions (``shard_sequence`` builds them).
    ``causal`` and ``window`` are the whole sequence's mask (``flashlab.core.masking``), exact in global positions;
    ``scale`` defaults to ``1/sqrt(D)``. Returns this rank's rows of the output, in its local order, like q.

    Differentiable (q, k, v): the backward recomputes the probabilities block by block from the global lse, and
    the gradients come back in the local order. Every rank must call it together with the same shapes, dtype,
    mask, scale and layout (checked: a ValueError on every rank, not a hang); an uneven split is a ValueError.
    Must equal ``flash_attention`` on the gathered sequence to within the dtype's rounding.
    """
    world, rank = check_inputs(q, k, v, causal, window, scale, group, layout, "ring_attention")
    return RingAttention.apply(q, k, v, causal, window, scale, group, layout, world, rank)


# ----------------------------------------------------------------------------------------------------------------
# All-gather: every rank holds all of K/V
# ----------------------------------------------------------------------------------------------------------------


class GatherSequence(torch.autograd.Function):
    """The whole sequence from every rank's slice (all-gather, then into global order); the backward sums every
    rank's gradient for this rank's positions (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, layout, world, rank):
        ctx.args = (group, layout, world, rank)
        shards = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(shards, x.contiguous(), group=group)
        return unshard_sequence(shards, layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        group, layout, world, rank = ctx.args
        parts = [shard_sequence(grad, world, r, layout).contiguous() for r in range(world)]
        mine = torch.empty_like(parts[rank])
        dist.reduce_scatter(mine, parts, group=group)
        return mine, None, None, None, None


def all_gather_attention(q, k, v, causal=False, window=None, scale=None, group=None, layout="head_tail"):
    """Attention over a sequence split across ranks, by gathering all of K/V on every rank: the comparison for
    ``ring_attention`` (same arguments, same result). One ``flash_attention`` call per local query chunk (one for
    ``"contiguous"``, two for ``"head_tail"``), each against the keys its mask reaches; differentiable, the K/V
    gradients summed back to their owners."""
    world, rank = check_inputs(q, k, v, causal, window, scale, group, layout, "all_gather_attention")
    k_all = GatherSequence.apply(k, group, layout, world, rank)  # (B, Hk, N, D) in global order
    v_all = GatherSequence.apply(v, group, layout, world, rank)
    n = k_all.shape[2]
    band = global_band(n, causal, window)
    pieces, local = [], 0
    for chunk in rank_chunks(n, world, rank, layout):
        call = block_call(chunk, (0, n), band)  # every row of the whole square sequence sees its own key
        rows = slice(local + call.q0, local + call.q1)
        keys = slice(call.k0, call.k1)
        pieces.append(flash_attention(q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], call.causal,
                                      call.window, scale))  # fmt: skip
        local += chunk[1] - chunk[0]
    return torch.cat(pieces, dim=2)


def attention_flops_per_rank(n: int, world: int, d: int, causal: bool, layout: str) -> list[float]:
    """Forward FLOPs (4 d per visible score) each rank's queries cost under ``layout``: the causal imbalance of the
    contiguous split and its head-tail fix, as ``block_call`` cuts the pairs."""
    band = global_band(n, causal, None)
    work = []
    for rank in range(world):
        visible = 0
        for qc in rank_chunks(n, world, rank, layout):
            call = block_call(qc, (0, n), band)
            nq, nk = call.q1 - call.q0, call.k1 - call.k0
            visible += nq * nk - (nq * (nq - 1) // 2 if call.causal else 0)
        work.append(4.0 * d * visible)
    return work


__all__ = [
    "LAYOUTS",
    "BlockCall",
    "all_gather_attention",
    "attention_flops_per_rank",
    "block_call",
    "chunk_pairs",
    "global_band",
    "merge_pair",
    "rank_chunks",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
