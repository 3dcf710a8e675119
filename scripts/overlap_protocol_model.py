"""A model of the overlap rung's synchronisation (``flashlab/kernels/ladder/rung4_overlap.py``), checked without a GPU.

The kernel's partitions -- the loader warp and the two or three consumer warpgroups -- are written here as Python
generators, step for step as in the kernel (every mbarrier wait, expect and arrive, every product issued and waited
for, the ring's position and phase carried across a program's tiles, the ping-pong turns). The copy engine and the
tensor cores are asynchronous: each copy, product and store finishes at a random later step. mbarriers follow PTX's
rule: a wait on parity p passes once the phase of that parity has completed.

Each run interleaves the partitions at random and checks: no deadlock; every product reads the tile it means, fully
copied; no copy lands in a buffer a product may still read; no O write meets its own store still reading. It runs
every configuration below for SEEDS random interleavings. Change the kernel's synchronisation, change this model the
same way, and run it:

    python scripts/overlap_protocol_model.py [SEEDS]

The test suite runs a share of the configurations and shows that mutations of the protocol make the model fail
(``tests/test_overlap_protocol.py``).
"""

import random
import sys


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self):
        assert self.pending > 0
        self.pending -= 1
        self._maybe_complete()

    def expect(self, nbytes):  # arrive.expect_tx
        self.tx += nbytes
        self.pending -= 1
        self._maybe_complete()

    def bytes_landed(self, nbytes):
        self.tx -= nbytes
        assert self.tx >= 0
        self._maybe_complete()

    def passed(self, parity):  # try_wait.parity: the phase of that parity has completed
        return (self.phase & 1) != parity


class World:
    def __init__(self, rng):
        self.rng = rng
        self.buffers = {}  # name -> (content, complete)
        self.inflight = []  # async ops: dicts with kind, reads, etc.
        self.mma_groups = {g: [] for g in range(3)}  # per warpgroup: outstanding wgmma (oldest first)
        self.stores = {g: [] for g in range(3)}

    def fail(self, msg):
        raise AssertionError(msg)

    # the copy engine
    def tma_load(self, buf, content, bar, nbytes=1):
        for op in self.inflight:
            if op["kind"] == "mma" and buf in op["reads"]:
                self.fail(f"copy of {content} into {buf} while a product reads it ({op['what']})")
            if op["kind"] == "store" and op["buf"] == buf:
                self.fail(f"copy of {content} into {buf} while O's store reads it")
        self.buffers[buf] = (content, False)
        self.inflight.append(dict(kind="load", buf=buf, content=content, bar=bar, nbytes=nbytes))

    def mma(self, wg, reads, expect, what):
        for buf, want in zip(reads, expect, strict=True):
            have = self.buffers.get(buf)
            if have is None or have[0] != want or not have[1]:
                self.fail(f"WG{wg} {what}: {buf} holds {have}, wanted {want} (complete)")
        op = dict(kind="mma", wg=wg, reads=reads, what=what, expect=expect)
        self.inflight.append(op)
        self.mma_groups[wg].append(op)
        return op

    def store(self, wg, buf):
        op = dict(kind="store", wg=wg, buf=buf)
        self.inflight.append(op)
        self.stores[wg].append(op)

    def write_smem(self, wg, buf):
        for op in self.inflight:
            if op["kind"] == "store" and op["buf"] == buf:
                self.fail(f"WG{wg} writes {buf} while its store runs")
            if op["kind"] == "mma" and buf in op["reads"]:
                self.fail(f"WG{wg} writes {buf} while a product reads it ({op['what']})")
            if op["kind"] == "load" and op["buf"] == buf:
                self.fail(f"WG{wg} writes {buf} while a copy lands in it")
        self.buffers[buf] = (("o", wg), True)

    def complete_one(self):
        op = self.rng.choice(self.inflight)
        if op["kind"] == "mma":  # wgmma groups of one warpgroup complete in order
            op = self.mma_groups[op["wg"]][0]
            # a product still reading must read the same contents it started with
            for buf, want in zip(op["reads"], op["expect"], strict=True):
                if self.buffers[buf][0] != want:
                    self.fail(f"{buf} changed under {op['what']}")
            self.mma_groups[op["wg"]].pop(0)
        elif op["kind"] == "load":
            self.buffers[op["buf"]] = (op["content"], True)
            op["bar"].bytes_landed(op["nbytes"])
        else:
            self.stores[op["wg"]].remove(op)
        self.inflight.remove(op)


