"""Scratch memory a launch needs only while it runs, kept per CUDA stream: the one owner of it.

The split-KV and KV-cache kernels take their chunks' partial results, their merge counters and a log-sum-exp
nobody asked for from it; the Hopper rung's programs build their copy descriptors in it.
"""

from __future__ import annotations

import contextlib

import torch

from flashlab.kernels.device import stream_capturing

_SCRATCH: dict = {}  # (device index, stream handle) -> (float32 workspace, int32 counters)
_FRESH = [0]  # > 0 inside fresh_scratch()
# Raised whenever a stream's kept scratch is replaced: views cut from the kept scratch (workspace keeps
# them on a plan) are still the stream's while the epoch they were cut in is the current one.
SCRATCH_EPOCH = [0]


def reusing_scratch() -> bool:
    """Whether launches now take the stream's kept scratch (not inside ``fresh_scratch()``, not capturing)."""
    return not _FRESH[0] and not stream_capturing()


def scratch(device: torch.device, stream: int, floats: int, counters: int):
    """``(work, counters, kept)``: a float32 workspace of at least ``floats`` elements and ``counters`` int32 counters
    that are zero between launches, for the kernels of one call on ``stream`` (``current_stream``'s handle), and
    whether they are the stream's kept scratch (False: fresh, to be dropped after the call).

    Kept per stream and grown when a call needs more: launches on one stream run one after another, so each call
    may reuse what the previous one left, and a decode step allocates nothing for it. The split-KV kernels use it
    for their chunks' partial results and for the counters that let the last chunk merge them (each program that
    raises a counter to its end puts it back to zero), and for a log-sum-exp nobody asked for. While a CUDA graph
    is being captured, inside ``fresh_scratch()``, and on the CPU, the memory is fresh instead (a graph keeps its
    own).
    """
    if _FRESH[0] or device.type != "cuda" or stream_capturing():
        work = torch.empty(floats, dtype=torch.float32, device=device)
        return work, torch.zeros(counters, dtype=torch.int32, device=device), False
    key = (device.index, stream)
    have = _SCRATCH.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < counters:
        if have is not None:
            floats, counters = max(floats, have[0].numel()), max(counters, have[1].numel())
        SCRATCH_EPOCH[0] += 1
        have = _SCRATCH[key] = (
            torch.empty(floats, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device),
            True,
        )
    return have


@contextlib.contextmanager
def fresh_scratch():
    """Launches inside take fresh scratch memory instead of the stream's: for the registered operators, whose
    calls torch.compile's CUDA-graph mode runs once to warm up with its own memory pool, and which must then
    leave nothing of that pool alive."""
    _FRESH[0] += 1
    try:
        yield
    finally:
        _FRESH[0] -= 1


def workspace(plan, device, stream):
    """``(o_part, lse_part, spare_lse, counters, row_order)`` for one launch of a split-KV or KV-cache ``plan`` (its
    ``plan.args`` say how much: ``parts`` partial rows of ``d`` floats, ``rows`` spare lse floats, ``counters``,
    ``order`` int32 places for a ragged launch's order of its row blocks, else ``row_order`` is None),
    carved from the stream's ``scratch``. The views are kept on the plan, with the stream and the scratch's epoch
    they were cut in, while both stay the same (cutting them, or even looking the scratch up, costs more than a
    launch's arguments)."""
    views = plan.views
    if views is not None and views[0] == stream and views[1] == SCRATCH_EPOCH[0] and reusing_scratch():
        return views[2]
    args = plan.args
    order = getattr(args, "order", 0)
    work, counters, kept = scratch(device, stream, args.parts * (args.d + 1) + args.rows + order, args.counters)
    end, spare = args.parts * args.d, args.parts * (args.d + 1)
    row_order = work[spare + args.rows : spare + args.rows + order].view(torch.int32) if order else None
    cut = (work[:end], work[end:spare], work[spare : spare + args.rows], counters, row_order)
    if kept:  # fresh scratch is the call's alone: nothing of it may outlive the call
        plan.views = (stream, SCRATCH_EPOCH[0], cut)
    return cut


__all__ = ["SCRATCH_EPOCH", "fresh_scratch", "reusing_scratch", "scratch", "workspace"]
