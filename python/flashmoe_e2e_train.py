"""Training steps of the end-to-end models (`flashmoe bench e2e --train`, issue 34 part 4).

One training step is forward, next-token cross-entropy, backward and AdamW, over
`batch x seq` tokens; the models, the attention and MoE ops and the implementations are
`flashmoe_e2e_common`'s (shared with the inference driver `flashmoe_e2e`), so two
implementations differ only in their attention and MoE ops (and their backward passes).

Method:
- Every implementation starts from the same weights (copies of one bf16 initialisation) and
  sees the same data: a fixed cycle of DATA_BATCHES random-token batches, which the model
  memorises, so the loss falls and a wrong gradient shows as a different curve.
- The implementations step round-robin (A B C A B C ...) on one stream, so drift hits them
  alike; a step is timed with CUDA events (forward + backward + optimiser); every step after
  the warm-up is a sample (the statistics are the lab's: `flashmoe bench e2e --train`).
- Loss-curve gate: each implementation's per-step loss against the reference's (the first
  baseline that ran, eager where asked), max over the steps of |Δ| at most
  max(LOSS_FLOOR, LOSS_RELATIVE · loss) — the curves of two correct bf16 implementations
  drift apart by rounding alone, and the baselines' own deviations are reported beside it
  so the bound can be read against measured noise.
- Peak memory: the growth of `torch.cuda.max_memory_allocated` over one step above the
  parameters, gradients and optimiser state.
"""
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import flashmoe_e2e_common as e2e

DATA_BATCHES = 4
LEARNING_RATE = 1e-3
# Loss-curve gate (nats): absolute floor and relative part of the per-step bound.
LOSS_FLOOR = 0.05
LOSS_RELATIVE = 0.02


