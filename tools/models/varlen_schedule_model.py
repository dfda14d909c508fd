#!/usr/bin/env python3
"""Model check of the varlen work-tile enumeration of the sm_90a kernel
(kernels/attention/prefill/fm90_scheduler.cuh: VarlenCursor, varlen_pass, decode_varlen), run on the CPU.

Random packed batches (empty sequences, sk = 0, tile edges, long sequences, malformed
offsets past the tensors) and random grids: CTAs draw ranks from one shared counter in a
random interleaving, each decoding with its own cursor, as the persistent kernel does.
Checks that every (sequence, query block, head) tile is handed out exactly once, that
every CTA ends with "no work left", and that the passes come out longest first.

  python3 tools/models/varlen_schedule_model.py [trials]
"""
import random
import sys

BM, BN, PASSES = 128, 128, 6  # D=128 tile; VARLEN_PASSES


def seq_rows(cu, b, total):
    start = min(max(cu[b], 0), total)
    return start, min(max(cu[b + 1], start), total)


def varlen_pass(sk):
    kt = max(1, (sk + BN - 1) // BN)
    return max(0, PASSES - 1 - (kt.bit_length() - 1))


class Cursor:
    def __init__(self):
        self.b, self.pss, self.base, self.n = -1, 0, 0, 0


def decode_varlen(rank, c, cu_q, cu_k, batch, heads, total_q, total_k):
    while rank >= c.base + c.n:
        if c.pss >= PASSES:
            return None
        c.base += c.n
        c.n = 0
        c.b += 1
        if c.b == batch:
            c.b, c.pss = -1, c.pss + 1
            continue
        k = seq_rows(cu_k, c.b, total_k)
        if varlen_pass(k[1] - k[0]) != c.pss:
            continue
        q = seq_rows(cu_q, c.b, total_q)
        c.n = (q[1] - q[0] + BM - 1) // BM * heads
    r = rank - c.base
    return c.b, r // heads, r % heads


def trial(rng):
    batch, heads, grid = rng.randint(1, 40), rng.randint(1, 5), rng.randint(1, 9)
    lq = [rng.choice([0, 1, 63, 64, 65, 127, 128, 129, rng.randint(0, 9000)]) for _ in range(batch)]
    lk = [rng.choice([n, rng.randint(0, 9000), 0]) for n in lq]
    cu_q, cu_k = [0], [0]
    for a, b in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    total_q, total_k = cu_q[-1], cu_k[-1]
    if rng.random() < 0.2:  # offsets past the tensors: clamped, sequences shortened
        total_q, total_k = rng.randint(0, total_q), rng.randint(0, total_k)
    rows = [seq_rows(cu_q, b, total_q)[1] - seq_rows(cu_q, b, total_q)[0] for b in range(batch)]
    keys = [seq_rows(cu_k, b, total_k)[1] - seq_rows(cu_k, b, total_k)[0] for b in range(batch)]
    cursors = [Cursor() for _ in range(grid)]
    done, seen, passes, nxt = [False] * grid, [], [], 0
    while not all(done):
        g = rng.randrange(grid)
        if done[g]:
            continue
        w = decode_varlen(nxt, cursors[g], cu_q, cu_k, batch, heads, total_q, total_k)
        nxt += 1
        if w is None:
            done[g] = True
        else:
            seen.append(w)
            passes.append(varlen_pass(keys[w[0]]))
    want = {(b, mb, h) for b in range(batch) for mb in range((rows[b] + BM - 1) // BM) for h in range(heads)}
    assert len(seen) == len(set(seen)), "a tile was handed out twice"
    assert set(seen) == want, "tiles missing or invented"
    assert passes == sorted(passes), "passes out of order"


def main():
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rng = random.Random(22)
    for _ in range(trials):
        trial(rng)
    print(f"varlen schedule model: {trials} batches, every tile once, longest first: ok")


if __name__ == "__main__":
    main()
