"""Training steps of the end-to-end models (`flashmoe bench e2e --train`, issues 34 and 41).

One training step is forward, next-token cross-entropy, backward, gradient clipping and
AdamW, over `batch x seq` tokens; the models, the attention and MoE ops and the
implementations are `flashmoe_e2e_common`'s (shared with the inference driver
`flashmoe_e2e`), so two implementations differ only in their attention and MoE ops (and
their backward passes).

Method:
- Every implementation starts from the same weights (copies of one bf16 initialisation) and
  sees the same data: a fixed cycle of DATA_BATCHES random-token batches, which the model
  memorises, so the loss falls and a wrong gradient shows as a different curve. The recipe
  trains smoothly: a linear learning-rate warm-up over WARMUP_STEPS, the gradient norm
  clipped to CLIP_NORM.
- Memory: the implementations train in groups of as many as fit the GPU next to each other
  (parameters, gradients and AdamW's two moments, `alive_per_group`); inside a group they
  step round-robin (A B A B ...) on one stream, so drift hits them alike; a step is timed
  with CUDA events (forward + backward + optimiser); every step after the warm-up is a
  sample (the statistics are the lab's: `flashmoe bench e2e --train`). A group's curves do
  not depend on the grouping (each copy sees only its own state).
- Loss-curve gate against measured noise: the curves are averaged over a window of one pass
  over the data (WINDOW steps), which removes the batch-to-batch swing. The reference is
  the first baseline that ran; the noise floor is the windowed |Δ| between it and the
  second baseline that ran (two correct bf16 implementations from the same initialisation,
  in the same run), as a running maximum. An implementation passes when its windowed |Δ|
  against the reference stays within max(LOSS_FLOOR, NOISE_MULT × noise floor) at every
  step. Without a second baseline the bound is max(LOSS_FLOOR, LOSS_RELATIVE · loss) and a
  note says the noise was not measured. `planted-wrong-dk` (the attention's dK dropped) is
  the check that the gate fails a wrong gradient.
- Peak memory: the growth of `torch.cuda.max_memory_allocated` over one step above the
  parameters, gradients and optimiser state.
"""
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import flashmoe_e2e_common as e2e

DATA_BATCHES = 16
WINDOW = DATA_BATCHES
LEARNING_RATE = 1e-3
WARMUP_STEPS = 10
CLIP_NORM = 1.0
# Loss-curve gate (nats): the bound's floor, the multiple of the measured noise floor, and
# the relative bound used when no second baseline measured the noise.
LOSS_FLOOR = 0.02
NOISE_MULT = 4.0
LOSS_RELATIVE = 0.02
# Bytes of training state per parameter byte: the parameter, its gradient and AdamW's two
# moments (the parameter's dtype), plus a quarter for activations.
STATE_FACTOR = 5.0
# Fraction of the free GPU memory the live copies may take.
MEMORY_SHARE = 0.8


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
        self.steps = 0
        self.forward = e2e.build_impl(name, _Weights(model, self))

    def _param(self, key, t):
        p = torch.nn.Parameter(t.detach().clone())
        self.params[key] = p
        return p

    def step(self, ids):
        for g in self.opt.param_groups:  # linear warm-up
            g["lr"] = LEARNING_RATE * min(1.0, (self.steps + 1) / WARMUP_STEPS)
        logits = self.forward(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), CLIP_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
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


def windowed(curve, w):
    """Mean over each window of w consecutive steps (one value per full window)."""
    a = np.asarray(curve, dtype=np.float64)
    return np.convolve(a, np.ones(w) / w, mode="valid")


