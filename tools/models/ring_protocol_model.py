#!/usr/bin/env python3
"""Model check of the sm_90a attention kernel's work protocol (flash_attn_fwd_sm90.cu and
its fm90_scheduler / fm90_producer / fm90_mainloop headers):
the rank dispenser shared by the CTAs of a launch (drawn early, reset by the last CTA),
each CTA's two work-tile records under the q_full / q_empty barriers, and its K/V ring
(SlotPhases: per-slot full/empty mbarriers with parity waits, every work tile from slot 0),
with the K and V halves of a slot under their own barriers.

Per CTA one producer and NCW consumer warpgroups (2 or 3 per trial), each its own role.
Barriers have arrival counts as the kernel initialises them: q_full and the slots' full
barriers 1 (the producer), q_empty and the slots' empty barriers NCW (one arrival per
consumer warpgroup standing for its 128 threads / 4 warps); K and V of a slot each have
their pair (k_full/k_empty, v_full/v_empty). The producer issues K and V of each key
tile in turn (producer_order); a computing consumer follows the kernel's pipeline:
per key tile it waits K, releases K after S, waits V, and releases V of the key tile
before (its P V completes in this iteration); V of the last one after the final P V.
Every arrival names the use it releases (the arriver's own count of its
uses of that barrier) and must land in the phase in progress, so an early arrival mixing
into an earlier phase is caught. Per work tile, a random number of trailing warpgroups
(0..NCW-1, drawn with the tile costs) have no query row and take pass_tile: they release
Q at once and each slot right after its full wait. The others consume(): they first pass a
random number of leading key tiles the same way (the causal skip of key tiles past their
last row; all of them at times, and then they release Q at once), then release each slot
after reading it, and Q either at the tile start (FM_Q_REGS, drawn per trial) or after the
last S. Random grids, work tile costs (0 key tiles included) and interleavings;
two launches per dispenser. Not modelled: the ping-pong turns (named barriers).

Asserts that every rank is done exactly once by every consumer, that each consumer (idle
ones included) sees exactly the key tile the producer wrote for it and, while it reads Q
from shared memory, the Q tile of its rank; that no slot or posted tile is overwritten
before every consumer released / read it; that no arrival falls into the wrong phase; that
every barrier ends the launch with no partial phase and the dispenser back at zero; and
no deadlock (every live role spinning on a wait).

At the end, mutation self-tests: deliberately broken variants of the protocol, each of
which the model must catch (an assertion or a deadlock); one line per mutation.

  python3 tools/models/ring_protocol_model.py [--trials N] [--no-mutations]
"""
import argparse
import random
import sys
import time

WAIT = "wait"  # yielded by a role whose step was only a failed re-check of a wait


def spin(cond):
    """Wait until cond() holds. The first failed check yields as a normal step (the step
    that reached the wait may have changed state before it); every later failed check
    yields WAIT: a step that changed nothing, which the scheduler's deadlock check counts."""
    if cond():
        return
    yield
    while not cond():
        yield WAIT


class Barrier:
    """mbarrier reduced to its completed phases and the arrivals of the phase in progress:
    a phase completes after `count` arrivals."""

    def __init__(self, count=1):
        self.count, self.phase, self.pending = count, 0, 0

    def arrive(self, use):
        # `use`: the phase the arriver means to complete (its own count of earlier uses).
        # Hardware counts any arrival into the phase in progress; one meant for another
        # phase would complete that phase early or late, so the model rejects it.
        assert use == self.phase, f"arrival for phase {use} while phase {self.phase} is in progress"
        self.pending += 1
        if self.pending == self.count:
            self.phase, self.pending = self.phase + 1, 0

    def done(self, parity):
        # try_wait.parity(P) succeeds once the phase of parity P has completed; the waiters
        # also assert the exact phase number, so none falls two phases behind unnoticed.
        return self.phase % 2 != parity


class SlotPhases:
    """The kernel's per-thread ring state: per slot, parity of its uses and whether used."""

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


HALVES = ("K", "V")


def producer_order(n):
    """The order the producer issues the key tiles' halves: K(0), V(0), K(1), V(1), ..
    (A K-one-ahead order, K(0), K(1), V(0), K(2), V(1), .., also passes; it measured
    no faster on the H100, docs/design/attention-prefill-sm90.md.)"""
    return [(h, i) for i in range(n) for h in HALVES]


