"""The KV-cache allocator simulation: hand-worked traces, the invariants of each allocator, and bad input."""

from __future__ import annotations

import pytest

from flashlab.kv_allocator import ContiguousAllocator, PagedAllocator, Request, random_requests, simulate

# Three requests arriving together, small enough to trace by hand (see each test's comments).
HAND = [Request(3, 2), Request(5, 1), Request(2, 3)]


def test_contiguous_reserving_max_len_traced_by_hand():
    # 16 slots, max_len 8: two slabs. Step 0: A(3) and B(5) admitted, C waits. Step 1: A 4, B 6 (B done).
    # Step 2: B freed, A 5 (done), C admitted with 2. Steps 3-5: C alone, 3, 4, 5 tokens in an 8-slot slab.
    r = simulate(HAND, ContiguousAllocator(16, 8))
    assert r.steps == 6
    assert r.used.tolist() == [8, 10, 7, 3, 4, 5]
    assert r.reserved.tolist() == [16, 16, 16, 8, 8, 8]
    assert r.running.tolist() == [2, 2, 2, 1, 1, 1]
    assert r.waiting.tolist() == [1, 1, 0, 0, 0, 0]
    assert r.preemptions == 0 and r.tokens_generated == 6
    assert r.waste_fraction == pytest.approx(1 - 37 / 72)


def test_paged_traced_by_hand():
    # 4 blocks of 4. Step 0: A 1 block, B 2, C 1 -- all admitted. Step 1: A 4, B 6 (done), C 3: no new block.
    # Step 2: B's 2 blocks freed; A 5 takes one (done); C 4. Step 3: A freed; C 5 takes a second block (done).
    r = simulate(HAND, PagedAllocator(16, 4))
    assert r.steps == 4
    assert r.used.tolist() == [10, 13, 9, 5]
    assert r.reserved.tolist() == [16, 16, 12, 8]
    assert r.running.tolist() == [3, 3, 2, 1]
    assert r.preemptions == 0 and r.tokens_generated == 6


def test_contiguous_exact_leaves_holes_a_longer_request_cannot_use():
    # 16 slots, exact slabs: A [0, 4), B [4, 12), C [12, 16); D (6 slots) arrives at step 1 and waits. C finishes
    # at step 1 (freed at 2: 4 free, too few for D anyway); A finishes at step 2 (freed at 3): now 8 slots are free
    # but in two 4-slot holes, so D still cannot start -- stranded until B finishes at step 6 (freed at 7).
    reqs = [Request(2, 2), Request(2, 6), Request(3, 1), Request(5, 1, arrival=1)]
    r = simulate(reqs, ContiguousAllocator(16, 16, reserve="exact"))
    assert r.stranded.tolist() == [0, 0, 0, 8, 8, 8, 8, 0, 0]
    assert r.waiting.tolist() == [0, 1, 1, 1, 1, 1, 1, 0, 0]
    # paged memory has no holes: D's prompt needs 2 blocks of 4, free at step 2 once C's block is back
    paged = simulate(reqs, PagedAllocator(16, 4))
    assert paged.stranded.max() == 0
    assert paged.running.tolist()[:3] == [3, 3, 3]
    assert paged.steps < r.steps


def test_an_allocator_is_empty_after_a_run_and_can_be_reused():
    reqs = random_requests(40, 50, arrivals_per_step=1.5, seed=11)
    for alloc in (ContiguousAllocator(200, 50), PagedAllocator(200, 7)):
        first = simulate(reqs, alloc)
        assert alloc.reserved() == 0
        second = simulate(reqs, alloc)
        assert first.used.tolist() == second.used.tolist() and first.steps == second.steps