def window_for(steps):
    return max(1, min(WINDOW, steps // 2))


def noise_floor(ref, other, w):
    """Running maximum of the windowed |Δ| between two correct implementations."""
    return np.maximum.accumulate(np.abs(windowed(ref, w) - windowed(other, w)))


def curve_gate(losses, ref, noise, w):
    """Windowed |loss - reference loss| against its bound; returns (max |Δ|, the step that
    ends the worst window, its bound, passed). `noise`: noise_floor(...) or None."""
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan"), -1, float("nan"), False
    dev = np.abs(windowed(a, w) - windowed(b, w))
    if noise is not None:
        bound = np.maximum(LOSS_FLOOR, NOISE_MULT * noise)
    else:
        bound = np.maximum(LOSS_FLOOR, LOSS_RELATIVE * np.abs(windowed(b, w)))
    worst = int(np.argmax(dev - bound))
    return float(dev.max()), worst + w - 1, float(bound[worst]), bool((dev <= bound).all())


def alive_per_group(model, n, device):
    """How many implementations' copies fit the GPU at once (all of them on the CPU)."""
    if device.type != "cuda":
        return n
    free, _ = torch.cuda.mem_get_info()
    per = STATE_FACTOR * model.weight_bytes()
    return max(1, min(n, int(MEMORY_SHARE * free // per)))


def train_group(model, names, batches, args, rows):
    """Trains the implementations `names` round-robin; fills their rows."""
    device = model.device
    fused = device.type == "cuda"
    live = {}
    for name in names:
        try:
            live[name] = Trainee(name, model, fused)
        except e2e.NotApplicable as e:
            rows[name].update(status="n/a", notes=[str(e)])
        except torch.cuda.OutOfMemoryError as e:
            rows[name].update(status="oom", notes=[str(e).splitlines()[0]])
            torch.cuda.empty_cache()
    timer = e2e.Timer(device)
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
    for name, t in live.items():
        r = rows[name]
        r["loss_curve"] = [float(x) for x in torch.stack(losses[name]).cpu()]
        r["state_bytes"] = t.state_bytes()
        r["peak_extra_bytes"] = peak.get(name)
        r["samples_ms"] = times[name]
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_config(model, batch, seq, impls, args):
    batches = data(model, batch, seq, args.seed)
    rows = {name: dict(name=name, status="ok", notes=[], samples_ms=[]) for name in impls}
    # The two baselines that measure the noise floor train first (and together, memory
    # permitting); the rest follow in the order asked.
    order = sorted(impls, key=lambda n: n not in e2e.BASELINES)
    alive = alive_per_group(model, len(order), model.device)
    groups = [order[i:i + alive] for i in range(0, len(order), alive)]
    t_start = time.perf_counter()
    for gi, names in enumerate(groups):
        train_group(model, names, batches, args, rows)
        if len(groups) > 1:
            for name in names:
                rows[name]["notes"].append(
                    f"trained in group {gi + 1} of {len(groups)} ({alive} copies fit the GPU)")
    sampling_s = time.perf_counter() - t_start
    ran = [n for n in impls if n in e2e.BASELINES and "loss_curve" in rows[n]]
    ref_name = ran[0] if ran else None
    noise_name = ran[1] if len(ran) > 1 else None
    w = window_for(args.steps)
    noise = None
    if ref_name:
        ref = rows[ref_name]["loss_curve"]
        if noise_name:
            noise = noise_floor(ref, rows[noise_name]["loss_curve"], w)
        for name in impls:
            r = rows[name]
            if "loss_curve" not in r:
                continue
            dev, worst, bound, ok = curve_gate(r["loss_curve"], ref, noise, w)
            r["loss_worst_step"] = worst if worst >= 0 and name != ref_name else None
            if not ok:
                r["status"] = "failed-gate"
                r["notes"].insert(0,
                    f"loss curve off {ref_name}'s: windowed |Δ| {dev:.3g} (bound {bound:.3g} "
                    f"at step {worst})" if math.isfinite(dev) else "non-finite loss")
            elif name == e2e.PLANTED:
                r["notes"].insert(0, "the gate passed a planted wrong gradient (dK dropped): "
                                     f"windowed |Δ| {dev:.3g} within {bound:.3g}")
            if noise is None:
                r["notes"].append("noise floor not measured (one baseline ran): bound "
                                  f"max({LOSS_FLOOR}, {LOSS_RELATIVE}·loss)")
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
                sampling_s=sampling_s, loss_reference=ref_name, loss_noise_partner=noise_name,
                loss_window=w,
                loss_noise_floor=None if noise is None else [float(x) for x in noise],
                groups=[list(g) for g in groups],
                implementations=[rows[n] for n in impls])


def run(args, configs, device, dtype, impls, out_dir):
    """The --train run: every config, the samples file written after each; returns the exit
    code."""
    result = e2e.samples_header("train", args, device, dtype, dict(
        warmup=args.warmup, steps=args.steps, loss_floor=LOSS_FLOOR,
        loss_relative=LOSS_RELATIVE, noise_mult=NOISE_MULT, lr=LEARNING_RATE,
        lr_warmup_steps=WARMUP_STEPS, clip_norm=CLIP_NORM, data_batches=DATA_BATCHES))
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
    # Failed: an error, a gate failure, or the planted wrong gradient passing the gate.
    failed = [(c["model"], r["name"]) for c in result["configs"] for r in c["implementations"]
              if r["status"] == "error"
              or (r["status"] in ("ok", "failed-gate")
                  and (r["status"] == "failed-gate") != (r["name"] == e2e.PLANTED))]
    if failed:
        e2e.log(f"FAILED: {failed}")
        return 1
    return 0
