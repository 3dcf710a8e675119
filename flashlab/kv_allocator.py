"""Where KV-cache memory goes when requests come and go: contiguous reservation against PagedAttention's blocks.

A serving engine keeps every running request's keys and values (its KV cache) in GPU memory. The cache grows by
one token per decode step, and nobody knows in advance how long a request's answer will be. Two ways to hand out
that memory, simulated here one decode step at a time, counting memory in tokens of KV cache (multiply by
``flashlab.calculators.roofline.kv_cache_bytes_per_token(model)`` for bytes):

- ``ContiguousAllocator`` -- the pre-vLLM way: each request gets one contiguous slab when it is admitted, big
  enough for the longest it could ever become (``reserve="max"``: ``max_len`` tokens). Most of the slab is never
  written. Even an oracle that knows each answer's length (``reserve="exact"``) leaves holes between slabs that a
  new request may not fit into: free memory it cannot use (external fragmentation).
- ``PagedAllocator`` -- PagedAttention (Kwon et al., vLLM, SOSP 2023): memory is cut into fixed-size blocks of
  ``block_size`` tokens, handed out one block at a time as a request grows, anywhere in memory; a per-request
  block table maps its logical blocks to physical ones. A request wastes at most ``block_size - 1`` slots, in its
  last block. When a growing request finds no free block, the most recently admitted request is preempted (its
  blocks freed; it starts again later), as vLLM does with recomputation.

``simulate`` runs a list of ``Request`` through an allocator first come, first served and records, step by step,
the tokens of KV actually held (``used``), the slots the allocator has handed out (``reserved``) and how many
requests are running (the batch size -- the thing less waste buys: more requests decode together).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Request:
    """One request: ``prompt_len`` tokens of KV written when it is admitted (prefill), then one more per decode
    step for ``output_len`` steps. It arrives at step ``arrival``; its cache peaks at ``prompt_len + output_len``."""

    prompt_len: int
    output_len: int
    arrival: int = 0

    def __post_init__(self):
        for name in ("prompt_len", "output_len", "arrival"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"Request.{name} must be an int; got {type(value).__name__}")
        if self.prompt_len < 1:
            raise ValueError(f"Request.prompt_len must be at least 1; got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"Request.output_len must be at least 1; got {self.output_len}")
        if self.arrival < 0:
            raise ValueError(f"Request.arrival must be >= 0; got {self.arrival}")

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def random_requests(count: int, max_len: int, *, arrivals_per_step: float = 1.0, seed: int = 0) -> list[Request]:
    """``count`` requests with random prompt and answer lengths (each total at most ``max_len``).

    Prompts are uniform in [1, max_len / 2]; answers are mostly short with a long tail (exponential, mean
    max_len / 8), clipped so the request fits in ``max_len`` -- the shape that makes reserving ``max_len``
    wasteful. Arrivals are a Poisson process with ``arrivals_per_step`` requests per decode step on average.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1; got {count}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (one prompt token and one answer token); got {max_len}")
    if arrivals_per_step <= 0:
        raise ValueError(f"arrivals_per_step must be positive; got {arrivals_per_step}")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, max(max_len // 2, 1) + 1, size=count)
    output = np.ceil(rng.exponential(max_len / 8, size=count)).astype(np.int64)
    output = np.clip(output, 1, max_len - prompt)
    arrival = np.floor(np.cumsum(rng.exponential(1 / arrivals_per_step, size=count))).astype(np.int64)
    arrival -= arrival[0]  # the first request arrives at step 0
    return [Request(int(p), int(o), int(a)) for p, o, a in zip(prompt, output, arrival, strict=True)]


class ContiguousAllocator:
    """One contiguous slab per request, reserved at admission (first fit in a flat address space of
    ``capacity`` token slots). ``reserve="max"`` reserves ``max_len`` slots per request (the answer's length is
    unknown); ``reserve="exact"`` reserves exactly ``prompt_len + output_len`` (an oracle)."""

    def __init__(self, capacity: int, max_len: int, reserve: str = "max"):
        if reserve not in ("max", "exact"):
            raise ValueError(f"reserve must be 'max' or 'exact'; got {reserve!r}")
        if max_len < 1 or capacity < max_len:
            raise ValueError(f"capacity ({capacity}) must hold at least one request of max_len ({max_len}) tokens")
        self.capacity, self.max_len, self.reserve = capacity, max_len, reserve
        self.name = f"contiguous ({'reserve max_len' if reserve == 'max' else 'exact length, oracle'})"
        self.slabs: dict[int, tuple[int, int]] = {}  # request id -> (start slot, size)

    def need(self, request: Request) -> int:
        """Slots that admitting ``request`` takes at once."""
        return self.max_len if self.reserve == "max" else request.total_len

    def _holes(self) -> list[tuple[int, int]]:
        """Free (start, size) runs between the slabs, in address order."""
        holes, cursor = [], 0
        for start, size in sorted(self.slabs.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + size
        if cursor < self.capacity:
            holes.append((cursor, self.capacity - cursor))
        return holes

    def admit(self, rid: int, request: Request) -> bool:
        size = self.need(request)
        for start, hole in self._holes():
            if hole >= size:
                self.slabs[rid] = (start, size)
                return True
        return False

    def grow(self, rid: int, tokens: int) -> bool:
        return tokens <= self.slabs[rid][1]  # the slab was sized for the whole request: growing never allocates

    def free(self, rid: int) -> None:
        del self.slabs[rid]

    def reserved(self) -> int:
        return sum(size for _, size in self.slabs.values())


class PagedAllocator:
    """Fixed-size blocks of ``block_size`` token slots (``capacity // block_size`` of them), handed out one at a
    time as a request's cache grows. ``block_tables[rid]`` lists the physical blocks of request ``rid`` in
    logical order: neighbours in the sequence need not be neighbours in memory."""

    def __init__(self, capacity: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1; got {block_size}")
        if capacity < block_size:
            raise ValueError(f"capacity ({capacity}) must hold at least one block of {block_size} tokens")
        self.capacity = capacity // block_size * block_size  # a partial block at the end is never used
        self.block_size = block_size
        self.name = f"paged ({block_size}-token blocks)"
        self.free_blocks = deque(range(capacity // block_size))
        self.block_tables: dict[int, list[int]] = {}

    def need(self, request: Request) -> int:
        """Slots that admitting ``request`` takes at once: the blocks its prompt fills."""
        return math.ceil(request.prompt_len / self.block_size) * self.block_size

    def _take(self, rid: int, tokens: int) -> bool:
        """Give ``rid`` enough blocks to hold ``tokens`` tokens; False (and nothing taken) if there are too few."""
        table = self.block_tables.setdefault(rid, [])
        missing = math.ceil(tokens / self.block_size) - len(table)
        if missing > len(self.free_blocks):
            return False
        table.extend(self.free_blocks.popleft() for _ in range(max(missing, 0)))
        return True

    def admit(self, rid: int, request: Request) -> bool:
        if self._take(rid, request.prompt_len):
            return True
        self.block_tables.pop(rid)
        return False

    def grow(self, rid: int, tokens: int) -> bool:
        return self._take(rid, tokens)

    def free(self, rid: int) -> None:
        self.free_blocks.extend(self.block_tables.pop(rid))

    def reserved(self) -> int:
        return sum(len(t) for t in self.block_tables.values()) * self.block_size


@dataclass
class SimulationResult:
    """Per-step records of one simulation (arrays of length ``steps``), in tokens of KV cache."""

    allocator: str
    capacity: int  # token slots in the pool
    used: np.ndarray  # tokens of KV actually held by running requests
    reserved: np.ndarray  # slots handed out to running requests (used + wasted)
    stranded: np.ndarray  # free slots that could not take the next waiting request (external fragmentation)
    running: np.ndarray  # requests decoding this step (the batch size)
    waiting: np.ndarray  # requests that have arrived but are not admitted
    preemptions: int  # requests evicted to make room (paged only), restarted later
    tokens_generated: int  # answer tokens produced, restarted work not counted

    @property
    def steps(self) -> int:
        """Decode steps until the last request finished."""
        return len(self.used)

    @property
    def wasted(self) -> np.ndarray:
        """Slots reserved but holding no KV, per step."""
        return self.reserved - self.used

    @property
    def waste_fraction(self) -> float:
        """Share of reserved memory, summed over all steps, that held no KV."""
        total = self.reserved.sum()
        return float(1 - self.used.sum() / total) if total else 0.0

    @property
    def mean_batch(self) -> float:
        """Average number of requests decoding together."""
        return float(self.running.mean())

    @property
    def throughput(self) -> float:
        """Answer tokens per decode step."""
        return self.tokens_generated / self.steps


def simulate(requests, allocator, *, max_steps: int = 1_000_000, progress: bool = False) -> SimulationResult:
    """Run ``requests`` (a list of ``Request``) through ``allocator`` until every one has finished.

    Each step: free the requests that finished last step; every running request decodes one token (its cache
    grows by one; a paged allocator may need a new block, and if none is free the latest-admitted request is
    preempted); then waiting requests are admitted first come, first served (the queue's head blocks the rest,
    so none overtakes another); then the step is recorded.
    """
    requests = list(requests)
    if not requests:
        raise ValueError("simulate needs at least one request")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a flashlab.kv_allocator.Request; got {type(r).__name__}")
        limit = getattr(allocator, "max_len", allocator.capacity)
        if r.total_len > limit:
            raise ValueError(f"requests[{i}] needs {r.total_len} tokens but {allocator.name} holds at most {limit}")
    arrival_order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    next_arrival = 0
    waiting: deque[int] = deque()
    running: dict[int, int] = {}  # request id -> answer tokens generated so far, in admission order
    finished_now: list[int] = []
    done = 0
    preemptions = tokens_generated = 0
    rec = {k: [] for k in ("used", "reserved", "stranded", "running", "waiting")}
    bar = tqdm(total=len(requests), desc=allocator.name, disable=not progress)
    step = 0
    while True:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
        for rid in finished_now:  # finished last step: release its memory
            allocator.free(rid)
            del running[rid]
        bar.update(len(finished_now))
        finished_now = []
        while next_arrival < len(requests) and requests[arrival_order[next_arrival]].arrival <= step:
            waiting.append(arrival_order[next_arrival])
            next_arrival += 1
        # -- decode: every running request writes one more token of KV
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            generated = running[rid] + 1
            while not allocator.grow(rid, requests[rid].prompt_len + generated):
                victim = next(reversed(running))  # the latest admitted gives its memory back and starts again later
                allocator.free(victim)
                tokens_generated -= running.pop(victim)
                waiting.appendleft(victim)
                preemptions += 1
                if victim == rid:
                    break
            if rid in running:
                running[rid] = generated
                tokens_generated += 1
                if generated == requests[rid].output_len:
                    finished_now.append(rid)
        # -- admit: first come, first served, while memory allows
        while waiting and allocator.admit(waiting[0], requests[waiting[0]]):
            running[waiting.popleft()] = 0
        reserved = allocator.reserved()
        free = allocator.capacity - reserved
        rec["used"].append(sum(requests[rid].prompt_len + g for rid, g in running.items()))
        rec["reserved"].append(reserved)
        # free memory that is enough in total for the queue's head, yet could not take it: fragmentation
        rec["stranded"].append(free if waiting and free >= allocator.need(requests[waiting[0]]) else 0)
        rec["running"].append(len(running))
        rec["waiting"].append(len(waiting))
        done += len(finished_now)
        step += 1
        if done == len(requests):
            for rid in finished_now:  # leave the allocator empty, ready for another run
                allocator.free(rid)
            bar.update(len(finished_now))
            break
    bar.close()
    return SimulationResult(
        allocator=allocator.name,
        capacity=allocator.capacity,
        **{k: np.asarray(v, dtype=np.int64) for k, v in rec.items()},
        preemptions=preemptions,
        tokens_generated=tokens_generated,
    )