class Cta:
    """One CTA's shared state: Q barriers, the posted work tile, the K/V ring."""

    def __init__(self, stages, ncw, bug):
        self.ncw, self.bug = ncw, bug
        self.q_full, self.q_empty = Barrier(1), Barrier(ncw)  # q_empty: NCW * 128 threads
        # The two work-tile records, used in turn: (rank, n key tiles, n idle consumers,
        # skips) or "end"; and per record the consumers that have not read it yet.
        self.records = [None, None]
        self.unread = [set(), set()]
        self.q = None  # the rank whose Q tile is in shared memory
        n_empty = ncw - 1 if bug == "empty_count" else ncw  # k/v_empty: NCW * 4 warps
        # Per half ("K", "V") of the ring slots:
        self.full = {h: [Barrier(1) for _ in range(stages)] for h in HALVES}
        self.empty = {h: [Barrier(n_empty) for _ in range(stages)] for h in HALVES}
        # (rank, key step) as written; None once every consumer released it
        self.slots = {h: [None] * stages for h in HALVES}
        # consumers that still have to release the half-slot
        self.holders = {h: [set() for _ in range(stages)] for h in HALVES}


def producer(tiles, grid, disp, cta, stages):
    """The kernel's Producer: tile i's record is written during tile i - 1 (once that
    tile's loads fill the ring, or after its last key tile; at once for a tile of no key
    tile), and after a tile's last V the next tile's first K is loaded ahead of the wait
    for Q's release (k0_loaded)."""
    ring = SlotPhases(stages)
    uses = {h: [0] * stages for h in HALVES}  # model only: writes of each half-slot (use index)
    bug = cta.bug

    def post(i, rank):  # decode rank into work-tile record i % 2
        r = (i & 1) if bug != "one_record" else 0
        assert not cta.unread[r], \
            f"work tile {cta.records[r]} overwritten before consumers {cta.unread[r]} read it"
        cta.unread[r] = set(range(cta.ncw))
        cta.records[r] = "end" if rank >= len(tiles) else (rank, *tiles[rank])

    def load(h, it, rank_now):  # half h of key tile it of rank_now into its ring slot
        s, rnd = it % stages, it // stages  # every work tile starts at slot 0
        u = uses[h][s]
        assert ring.parity(s, rnd) == u & 1 and bool(ring.reused(s, rnd)) == (u > 0)
        if ring.reused(s, rnd):
            yield from spin(lambda: cta.empty[h][s].done(ring.parity(s, rnd) ^ 1))
            assert cta.empty[h][s].phase == u, \
                f"{h} slot {s}: use {u} written at empty phase {cta.empty[h][s].phase}"
        assert cta.slots[h][s] is None and not cta.holders[h][s], \
            f"{h} slot {s} overwritten before release (holds {cta.slots[h][s]}, consumers {cta.holders[h][s]})"
        cta.slots[h][s] = (rank_now, it)
        cta.holders[h][s] = set(range(cta.ncw))
        cta.full[h][s].arrive(u)
        uses[h][s] += 1
        yield

    rank = disp.draw()
    yield
    post(0, rank)
    k0_loaded = False
    i = 0  # work tiles posted (the q_full / q_empty use index)
    while True:
        if bug == "record_early" and i > 0:
            post(i + 1, len(tiles))  # the next record written before Q's release
        if i > 0:
            yield from spin(lambda: cta.q_empty.done((i - 1) & 1))
            assert cta.q_empty.phase == i, "producer: Q released for the wrong tile"
        tile = cta.records[(i & 1) if bug != "one_record" else 0]
        if tile == "end":
            cta.q_full.arrive(i)
            yield
            disp.leave(grid)
            return
        rank_now, n = tile[0], tile[1]
        rank = disp.draw()  # drawn early, as the kernel does
        yield
        if n == 0:
            post(i + 1, rank)
            k0_loaded = False
            cta.q_full.arrive(i)
            i += 1
            yield
            continue
        cta.q = rank_now  # the Q load of this tile (lands before q_full completes)
        cta.q_full.arrive(i)
        yield
        for h, it in producer_order(n):
            if not (h == "K" and it == 0 and k0_loaded):
                yield from load(h, it, rank_now)
            if h == "V" and it == min(stages - 1, n - 1):  # the ring is full
                post(i + 1, rank)
                yield
        ring.advance(n)
        nxt = cta.records[((i + 1) & 1) if bug != "one_record" else 0]
        k0_loaded = nxt != "end" and nxt[1] > 0
        if k0_loaded:
            yield from load("K", 0, nxt[0])
        i += 1


def read_slot(cta, h, s, c, rank, it):
    """Consumer c reads half h of slot s (or, idle, only checks it is its use of it)."""
    assert c in cta.holders[h][s], f"consumer {c} reads {h} slot {s} after releasing it"
    assert cta.slots[h][s] == (rank, it), \
        f"consumer {c}: rank {rank} step {it} read {cta.slots[h][s]} from {h} slot {s}"


