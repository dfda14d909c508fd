#!/usr/bin/env python3
"""Model check of the sm_90a attention kernel's K/V ring protocol (flash_attn_fwd_sm90.cu,
SlotPhases): one producer and one consumer (standing for every consumer warp), per-slot
full/empty mbarriers with parity waits, every work tile starting at slot 0, random work
tile sizes and random interleavings. Asserts that the consumer reads exactly the key tile
the producer wrote for it and that no slot is overwritten before it was released.

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


def producer(tiles, stages, full, empty, slots, log):
    ring = SlotPhases(stages)
    for w, n in enumerate(tiles):
        s = rnd = 0
        for it in range(n):
            if ring.reused(s, rnd):
                par = ring.parity(s, rnd) ^ 1
                while not empty[s].done(par):
                    yield
                assert empty[s].phase >= 1
            assert slots[s] is None, f"slot {s} overwritten before release"
            slots[s] = (w, it)
            full[s].arrive()
            log.append(("fill", w, it, s))
            s += 1
            if s == stages:
                s, rnd = 0, rnd + 1
        ring.advance(n)
        yield


def consumer(tiles, stages, full, empty, slots, log):
    ring = SlotPhases(stages)
    for w, n in enumerate(tiles):
        s = rnd = 0
        for it in range(n):
            ph = ring.parity(s, rnd)
            while not full[s].done(ph):
                yield
            assert full[s].phase - empty[s].phase == 1, "consumer two phases behind"
            assert slots[s] == (w, it), f"tile {w} step {it} read {slots[s]} from slot {s}"
            slots[s] = None
            empty[s].arrive()
            s += 1
            if s == stages:
                s, rnd = 0, rnd + 1
            yield
        ring.advance(n)


def trial(rng, stages):
    tiles = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 8, 9]) for _ in range(rng.randint(1, 12))]
    full = [Barrier() for _ in range(stages)]
    empty = [Barrier() for _ in range(stages)]
    slots = [None] * stages
    log = []
    actors = [producer(tiles, stages, full, empty, slots, log),
              consumer(tiles, stages, full, empty, slots, log)]
    alive = list(actors)
    steps = 0
    while alive:
        a = rng.choice(alive)
        try:
            next(a)
        except StopIteration:
            alive.remove(a)
        steps += 1
        assert steps < 100000, f"deadlock: tiles {tiles}"
    assert all(x is None for x in slots)
    assert sum(1 for e in log if e[0] == "fill") == sum(tiles)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3000)
    args = ap.parse_args()
    rng = random.Random(1)
    for stages in (2, 3, 4):
        for _ in range(args.trials):
            trial(rng, stages)
    print(f"ring protocol: {3 * args.trials} random schedules, stages 2-4: OK")


if __name__ == "__main__":
    main()