class Trainee:
    """One implementation's copy of the model: parameters, optimiser, and its forward."""

    def __init__(self, name, model, use_fused_adam):
        self.name = name
        self.params = {}
        self.layers = []
        for lw in model.layers:
            self.layers.append({k: self._param(f"l{len(self.layers)}.{k}", t) for k, t in lw.items()})
        self.embed = self._param("embed", model.embed)
        self.ln_f = self._param("ln_f", model.ln_f)
        self.lm_head = self._param("lm_head", model.lm_head)
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=LEARNING_RATE,
                                     fused=use_fused_adam)
        self.forward = e2e.build_impl(name, _Weights(model, self))

    def _param(self, key, t):
        p = torch.nn.Parameter(t.detach().clone())
        self.params[key] = p
        return p

    def step(self, ids):
        logits = self.forward(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes(self):
        n = 0
        for p in self.params.values():
            n += p.numel() * p.element_size()
            for s in self.opt.state.get(p, {}).values():
                if torch.is_tensor(s):
                    n += s.numel() * s.element_size()
        return n


class _Weights:
    """The attributes of `flashmoe_e2e_common.Model` that `model_forward` reads, pointing at a
    trainee's parameters (so `build_impl` builds the same forward over them)."""

    def __init__(self, model, trainee):
        self.name, self.cfg, self.dtype, self.device = model.name, model.cfg, model.dtype, model.device
        self.hidden, self.heads, self.kv_heads = model.hidden, model.heads, model.kv_heads
        self.head_dim, self.moe = model.head_dim, model.moe
        self.embed, self.ln_f, self.lm_head = trainee.embed, trainee.ln_f, trainee.lm_head
        self.layers = trainee.layers
        self.rope = model.rope


def data(model, batch, seq, seed):
    g = torch.Generator(device=model.device)
    g.manual_seed(seed + 104729 * batch + seq)
    return [torch.randint(0, e2e.VOCAB, (batch, seq), device=model.device, generator=g)
            for _ in range(DATA_BATCHES)]


def curve_gate(losses, ref):
    """Per-step bound on |loss - reference loss|; returns (max |Δ|, worst step, passed)."""
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan"), -1, False
    dev = np.abs(a - b)
    bound = np.maximum(LOSS_FLOOR, LOSS_RELATIVE * np.abs(b))
    worst = int(np.argmax(dev - bound))
    return float(dev.max()), worst, bool((dev <= bound).all())


def run_config(model, batch, seq, impls, args):
    device = model.device
    batches = data(model, batch, seq, args.seed)
    fused = device.type == "cuda"
    rows, live = {}, {}
    for name in impls:
        row = rows[name] = dict(name=name, status="ok", notes=[], samples_ms=[])
        try:
            live[name] = Trainee(name, model, fused)
        except e2e.NotApplicable as e:
            row.update(status="n/a", notes=[str(e)])
        except torch.cuda.OutOfMemoryError as e:
            row.update(status="oom", notes=[str(e).splitlines()[0]])
            torch.cuda.empty_cache()
    timer = e2e.Timer(device)
    t_start = time.perf_counter()
    losses = {n: [] for n in live}
    times = {n: [] for n in live}
    peak = {}
    for step in range(args.steps):
        ids = batches[step % DATA_BATCHES]
        for name in list(live):
            t = live[name]
            try:
                if step == args.warmup and device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    dt = timer(lambda: losses[name].append(t.step(ids)))
                    torch.cuda.synchronize()
                    peak[name] = int(torch.cuda.max_memory_allocated() - base)
                else:
                    dt = timer(lambda: losses[name].append(t.step(ids)))
                if step >= args.warmup:
                    times[name].append(dt * 1e3)
            except torch.cuda.OutOfMemoryError as e:
                rows[name].update(status="oom", notes=[str(e).splitlines()[0]])
            except Exception as e:  # noqa: BLE001 - reported per implementation, the run goes on
                msg = str(e).splitlines()[0] if str(e) else ""
                rows[name].update(status="error", notes=[f"{type(e).__name__}: {msg}"])
            if rows[name]["status"] != "ok":
                del live[name]
                losses.pop(name, None)
                times.pop(name, None)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    sampling_s = time.perf_counter() - t_start
    for name, t in live.items():
        r = rows[name]
        r["loss_curve"] = [float(x) for x in torch.stack(losses[name]).cpu()]
        r["state_bytes"] = t.state_bytes()
        r["peak_extra_bytes"] = peak.get(name)
        r["samples_ms"] = times[name]
    live.clear()
    ref_name = next((n for n in impls if n in e2e.BASELINES and "loss_curve" in rows[n]), None)
    if ref_name:
        ref = rows[ref_name]["loss_curve"]
        for name in impls:
            r = rows[name]
            if "loss_curve" not in r:
                continue
            dev, worst, ok = curve_gate(r["loss_curve"], ref)
            r["loss_worst_step"] = worst if worst >= 0 and name != ref_name else None
            if not ok:
                r["status"] = "failed-gate"
                r["notes"].insert(0,
                    f"loss curve off {ref_name}'s: |Δ| {dev:.3g} at step {worst} "
                    f"(bound max({LOSS_FLOOR}, {LOSS_RELATIVE}·loss))" if math.isfinite(dev)
                    else "non-finite loss")
        first, last = ref[0], float(np.mean(ref[-DATA_BATCHES:]))
        if not last < first - 0.5:
            for name in impls:
                rows[name]["notes"].append(
                    f"the reference loss fell only {first:.3f} → {last:.3f} nats: too few steps "
                    "for the curve to say much")
    else:
        for r in rows.values():
            if "loss_curve" in r:
                r["notes"].append("no baseline ran: loss curve not checked")
    return dict(model=model.name, shape=model.shape(), batch=batch, seq=seq,
                weight_bytes=model.weight_bytes(), rounds=max(args.steps - args.warmup, 0),
                sampling_s=sampling_s, loss_reference=ref_name,
                implementations=[rows[n] for n in impls])


def run(args, configs, device, dtype, impls, out_dir):
    """The --train run: every config, the samples file written after each; returns the exit
    code."""
    result = e2e.samples_header("train", args, device, dtype, dict(
        warmup=args.warmup, steps=args.steps, loss_floor=LOSS_FLOOR,
        loss_relative=LOSS_RELATIVE, lr=LEARNING_RATE))
    model = None
    for name, batch, seq in configs:
        if model is None or model.name != name:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = e2e.Model(name, e2e.MODELS[name], dtype, device, args.seed)
            e2e.log(f"model {name}: {model.weight_bytes() / 2**30:.2f} GiB of weights")
        c = run_config(model, batch, seq, impls, args)
        result["configs"].append(c)
        for r in c["implementations"]:
            e2e.log(f"  {name} b{batch} s{seq} {r['name']:>20}: {e2e.median_line(r, 'ms/step')} "
                    f"{'; '.join(r['notes'])}")
        e2e.write_samples(result, out_dir)
    e2e.log(f"wrote {e2e.write_samples(result, out_dir)}")
    failed = [(c["model"], r["name"]) for c in result["configs"] for r in c["implementations"]
              if r["status"] in ("failed-gate", "error")]
    if failed:
        e2e.log(f"FAILED: {failed}")
        return 1
    return 0