def release_slot(cta, h, s, c, use):
    """Consumer c's arrival on the empty barrier of half h of slot s (k_empty / v_empty)."""
    assert c in cta.holders[h][s], f"consumer {c} releases {h} slot {s} it does not hold (use {use})"
    cta.holders[h][s].remove(c)
    if not cta.holders[h][s]:
        cta.slots[h][s] = None  # the last consumer to release it frees the half-slot
    cta.empty[h][s].arrive(use)


def consumer(c, cta, stages, q_regs, done, bug):
    """Consumer warpgroup c: consume() on its rows, or pass_tile() when it has none.
    bug: None, or a mutation of MUTATIONS (the self-tests)."""
    ring = SlotPhases(stages)
    uses = {h: [0] * stages for h in HALVES}  # model only: this consumer's uses of each half-slot
    i = 0  # work tiles read (the q_full / q_empty use index)
    while True:
        yield from spin(lambda: cta.q_full.done(i & 1))
        assert (cta.q_full.phase, cta.q_empty.phase) == (i + 1, i), \
            f"consumer {c} at tile {i}: q_full phase {cta.q_full.phase}, q_empty phase {cta.q_empty.phase}"
        r = (i & 1) if bug != "one_record" else 0
        tile = cta.records[r]
        assert c in cta.unread[r], f"consumer {c} at tile {i} reads record {r} a second time"
        cta.unread[r].remove(c)
        if tile == "end":
            return
        rank, n, n_idle, skips = tile
        done.append((rank, c))
        # The warpgroups with no query row: trailing ones past Sq (n_idle > 0), or, in a
        # causal first block that starts below row 0, leading ones (n_idle < 0).
        idle = c >= cta.ncw - n_idle if n_idle >= 0 else c < -n_idle
        # Leading key tiles this warpgroup passes without computing: all of them with no
        # row (pass_tile), else those past its last row's causal limit (consume's skip).
        passed = n if idle else skips[c]
        # Q: released at once by pass_tile, by a warpgroup that computes no key tile, with
        # FM_Q_REGS (Q into registers), and when the tile loaded no Q; else after the last S.
        if n == 0 or q_regs or passed == n or bug == "q_early":
            if not (idle and bug == "idle_no_q"):
                cta.q_empty.arrive(i)
            if idle and bug == "idle_q_twice":
                cta.q_empty.arrive(i)
        if passed < n and q_regs:
            assert cta.q == rank, f"consumer {c} rank {rank}: Q of rank {cta.q} loaded into registers"
        yield

        def wait_full(h, it):  # the full wait of half h of key tile it
            s, rnd = it % stages, it // stages
            u = uses[h][s]
            assert ring.parity(s, rnd) == u & 1
            yield from spin(lambda: cta.full[h][s].done(ring.parity(s, rnd)))
            assert cta.full[h][s].phase == u + 1, \
                f"consumer {c}: {h} slot {s} use {u} at full phase {cta.full[h][s].phase}"

        def release(h, it):  # read (the GEMM completes), then release half h of key tile it
            s = it % stages
            read_slot(cta, h, s, c, rank, it)
            release_slot(cta, h, s, c, uses[h][s])
            uses[h][s] += 1

        for it in range(passed):  # pass_key_tile: each half released as soon as it is full
            if bug == "idle_release_early":  # K released before its full wait
                release_slot(cta, "K", it % stages, c, uses["K"][it % stages])
                uses["K"][it % stages] += 1
            yield from wait_full("K", it)
            if bug == "idle_skip_slot" and it == 0:
                uses["K"][0] += 1  # counted as used, never released
            elif bug != "idle_release_early":
                release("K", it)
            yield from wait_full("V", it)
            release("V", it)
            yield
        for it in range(passed, n):  # consume(): the pipelined loop (prologue at it == passed)
            yield from wait_full("K", it)
            if not q_regs:
                assert cta.q == rank, f"consumer {c} rank {rank} step {it}: Q of rank {cta.q} in shared memory"
            yield  # S = Q K^T of key tile it (with P V of it - 1 in flight)
            release("K", it)
            if it == n - 1 and ((not q_regs and bug != "q_early") or bug == "q_twice"):
                cta.q_empty.arrive(i)  # last S of this work tile: Q and the posted tile are free
            yield from wait_full("V", it)
            if bug == "v_release_early":  # before the P V of the next iteration has read it
                release_slot(cta, "V", it % stages, c, uses["V"][it % stages])
            if it > passed:
                release("V", it - 1)  # P V of key tile it - 1 completed
            yield  # softmax of key tile it
        if passed < n:
            release("V", n - 1)  # the final P V
        ring.advance(n)
        i += 1


