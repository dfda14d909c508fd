#!/usr/bin/env python3
"""Exhaustive model of the merge of a split work tile's two parts (merge_split in
crates/flashmoe/kernels/attention/prefill/fm90_epilogue.cuh, docs/design/attention-prefill-sm90.md).

Each part of a cut tile (one consumer warp per part; lane 0's view) runs, at its end:
    t = atomicAdd(ticket, 1)
    t == 0: store the partial (data), st.release ready = 1, store nothing else
    t == 1: spin until ld.acquire ready == 1, read data, merge, write O; ticket = 0, ready = 0
Every interleaving of the two parts is explored, and also the two sequential orders (one
CTA may draw both slots, running one part to the end before the other starts), over two
stream-ordered launches sharing the records. Checked: no deadlock, exactly one part writes
O and it holds both partials, and the record is zero again after each launch.

    python3 tools/models/split_merge_model.py            # the kernel's protocol: passes
    python3 tools/models/split_merge_model.py --mutants  # each mutation must fail
"""
import sys

PROTOCOLS = {
    # The kernel's: the ticket picks who merges; the second waits only for a part that
    # has already taken its ticket (and is storing).
    "kernel": dict(fixed_roles=False, reset_early=False, keep_ready=False),
    # Mutations, each must fail:
    # part 0 always merges and waits for part 1: deadlocks when part 0 runs first, alone.
    "fixed_roles": dict(fixed_roles=True, reset_early=False, keep_ready=False),
    # the second clears ready before it reads the partial: reads nothing published.
    "reset_early": dict(fixed_roles=False, reset_early=True, keep_ready=False),
    # the second forgets to clear ready: the next launch's second part reads a stale flag.
    "keep_ready": dict(fixed_roles=False, reset_early=False, keep_ready=True),
}


def step(part, local, shared, p):
    """One atomic step of `part`. Returns (new local, new shared, output or None) or None if
    the part is blocked (spinning)."""
    pc = local["pc"]
    sh = dict(shared)
    lo = dict(local)
    out = None
    if pc == 0:  # the ticket
        if p["fixed_roles"]:
            lo["first"] = part == 1
        else:
            lo["first"] = sh["ticket"] == 0
            sh["ticket"] += 1
        lo["pc"] = 1
    elif pc == 1:
        if lo["first"]:  # publish: data, then the release of ready
            sh["data"] = lo["value"]
            lo["pc"] = 2
        else:
            if p["reset_early"]:
                sh["ready"] = 0
                lo["pc"] = 3
            elif sh["ready"] == 1:  # acquire
                lo["pc"] = 3
            else:
                return None  # spinning
    elif pc == 2:
        sh["ready"] = 1
        lo["pc"] = 9  # done, stored nothing
    elif pc == 3:  # read the partial, merge, write O
        out = tuple(sorted((lo["value"], str(sh["data"]))))
        lo["pc"] = 4
    elif pc == 4:  # reset the record
        sh["ticket"] = 0
        if not p["keep_ready"] and not p["reset_early"]:
            sh["ready"] = 0
        sh["data"] = None
        lo["pc"] = 9
    return lo, sh, out


def explore(p, order, shared, launch):
    """All schedules of one launch: order None = interleaved, else the parts run one after
    the other in that order. Returns (errors, set of end shared states)."""
    errors, ends = [], set()
    start = ({"pc": 0, "value": f"L{launch}P0"}, {"pc": 0, "value": f"L{launch}P1"})
    stack = [(start, tuple(sorted(shared.items())), ())]
    seen = set()
    while stack:
        locs, sh_items, outs = stack.pop()
        key = (tuple(tuple(sorted(x.items())) for x in locs), sh_items, outs)
        if key in seen:
            continue
        seen.add(key)
        sh = dict(sh_items)
        if all(lo["pc"] == 9 for lo in locs):
            want = (tuple(sorted((f"L{launch}P0", f"L{launch}P1"))),)
            if outs != want:
                errors.append(f"launch {launch}: outputs {outs}, want {want}")
            ends.add(sh_items)
            continue
        runnable = [0, 1] if order is None else [next(i for i in order if locs[i]["pc"] != 9)]
        moved = False
        for i in runnable:
            if locs[i]["pc"] == 9:
                continue
            r = step(i, locs[i], sh, p)
            if r is None:
                continue
            lo, nsh, out = r
            nl = list(locs)
            nl[i] = lo
            stack.append((tuple(nl), tuple(sorted(nsh.items())), outs + ((out,) if out else ())))
            moved = True
        if not moved:
            errors.append(f"launch {launch}: deadlock at {[lo['pc'] for lo in locs]} with {sh}")
    return errors, ends


def check(name):
    p = PROTOCOLS[name]
    errors = []
    for order in (None, (0, 1), (1, 0)):
        states = {tuple(sorted(dict(ticket=0, ready=0, data=None).items()))}
        for launch in (1, 2):  # stream-ordered launches share the record
            nxt = set()
            for st in states:
                e, ends = explore(p, order, dict(st), launch)
                errors += [f"order {order or 'interleaved'}: {x}" for x in e]
                nxt |= ends
            for st in nxt:
                d = dict(st)
                if d["ticket"] != 0 or d["ready"] != 0:
                    errors.append(f"order {order or 'interleaved'}: launch {launch} left {d}")
            states = nxt
    return sorted(set(errors))


def main():
    names = [n for n in PROTOCOLS if n != "kernel"] if "--mutants" in sys.argv else ["kernel"]
    bad = 0
    for n in names:
        errors = check(n)
        want_fail = n != "kernel"
        ok = bool(errors) == want_fail
        bad += not ok
        print(f"{n}: {'FAILS' if errors else 'passes'} ({'as expected' if ok else 'UNEXPECTED'})")
        for e in errors[:3]:
            print(f"   {e}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