def test_stranded_memory_is_zero_for_paged():
    reqs = random_requests(60, 64, arrivals_per_step=2.0, seed=3)
    r = simulate(reqs, PagedAllocator(300, 8))
    assert r.stranded.max() == 0


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_invariants_on_random_workloads(seed):
    reqs = random_requests(150, 97, arrivals_per_step=0.7, seed=seed)  # odd max_len on purpose
    total_answer = sum(r.output_len for r in reqs)
    for alloc in (ContiguousAllocator(1000, 97), ContiguousAllocator(1000, 97, "exact"), PagedAllocator(1000, 13)):
        r = simulate(reqs, alloc)
        assert (r.used <= r.reserved).all() and (r.reserved <= alloc.capacity).all()
        assert r.tokens_generated == total_answer  # every request finished, restarted work not double-counted
        assert r.used[-1] > 0 and r.running.min() >= 0
    paged = simulate(reqs, PagedAllocator(1000, 13))
    # a paged request wastes less than one block: at most 12 slots each
    assert (paged.wasted <= 12 * paged.running).all()


def test_paged_wastes_less_and_batches_more_than_reserving_max_len():
    reqs = random_requests(300, 512, arrivals_per_step=0.5, seed=1)
    contiguous = simulate(reqs, ContiguousAllocator(4096, 512))
    paged = simulate(reqs, PagedAllocator(4096, 16))
    assert paged.waste_fraction < 0.1 < 0.5 < contiguous.waste_fraction
    assert paged.mean_batch > 1.5 * contiguous.mean_batch
    assert paged.steps < contiguous.steps


def test_preemption_when_blocks_run_out():
    # 2 blocks of 2 slots. Step 0: A and B admitted, one block each. Step 2: A needs a third slot, no block is
    # free: B (the latest admitted) is preempted and loses its generated token. A finishes at step 3; B is
    # admitted again at step 4 and finishes at step 7.
    reqs = [Request(1, 3), Request(1, 3)]
    r = simulate(reqs, PagedAllocator(4, 2))
    assert r.preemptions == 1
    assert r.running.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert r.used.tolist() == [2, 4, 3, 4, 1, 2, 3, 4]
    assert r.tokens_generated == 6


def test_block_table_maps_logical_blocks_anywhere():
    alloc = PagedAllocator(16, 4)  # 4 blocks
    assert alloc.admit(0, Request(5, 3)) and alloc.admit(1, Request(4, 3))
    assert alloc.block_tables == {0: [0, 1], 1: [2]}
    alloc.free(0)
    assert alloc.admit(2, Request(9, 1))  # 3 blocks: the unused one, then the two just freed
    assert alloc.block_tables[2] == [3, 0, 1]
    assert not alloc.admit(3, Request(1, 1))  # nothing left


def test_random_requests_fit_and_are_reproducible():
    a = random_requests(200, 33, seed=5)
    assert a == random_requests(200, 33, seed=5)
    assert all(r.total_len <= 33 for r in a)
    arrivals = [r.arrival for r in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Request(0, 3), "prompt_len"),
        (lambda: Request(3, 0), "output_len"),
        (lambda: Request(3, 3, arrival=-1), "arrival"),
        (lambda: ContiguousAllocator(10, 16), "capacity"),
        (lambda: ContiguousAllocator(32, 16, reserve="half"), "reserve"),
        (lambda: PagedAllocator(8, 16), "capacity"),
        (lambda: PagedAllocator(8, 0), "block_size"),
        (lambda: random_requests(0, 16), "count"),
        (lambda: random_requests(5, 1), "max_len"),
        (lambda: simulate([], PagedAllocator(16, 4)), "at least one request"),
        (lambda: simulate([Request(10, 10)], ContiguousAllocator(32, 16)), "needs 20 tokens"),
        (lambda: simulate([Request(10, 10)], PagedAllocator(18, 4)), "needs 20 tokens"),
    ],
)
def test_bad_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="prompt_len"):
        Request(2.5, 3)
    with pytest.raises(TypeError, match="requests"):
        simulate([(3, 2)], PagedAllocator(16, 4))