def launch(rng, stages, ncw, q_regs, tiles, grid, disp, bug):
    ctas = [Cta(stages, ncw, bug) for _ in range(grid)]
    done = []
    alive = []
    for cta in ctas:
        alive.append(producer(tiles, grid, disp, cta, stages))
        alive += [consumer(c, cta, stages, q_regs, done, bug) for c in range(ncw)]
    blocked = set()  # roles whose last step was a failed re-check, with no progress since
    steps = 0
    while alive:
        a = rng.choice(alive)
        try:
            r = next(a)
        except StopIteration:
            alive.remove(a)
            r = None
        if r == WAIT:
            blocked.add(a)
            assert len(blocked) < len(alive), f"deadlock (every live role waits): grid {grid} ncw {ncw} tiles {tiles}"
        else:
            blocked.clear()
        steps += 1
        assert steps < 10 ** 6, f"livelock: tiles {tiles} grid {grid}"
    assert sorted(done) == [(r, c) for r in range(len(tiles)) for c in range(ncw)], \
        "a work tile was lost or done twice"
    for cta in ctas:
        for h in HALVES:
            assert all(x is None for x in cta.slots[h]) and not any(cta.holders[h]), \
                f"a {h} slot was never released"
            for f, e in zip(cta.full[h], cta.empty[h]):
                assert e.phase == f.phase and e.pending == 0 == f.pending, \
                    f"{h} slot barriers end at full {f.phase}, empty {e.phase} (+{e.pending} arrivals)"
        assert not any(cta.unread) and cta.q_full.pending == 0 == cta.q_empty.pending
        assert cta.q_empty.phase == cta.q_full.phase - 1, "a posted tile's Q was not released"
    assert (disp.next, disp.left) == (0, 0), "dispenser not reset"


def trial(rng, stages, bug=None):
    ncw = rng.choice((2, 3))  # FM_CONSUMERS
    q_regs = rng.random() < 0.5  # FM_Q_REGS
    disp = Dispenser()
    for _ in range(2):  # two launches on one dispenser: the reset must hold
        # Per rank: key tiles, how many trailing (> 0) or leading (< 0) consumers have no row
        # (pass_tile), and
        # per consumer the leading key tiles it passes (the causal skip; all of them at times).
        tiles = []
        for _ in range(rng.randint(0, 14)):
            n = rng.choice([0, 1, 1, 2, 3, 4, 5, 7, 8, 9])
            skips = tuple(rng.choice([0, 0, 1, 1, 2, n]) if n else 0 for _ in range(ncw))
            tiles.append((n, rng.randint(-(ncw - 1), ncw - 1), tuple(min(k, n) for k in skips)))
        launch(rng, stages, ncw, q_regs, tiles, rng.randint(1, 4), disp, bug)


MUTATIONS = [
    ("idle_release_early", "(a) idle consumer releases a slot before waiting its full barrier"),
    ("idle_q_twice", "(b) idle consumer releases Q twice"),
    ("idle_skip_slot", "(c) idle consumer skips the release of its first key tile's slot"),
    ("idle_no_q", "(d) idle consumer never releases Q"),
    ("q_twice", "(e) FM_Q_REGS consumer releases Q at the tile start and again after the last S"),
    ("q_early", "(f) consumer reading Q from shared memory releases it at the tile start"),
    ("empty_count", "(g) slot empty barriers count NCW-1 arrivals"),
    ("v_release_early", "(h) computing consumer releases V before its P V has read it"),
    ("one_record", "(i) one work-tile record: the next tile written while the current one is read"),
    ("record_early", "(j) the next tile's record written before the wait for Q's release"),
]


def mutations(max_trials=3000):
    """Each broken variant must fail (assertion or deadlock) within max_trials trials."""
    ok = True
    for bug, what in MUTATIONS:
        rng = random.Random(2)
        for t in range(1, max_trials + 1):
            try:
                trial(rng, rng.choice((2, 3, 4)), bug)
            except AssertionError as e:
                print(f"mutation {what}: caught after {t} trials ({(str(e) or repr(e)).splitlines()[0][:90]})")
                break
        else:
            print(f"mutation {what}: NOT caught in {max_trials} trials")
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3000, help="trials per ring depth (default 3000)")
    ap.add_argument("--no-mutations", action="store_true", help="skip the mutation self-tests")
    args = ap.parse_args()
    t0 = time.time()
    rng = random.Random(1)
    for stages in (2, 3, 4):
        for _ in range(args.trials):
            trial(rng, stages)
    print(f"work protocol: {3 * args.trials} random trials (2 launches each), stages 2-4, "
          f"2-3 consumers, idle consumers, passed key tiles, Q release at start or after the last S: OK "
          f"({time.time() - t0:.1f} s)")
    if not args.no_mutations and not mutations():
        sys.exit(1)


if __name__ == "__main__":
    main()