def tile_at(tile, n_m, n_bh, causal):
    if causal:
        return n_m - 1 - tile // n_bh, tile % n_bh
    return tile % n_m, tile // n_m


def key_tiles(m, nk_tiles, causal, offset_tiles):
    # BLOCK_M = BLOCK_N here: query tile m sees key tiles 0..m+offset (causal)
    return min(m + 1 + offset_tiles, nk_tiles) if causal else nk_tiles


def wait(bar, parity):
    while not bar.passed(parity):
        yield


def loader(w, B, NUM_WG, pid, nprog, n_m, n_bh, nk_tiles, causal, off, STAGES, O_IN_Q):
    count = done = 0

    def load_q(tile, done):
        for g in range(NUM_WG):
            yield from wait(B["q_empty"][g], (done & 1) ^ 1)
            B["q_ready"][g].expect(1)
            w.tma_load(f"q{g}", ("q", tile, g), B["q_ready"][g])

    def load_kv(count, bh, j):
        stage, phase = count % STAGES, (count // STAGES) & 1
        yield from wait(B["k_empty"][stage], phase ^ 1)
        B["k_ready"][stage].expect(1)
        w.tma_load(f"k{stage}", ("k", bh, j), B["k_ready"][stage])
        yield
        yield from wait(B["v_empty"][stage], phase ^ 1)
        B["v_ready"][stage].expect(1)
        w.tma_load(f"v{stage}", ("v", bh, j), B["v_ready"][stage])
        yield

    for tile in range(pid, n_m * n_bh, nprog):
        m, bh = tile_at(tile, n_m, n_bh, causal)
        j0 = 0
        if O_IN_Q:  # the first K and V before Q, whose buffer comes back only after O's store
            yield from load_kv(count, bh, 0)
            count += 1
            yield from load_q(tile, done)
            j0 = 1
        else:
            yield from load_q(tile, done)
        for j in range(j0, key_tiles(m, nk_tiles, causal, off)):
            yield from load_kv(count, bh, j)
            count += 1
        done += 1


def mma_wait(w, wg, n):
    while len(w.mma_groups[wg]) > n:
        yield


def consumer(w, B, WG, NUM_WG, pid, nprog, n_m, n_bh, nk_tiles, causal, off, STAGES, O_IN_Q, PINGPONG):
    count = turns = done = 0
    turn = B["turn"]

    def take():
        if PINGPONG:
            yield from wait(turn[WG], (turns & 1) ^ (1 if WG == 0 else 0))

    def give():
        if PINGPONG:
            turn[(WG + 1) % NUM_WG].arrive()

    for tile in range(pid, n_m * n_bh, nprog):
        m, bh = tile_at(tile, n_m, n_bh, causal)
        n = key_tiles(m, nk_tiles, causal, off)
        yield from wait(B["q_ready"][WG], done & 1)
        stage = count % STAGES
        yield from wait(B["k_ready"][stage], (count // STAGES) & 1)
        yield from take()
        w.mma(WG, [f"q{WG}", f"k{stage}"], [("q", tile, WG), ("k", bh, 0)], f"QK t{tile} j0")
        give()
        turns += 1
        yield
        yield from mma_wait(w, WG, 0)
        B["k_empty"][stage].arrive()
        yield
        for j in range(1, n):
            prev, stage = (count + j - 1) % STAGES, (count + j) % STAGES
            yield from wait(B["k_ready"][stage], ((count + j) // STAGES) & 1)
            yield from take()
            w.mma(WG, [f"q{WG}", f"k{stage}"], [("q", tile, WG), ("k", bh, j)], f"QK t{tile} j{j}")
            yield from wait(B["v_ready"][prev], ((count + j - 1) // STAGES) & 1)
            w.mma(WG, [f"v{prev}"], [("v", bh, j - 1)], f"PV t{tile} j{j - 1}")
            give()
            turns += 1
            yield
            yield from mma_wait(w, WG, 1)
            B["k_empty"][stage].arrive()
            yield  # softmax
            yield from mma_wait(w, WG, 0)
            B["v_empty"][prev].arrive()
            yield
        if not O_IN_Q:
            B["q_empty"][WG].arrive()
        last = (count + n - 1) % STAGES
        yield from wait(B["v_ready"][last], ((count + n - 1) // STAGES) & 1)
        w.mma(WG, [f"v{last}"], [("v", bh, n - 1)], f"PV t{tile} j{n - 1}")
        yield from mma_wait(w, WG, 0)  # synchronous product
        B["v_empty"][last].arrive()
        count += n
        yield
        o_buf = f"q{WG}" if O_IN_Q else f"o{WG}"
        if not O_IN_Q:
            while w.stores[WG]:  # tma.store_wait(0)
                yield
        w.write_smem(WG, o_buf)
        w.store(WG, o_buf)
        if O_IN_Q:
            while w.stores[WG]:  # tma.store_wait(0), then Q's buffer goes back to the loader
                yield
            B["q_empty"][WG].arrive()
        done += 1
        yield
    while w.stores[WG]:
        yield


def simulate(seed, NUM_WG, STAGES, O_IN_Q, PINGPONG, n_m, n_bh, nk_tiles, causal, off, pid=0, nprog=1):
    rng = random.Random(seed)
    w = World(rng)
    B = dict(
        q_ready=[Barrier(1) for _ in range(NUM_WG)],
        q_empty=[Barrier(1) for _ in range(NUM_WG)],
        turn=[Barrier(1) for _ in range(NUM_WG)],
        k_ready=[Barrier(1) for _ in range(STAGES)],
        v_ready=[Barrier(1) for _ in range(STAGES)],
        k_empty=[Barrier(NUM_WG) for _ in range(STAGES)],
        v_empty=[Barrier(NUM_WG) for _ in range(STAGES)],
    )
    args = (NUM_WG, pid, nprog, n_m, n_bh, nk_tiles, causal, off, STAGES, O_IN_Q)
    procs = {"loader": loader(w, B, *args)}
    for g in range(NUM_WG):
        procs[f"wg{g}"] = consumer(w, B, g, *args, PINGPONG)
    steps = 0
    stuck = 0
    while procs or w.inflight:
        steps += 1
        choices = list(procs) + (["async"] * 2 if w.inflight else [])
        c = rng.choice(choices)
        if c == "async":
            w.complete_one()
            stuck = 0
            continue
        try:
            next(procs[c])
        except StopIteration:
            del procs[c]
        # deadlock detection: many steps with no async op pending and no progress is approximated by a bound
        if not w.inflight:
            stuck += 1
            if stuck > 20000:
                raise AssertionError(f"deadlock: {list(procs)} waiting, nothing in flight")
        else:
            stuck = 0
    return steps


if __name__ == "__main__":
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    configs = []
    for NUM_WG, STAGES, O_IN_Q in ((2, 2, False), (2, 3, False), (3, 2, False), (3, 3, False), (2, 2, True)):
        for PINGPONG in (False, True):
            for causal, off in ((False, 0), (True, 0), (True, 2)):
                for n_m, n_bh, nk_tiles in ((1, 1, 1), (3, 2, 3), (4, 3, 4), (2, 5, 1)):
                    if causal and n_m > nk_tiles - off and off:
                        nk = n_m + off
                    else:
                        nk = nk_tiles if not causal else max(nk_tiles, n_m)
                    for nprog in (1, 2, 3):
                        configs.append((NUM_WG, STAGES, O_IN_Q, PINGPONG, n_m, n_bh, nk, causal, off, nprog))
    total = 0
    for cfg in configs:
        NUM_WG, STAGES, O_IN_Q, PINGPONG, n_m, n_bh, nk, causal, off, nprog = cfg
        for s in range(seeds):
            pid = s % nprog
            try:
                total += simulate(s, NUM_WG, STAGES, O_IN_Q, PINGPONG, n_m, n_bh, nk, causal, off, pid, nprog)
            except AssertionError as e:
                print("FAIL", cfg, "seed", s, e)
                sys.exit(1)
    print(f"{len(configs)} configurations x {seeds} seeds: no deadlock, no hazard ({total} steps)")
