#!/usr/bin/env python3
"""Model check of the sm_90a attention kernel's work protocol (flash_attn_fwd_sm90.cu):
the rank dispenser shared by the CTAs of a launch (drawn early, reset by the last CTA),
each CTA's posted work tile under the q_full / q_empty barriers, and its K/V ring
(SlotPhases: per-slot full/empty mbarriers with parity waits, every work tile from slot 0).
Per CTA one producer and one consumer (standing for every consumer warp); random grids,
work tile costs (0 key tiles included) and interleavings; two launches per dispenser.
Asserts that every rank is done exactly once, that the consumer reads exactly the key tile
the producer wrote for it, that no slot or posted tile is overwritten before it was
consumed, and that the dispenser is back at zero after each launch.

  python3 python/dev/ring_protocol_model.py [--trials N]
"""
import argparse
import random


class Barrier:
    """mbarrier reduced to its phase counter: a phase completes per arrival (count 1)."""

    def __init__(self):
        self.phase = 0  # completed phases

    def arrive(self):
        self.phase += 1

    def done(self, parity):
        # try_wait.parity(P) succeeds once the phase of parity P has completed; the
        # protocol never lets a waiter fall two phases behind, which the model asserts.
        return self.phase % 2 != parity


class SlotPhases:
    def __init__(self, stages):
        self.stages, self.par, self.used = stages, 0, 0

    def parity(self, s, rnd):
        return ((self.par >> s) ^ rnd) & 1

    def reused(self, s, rnd):
        return rnd > 0 or (self.used >> s) & 1

    def advance(self, n):
        for s in range(self.stages):
            cnt = (n - s + self.stages - 1) // self.stages if n > s else 0
            self.par ^= (cnt & 1) << s
            if cnt:
                self.used |= 1 << s


class Dispenser:
    """fm90_dispenser: [0] next rank, [1] CTAs that drew past the end (atomics are steps)."""

    def __init__(self):
        self.next, self.left = 0, 0

    def draw(self):
        r, self.next = self.next, self.next + 1
        return r

    def leave(self, grid):
        self.left += 1
        if self.left == grid:  # the last CTA resets it for the next launch
            self.next, self.left = 0, 0


class Cta:
    """One CTA's shared state: Q barriers, the posted work tile, the K/V ring."""

    def __init__(self, stages):
        self.q_full, self.q_empty = Barrier(), Barrier()
        self.tile = None  # (rank, n) or "end"; "read" once every consumer has read it
        self.q = None  # the rank whose Q tile is in shared memory
        self.full = [Barrier() for _ in range(stages)]
        self.empty = [Barrier() for _ in range(stages)]
        self.slots = [None] * stages


def producer(costs, grid, disp, cta, stages, log):
    ring = SlotPhases(stages)
    rank = disp.draw()
    yield
    i = 0
    while True:
        if i > 0:
            while not cta.q_empty.done((i - 1) & 1):
                yield
        assert cta.tile in (None, "read"), f"work tile {cta.tile} overwritten before it was read"
        if rank >= len(costs):
            cta.tile = "end"
            cta.q_full.arrive()
            yield
            disp.leave(grid)
            return
        n = costs[rank]
        cta.tile = (rank, n)
        if n > 0:
            cta.q = rank  # the Q load of this tile (lands before q_full completes)
        rank_now, rank = rank, disp.draw()  # drawn early, as the kernel does
        i += 1
        cta.q_full.arrive()
        yield
        s = rnd = 0
        for it in range(n):
            if ring.reused(s, rnd):
                par = ring.parity(s, rnd) ^ 1
                while not cta.empty[s].done(par):
                    yield
                assert cta.empty[s].phase >= 1
            assert cta.slots[s] is None, f"slot {s} overwritten before release"
            cta.slots[s] = (rank_now, it)
            cta.full[s].arrive()
            s += 1
            if s == stages:
                s, rnd = 0, rnd + 1
            yield
        ring.advance(n)


def consumer(cta, stages, done):
    ring = SlotPhases(stages)
    i = 0
    while True:
        while not cta.q_full.done(i & 1):
            yield
        assert cta.q_full.phase - cta.q_empty.phase == 1, "consumer two Q phases behind"
        tile = cta.tile
        assert tile not in (None, "read")
        if tile == "end":
            return
        cta.tile = "read"
        rank, n = tile
        done.append(rank)
        i += 1
        if n == 0:
            cta.q_empty.arrive()
        s = rnd = 0
        for it in range(n):
            ph = ring.parity(s, rnd)
            while not cta.full[s].done(ph):
                yield
            assert cta.full[s].phase - cta.empty[s].phase == 1, "consumer two phases behind"
            assert cta.slots[s] == (rank, it), f"rank {rank} step {it} read {cta.slots[s]} from slot {s}"
            assert cta.q == rank, f"rank {rank} step {it}: Q of rank {cta.q} in shared memory"
            cta.slots[s] = None
            cta.empty[s].arrive()
            if it == n - 1:
                cta.q_empty.arrive()  # last S of this work tile: Q and the posted tile are free
            s += 1
            if s == stages:
                s, rnd = 0, rnd + 1
            yield
        ring.advance(n)


def launch(rng, stages, costs, grid, disp):
    ctas = [Cta(stages) for _ in range(grid)]
    done, log = [], []
    alive = []
    for c in ctas:
        alive += [producer(costs, grid, disp, c, stages, log), consumer(c, stages, done)]
    steps = 0
    while alive:
        a = rng.choice(alive)
        try:
            next(a)
        except StopIteration:
            alive.remove(a)
        steps += 1
        assert steps < 200000, f"deadlock: costs {costs} grid {grid}"
    assert sorted(done) == list(range(len(costs))), "a work tile was lost or done twice"
    assert all(x is None for c in ctas for x in c.slots)
    assert (disp.next, disp.left) == (0, 0), "dispenser not reset"


def trial(rng, stages):
    disp = Dispenser()
    for _ in range(2):  # two launches on one dispenser: the reset must hold
        costs = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 8, 9]) for _ in range(rng.randint(0, 14))]
        launch(rng, stages, costs, rng.randint(1, 4), disp)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3000)
    args = ap.parse_args()
    rng = random.Random(1)
    for stages in (2, 3, 4):
        for _ in range(args.trials):
            trial(rng, stages)
    print(f"work protocol: {3 * args.trials} random trials (2 launches each), stages 2-4: OK")


if __name__ == "__main__":
    main()
