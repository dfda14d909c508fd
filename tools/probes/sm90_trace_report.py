#!/usr/bin/env python3
"""Phase report of an sm_90a attention timeline (examples/sm90_trace.rs, FM_TRACE=1).

    python3 tools/probes/sm90_trace_report.py DIR/trace-128-1024-c0-bf16.bin [...]

Per consumer warpgroup and work tile (stamps are the SM's clock64, cycles):
  gap      previous tile's stores issued -> this tile readable (q_full)
  start    readable -> first computed K landed (Q fragments, the K wait)
  s0       first S issued and complete (nothing else of this warpgroup overlaps it)
  softmax0 its softmax (no P V of this warpgroup runs under it)
  v0       wait for its V
  loop     the pipelined iterations (S of tile i+1 with P V of tile i)
  last_pv  the final P V, issued and complete
  epilogue normalise, LSE, O stores issued
The share column is each phase's part of all traced warpgroup time; the fixed cost per
tile is tile cycles / loop-iteration cycles - key tiles computed (the b/a of a fit
time = a n + b, in key tiles).
Each CTA's first tile is left out (cold start). Producer: q_empty wait before each post,
and post -> first K issued (the wait for a free ring slot). Launch tail: the SM time left
idle after each CTA's last tile, against the CTA that ran longest (each span on its own SM's
clock, so launch skew between SMs is not in it).
"""
import json
import statistics
import sys
from pathlib import Path

EV = dict(POSTED=0, K0=1, S0=2, SOFTMAX0=3, V0=4, K1=5, LOOP_END=6, LAST_PV=7, EPILOGUE=8,
          N_TILES=9, N_VIS=10, Q_EMPTY=11)
PHASES = [("gap", None, "POSTED"), ("start", "POSTED", "K0"), ("s0", "K0", "S0"),
          ("softmax0", "S0", "SOFTMAX0"), ("v0", "SOFTMAX0", "V0"), ("loop", "V0", "LOOP_END"),
          ("last_pv", "LOOP_END", "LAST_PV"), ("epilogue", "LAST_PV", "EPILOGUE")]


def load(path):
    path = Path(path)
    head = json.loads(path.with_suffix(".json").read_text())
    raw = memoryview(path.read_bytes()).cast("q")
    c, w, t, e = head["ctas"], head["warpgroups"], head["tiles"], head["events"]
    assert len(raw) == c * w * t * e, "size does not match the header"

    def rec(cta, wg, tile):
        base = ((cta * w + wg) * t + tile) * e
        return raw[base:base + e]
    return head, rec


def report(path):
    head, rec = load(path)
    p = head["problem"]
    print(f"== {Path(path).name}: B={p['batch']} H={p['heads_q']} S={p['seqlen_q']} "
          f"D={p['head_dim']} causal={p['causal']} {p['dtype']}, grid {head['grid']}")
    sums = {name: 0 for name, _, _ in PHASES}
    per = {name: [] for name, _, _ in PHASES}
    iters, overhead, k1 = [], [], []
    by_n = {}
    passed = 0
    for cta in range(min(head["ctas"], head["grid"])):
        for wg in range(1, head["warpgroups"]):
            prev_end = None
            for tile in range(head["tiles"]):
                r = rec(cta, wg, tile)
                if r[EV["POSTED"]] == 0 or r[EV["EPILOGUE"]] == 0:
                    break
                end = r[EV["EPILOGUE"]]
                if r[EV["N_VIS"]] <= 0:
                    passed += 1
                    prev_end = end
                    continue
                if prev_end is None:  # the CTA's first tile: cold start
                    prev_end = end
                    continue
                n_vis = r[EV["N_VIS"]]
                d = {}
                for name, a, b in PHASES:
                    start = prev_end if a is None else r[EV[a]]
                    d[name] = r[EV[b]] - start
                tile_cycles = end - prev_end
                for name in d:
                    sums[name] += d[name]
                    per[name].append(d[name])
                if n_vis >= 2:
                    it = d["loop"] / (n_vis - 1)
                    iters.append(it)
                    overhead.append(tile_cycles / it - n_vis)
                    k1.append(r[EV["K1"]] - r[EV["V0"]])
                by_n.setdefault(n_vis, []).append(tile_cycles)
                prev_end = end
    total = sum(sums.values())
    if total == 0:
        print("   no complete consumer tiles traced")
        return
    print(f"   {'phase':9} {'median cyc':>10} {'mean cyc':>9} {'share':>6}")
    for name, _, _ in PHASES:
        v = per[name]
        print(f"   {name:9} {statistics.median(v):10.0f} {statistics.fmean(v):9.0f} "
              f"{100 * sums[name] / total:5.1f}%")
    if iters:
        print(f"   loop iteration: median {statistics.median(iters):.0f} cycles; fixed cost per "
              f"tile (tile / iteration - key tiles) median {statistics.median(overhead):.2f} iterations; "
              f"first V landed -> second K passed (pack of P, loop entry, the K wait) median {statistics.median(k1):.0f} cycles")
    print("   tile cycles by key tiles computed: " + ", ".join(
        f"n={n}: {statistics.median(v):.0f} ({len(v)})" for n, v in sorted(by_n.items())))
    if passed:
        print(f"   warpgroup-tiles passed (no row in range): {passed}")
    # Launch tail: each CTA's span (its SM's clock, first post to last stores) against the
    # longest; the mean gap is the share of SM time idle at the end of the launch.
    spans, counts = [], {}
    for cta in range(min(head["ctas"], head["grid"])):
        ends = [rec(cta, 1, i) for i in range(head["tiles"])]
        ends = [r for r in ends if r[EV["POSTED"]] and r[EV["EPILOGUE"]]]
        if ends:
            spans.append(ends[-1][EV["EPILOGUE"]] - ends[0][EV["POSTED"]])
            counts[len(ends)] = counts.get(len(ends), 0) + 1
    if spans and max(counts) < head["tiles"]:  # else some CTA ran more tiles than traced
        m = max(spans)
        print(f"   launch tail: work tiles per CTA {dict(sorted(counts.items()))}; SM time idle "
              f"after a CTA's last tile {100 * sum(m - x for x in spans) / (m * len(spans)):.1f}%")
    qe, k0 = [], []
    for cta in range(min(head["ctas"], head["grid"])):
        for tile in range(1, head["tiles"]):
            r = rec(cta, 0, tile)
            if r[EV["POSTED"]] == 0:
                break
            qe.append(r[EV["POSTED"]] - r[EV["Q_EMPTY"]])
            if r[EV["K0"]]:
                k0.append(r[EV["K0"]] - r[EV["POSTED"]])
    if qe:
        print(f"   producer: q_empty wait median {statistics.median(qe):.0f} cycles, "
              f"post -> first K issued median {statistics.median(k0) if k0 else 0:.0f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for f in sys.argv[1:]:
        report(f)
