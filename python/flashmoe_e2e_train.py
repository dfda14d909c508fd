"""Training steps of the end-to-end models (`flashmoe bench e2e --train`, issues 34 and 41).

One training step is forward, next-token cross-entropy, backward, gradient clipping and
AdamW, over `batch x seq` tokens; the models, the attention and MoE ops and the
implementations are `flashmoe_e2e_common`'s (shared with the inference driver
`flashmoe_e2e`), so two implementations differ only in their attention and MoE ops (and
their backward passes).

Method:
- Every implementation starts from the same weights (copies of one bf16 initialisation) and
  sees the same data: a fresh batch every step, each sequence a walk on one fixed random
  Markov chain over DATA_STATES tokens (DATA_BRANCHES successors each) whose first half
  repeats as its second, so the loss falls smoothly (states, then transitions, then the
  copy, which only attention can learn) instead of by memorising a few random batches. The
  recipe: AdamW at --lr (default LEARNING_RATE) after a linear warm-up over WARMUP_STEPS,
  the gradient norm clipped to CLIP_NORM.
- Memory: the implementations train in groups of as many as fit the GPU next to each other
  (parameters, gradients and AdamW's two moments, `alive_per_group`); inside a group they
  step round-robin (A B A B ...) on one stream, so drift hits them alike; a step is timed
  with CUDA events (forward + backward + optimiser); every step after the warm-up is a
  sample (the statistics are the lab's: `flashmoe bench e2e --train`). A group's curves do
  not depend on the grouping (each copy sees only its own state).
- Loss-curve gate against measured noise: the curves are averaged over a window of one pass
  over the data (WINDOW steps), which removes the batch-to-batch swing. The reference is
  the first baseline that ran; the noise floor is the largest windowed |Δ| over the run
  between it and the second baseline that ran (two correct bf16 implementations from the
  same initialisation, in the same run). An implementation passes when its windowed |Δ|
  against the reference stays within max(LOSS_FLOOR, NOISE_MULT × noise floor) at every
  step. The floor is one figure for the run, not a running maximum per step: when two
  correct implementations part is chance (measured on the H200, 24-layer model, 80 steps:
  SDPA flash parted from cuDNN at step 37 and reached 0.26 nats, flashmoe parted at step 27
  and reached 0.11; a per-step bound failed flashmoe at step 33). Without a second baseline
  the bound is max(LOSS_FLOOR, LOSS_RELATIVE · loss) and a note says the noise was not
  measured.
- Gradient probe: bf16 training is chaotic after a few dozen steps, so a loss curve alone
  cannot tell a wrong gradient from noise (measured: a model trained with dK dropped stays
  closer to the reference's curve than SDPA flash does). At the initial weights and at the
  reference's weights after its last step, every implementation's gradient on one held-out
  batch is compared with the reference implementation's at the same weights, per parameter
  tensor (rel L2); it passes within max(PROBE_FLOOR, NOISE_MULT × the noise partner's
  largest rel L2 over that tensor's kind: the same weight in every layer, e.g. every w13,
  since one tensor's noise is a noisy estimate (measured on the Qwen3-shaped stack: MoE
  weights' noise 0.01–0.03 from layer to layer, routing flips included)). `planted-wrong-dk` (the attention's dK dropped) is the check that the
  gates fail a wrong gradient.
- Peak memory: the growth of `torch.cuda.max_memory_allocated` over one step above the
  parameters, gradients and optimiser state.
"""
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import flashmoe_e2e_common as e2e

# The data: a Markov chain over DATA_STATES of the vocabulary's tokens, successor
# probabilities DATA_BRANCHES; each sequence's first half repeats as its second.
DATA_STATES = 4096
DATA_BRANCHES = (0.55, 0.25, 0.15, 0.05)
WINDOW = 16
# Measured on the H200 (80 steps, batch 4 × 512): at 1e-3 the 24-layer model's loss
# swings by ±1 and two correct torch backends part early; at 3e-4 every model's loss falls
# smoothly (10.9 to 2.8-3.8).
LEARNING_RATE = 3e-4
WARMUP_STEPS = 10
CLIP_NORM = 1.0
# Loss-curve gate (nats): the bound's floor, the multiple of the measured noise floor, and
# the relative bound used when no second baseline measured the noise.
LOSS_FLOOR = 0.02
NOISE_MULT = 4.0
LOSS_RELATIVE = 0.02
# Gradient probe: the rel-L2 floor of its per-tensor bound.
PROBE_FLOOR = 0.05
# Bytes of training state per parameter byte: the parameter, its gradient and AdamW's two
# moments (the parameter's dtype), plus a quarter for activations.
STATE_FACTOR = 5.0
# Fraction of the free GPU memory the live copies may take.
MEMORY_SHARE = 0.8


class Trainee:
    """One implementation's copy of the model: parameters, optimiser, and its forward."""

    def __init__(self, name, model, use_fused_adam, lr=LEARNING_RATE):
        self.name = name
        self.params = {}
        self.layers = []
        for lw in model.layers:
            self.layers.append({k: self._param(f"l{len(self.layers)}.{k}", t) for k, t in lw.items()})
        self.embed = self._param("embed", model.embed)
        self.ln_f = self._param("ln_f", model.ln_f)
        self.lm_head = self._param("lm_head", model.lm_head)
        self.lr = lr
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=lr, fused=use_fused_adam)
        self.steps = 0
        self.forward = e2e.build_impl(name, _Weights(model, self))

    def _param(self, key, t):
        p = torch.nn.Parameter(t.detach().clone())
        self.params[key] = p
        return p

    def step(self, ids):
        for g in self.opt.param_groups:  # linear warm-up
            g["lr"] = self.lr * min(1.0, (self.steps + 1) / WARMUP_STEPS)
        logits = self.forward(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), CLIP_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return loss.detach()

    def gradients(self, name, model, ids):
        """The gradient of the loss on `ids` at this copy's weights through implementation
        `name`'s forward and backward, per parameter (the optimiser is not stepped)."""
        forward = self.forward if name == self.name else e2e.build_impl(name, _Weights(model, self))
        logits = forward(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        grads = {k: p.grad for k, p in self.params.items()}
        for p in self.params.values():
            p.grad = None
        return grads

    def load(self, state):
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state[k])

    def snapshot(self):
        """The weights, copied to host memory."""
        return {k: p.detach().to("cpu", copy=True) for k, p in self.params.items()}

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


def data(model, batch, seq, count, seed):
    """`count` distinct batches (made on the host, so every device sees the same tokens):
    walks on one random Markov chain over DATA_STATES tokens, the first half of each
    sequence repeated as its second."""
    g = torch.Generator().manual_seed(seed + 104729 * batch + seq)
    tokens = torch.randperm(e2e.VOCAB, generator=g)[:DATA_STATES]
    successors = torch.randint(0, DATA_STATES, (DATA_STATES, len(DATA_BRANCHES)), generator=g)
    rows, half = count * batch, (seq + 1) // 2
    branch = torch.tensor(DATA_BRANCHES).expand(rows, -1).contiguous()
    walk = torch.empty(rows, half, dtype=torch.long)
    walk[:, 0] = torch.randint(0, DATA_STATES, (rows,), generator=g)
    for t in range(1, half):
        pick = torch.multinomial(branch, 1, replacement=True, generator=g)[:, 0]
        walk[:, t] = successors[walk[:, t - 1], pick]
    ids = tokens[torch.cat([walk, walk], 1)[:, :seq]]
    return list(ids.view(count, batch, seq).to(model.device).unbind(0))


def windowed(curve, w):
    """Mean over each window of w consecutive steps (one value per full window)."""
    a = np.asarray(curve, dtype=np.float64)
    return np.convolve(a, np.ones(w) / w, mode="valid")


def window_for(steps):
    return max(1, min(WINDOW, steps // 2))


def noise_floor(ref, other, w):
    """Largest windowed |Δ| over the run between two correct implementations."""
    return float(np.abs(windowed(ref, w) - windowed(other, w)).max())


def curve_gate(losses, ref, noise, w):
    """Windowed |loss - reference loss| against its bound; returns (|Δ| of the window
    closest to or furthest over its bound, the step that ends that window, its bound,
    passed). `noise`: noise_floor(...) or None."""
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan"), -1, float("nan"), False
    dev = np.abs(windowed(a, w) - windowed(b, w))
    if noise is not None:
        bound = np.full_like(dev, max(LOSS_FLOOR, NOISE_MULT * noise))
    else:
        bound = np.maximum(LOSS_FLOOR, LOSS_RELATIVE * np.abs(windowed(b, w)))
    worst = int(np.argmax(dev - bound))
    return float(dev[worst]), worst + w - 1, float(bound[worst]), bool((dev <= bound).all())


def alive_per_group(model, n, device):
    """How many implementations' copies fit the GPU at once (all of them on the CPU)."""
    if device.type != "cuda":
        return n
    free, _ = torch.cuda.mem_get_info()
    per = STATE_FACTOR * model.weight_bytes()
    return max(1, min(n, int(MEMORY_SHARE * free // per)))


def train_group(model, names, batches, args, rows, snapshot_of=None):
    """Trains the implementations `names` round-robin; fills their rows. Returns the weights
    of `snapshot_of` after its last step (host memory), or None."""
    device = model.device
    fused = device.type == "cuda"
    live = {}
    for name in names:
        try:
            live[name] = Trainee(name, model, fused, args.lr)
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
        ids = batches[step]
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
    snapshot = live[snapshot_of].snapshot() if snapshot_of in live else None
    for name, t in live.items():
        r = rows[name]
        r["loss_curve"] = [float(x) for x in torch.stack(losses[name]).cpu()]
        r["state_bytes"] = t.state_bytes()
        r["peak_extra_bytes"] = peak.get(name)
        r["samples_ms"] = times[name]
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return snapshot


def tensor_kind(key):
    """The weight a parameter key names, without its layer ("l3.w13" -> "w13")."""
    head, _, tail = key.partition(".")
    return tail if tail and head[:1] == "l" and head[1:].isdigit() else key


def routing_differences(model, log, ref_log):
    """Per MoE layer ("l5"), the tokens whose top-k expert set differs from the reference's
    in the probe's forward: routing flips (near ties parted by upstream rounding) move a
    token's gradient to another expert, which a wrong gradient does not explain."""
    moe_layers = [f"l{i}" for i, lw in enumerate(model.layers) if "router" in lw]
    if len(log) != len(moe_layers) or len(ref_log) != len(moe_layers):
        return {}
    return {layer: int((a.long().sort(-1).values != b.long().sort(-1).values).any(-1).sum())
            for layer, a, b in zip(moe_layers, log, ref_log)}


def gradient_probe(model, states, ids, names, ref_name, noise_name, args):
    """Every implementation in `names`' gradient on `ids` at each of `states` ((label,
    weights) pairs), against `ref_name`'s at the same weights: per implementation, a list of
    (label, worst tensor, its rel L2, its bound, passed)."""
    fused = model.device.type == "cuda"
    probe = Trainee(ref_name, model, fused, args.lr)
    out = {n: [] for n in names}
    for label, state in states:
        if state is not None:
            probe.load(state)
        with e2e.record_routing() as ref_routing:
            ref = probe.gradients(ref_name, model, ids)
        rel, routing = {}, {}
        for name in names:
            try:
                with e2e.record_routing() as log:
                    g = probe.gradients(name, model, ids)
                routing[name] = routing_differences(model, log, ref_routing)
            except Exception as e:  # noqa: BLE001 - reported per implementation
                msg = str(e).splitlines()[0] if str(e) else ""
                out[name].append(dict(state=label, error=f"{type(e).__name__}: {msg}",
                                      passed=False))
                continue
            rel[name] = {k: float((g[k].float() - ref[k].float()).norm()
                                  / ref[k].float().norm().clamp_min(1e-30)) for k in ref}
            del g
        noise = rel.get(noise_name)
        kind_noise = {}
        for k, v in (noise or {}).items():
            kind_noise[tensor_kind(k)] = max(kind_noise.get(tensor_kind(k), 0.0), v)
        for name in rel:
            bound = {k: max(PROBE_FLOOR, NOISE_MULT * kind_noise.get(tensor_kind(k), 0.0))
                     for k in ref}
            finite = all(math.isfinite(v) for v in rel[name].values())
            worst = max(rel[name], key=lambda k: rel[name][k] - bound[k]
                        if math.isfinite(rel[name][k]) else math.inf)
            out[name].append(dict(state=label, tensor=worst, rel_l2=rel[name][worst],
                                  bound=bound[worst],
                                  passed=finite and all(rel[name][k] <= bound[k] for k in ref),
                                  routing_differences=routing.get(name, {})))
        del ref
    del probe
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_config(model, batch, seq, impls, args):
    # One batch per step and a held-out one for the gradient probe.
    batches = data(model, batch, seq, args.steps + 1, args.seed)
    rows = {name: dict(name=name, status="ok", notes=[], samples_ms=[]) for name in impls}
    # The two baselines that measure the noise floor train first (and together, memory
    # permitting); the rest follow in the order asked.
    order = sorted(impls, key=lambda n: n not in e2e.BASELINES)
    alive = alive_per_group(model, len(order), model.device)
    groups = [order[i:i + alive] for i in range(0, len(order), alive)]
    t_start = time.perf_counter()
    probe_source = order[0] if order and order[0] in e2e.BASELINES else None
    final_weights = None
    for gi, names in enumerate(groups):
        snap = train_group(model, names, batches, args, rows, probe_source)
        final_weights = final_weights if snap is None else snap
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
        states = [("the initial weights", None)]
        if probe_source == ref_name and final_weights is not None:
            states.append((f"{ref_name}'s weights after step {args.steps}", final_weights))
        probed = [n for n in impls if "loss_curve" in rows[n] and n != ref_name]
        probes = gradient_probe(model, states, batches[-1], probed, ref_name, noise_name, args)
        for name in impls:
            r = rows[name]
            if "loss_curve" not in r:
                continue
            dev, worst, bound, ok = curve_gate(r["loss_curve"], ref, noise, w)
            r["loss_worst_step"] = worst if worst >= 0 and name != ref_name else None
            failures = []
            if not ok:
                failures.append(
                    f"loss curve off {ref_name}'s: windowed |Δ| {dev:.3g} (bound {bound:.3g} "
                    f"at step {worst})" if math.isfinite(dev) else "non-finite loss")
            r["grad_probe"] = probes.get(name, [])
            for p in r["grad_probe"]:
                if "error" in p:
                    failures.append(f"gradient probe at {p['state']}: {p['error']}")
                elif not p["passed"]:
                    flips = p.get("routing_differences", {}).get(p["tensor"].partition(".")[0])
                    failures.append(
                        f"gradient at {p['state']} off {ref_name}'s: {p['tensor']} rel L2 "
                        f"{p['rel_l2']:.3g} (bound {p['bound']:.3g})"
                        + ("" if flips is None else f", {flips} tokens routed differently there"))
            if failures:
                r["status"] = "failed-gate"
                r["notes"].insert(0, "; ".join(failures))
            elif name == e2e.PLANTED:
                r["notes"].insert(0, "the gates passed a planted wrong gradient (dK dropped): "
                                     f"windowed |Δ| {dev:.3g} within {bound:.3g}")
            if r["grad_probe"] and not failures:
                p = max(r["grad_probe"], key=lambda p: p["rel_l2"] / p["bound"])
                r["notes"].append(f"gradient probe: worst {p['tensor']} rel L2 "
                                  f"{p['rel_l2']:.3g} ≤ {p['bound']:.3g} at {p['state']}")
            if noise is None:
                r["notes"].append("noise floor not measured (one baseline ran): bound "
                                  f"max({LOSS_FLOOR}, {LOSS_RELATIVE}·loss)")
        first, last = ref[0], float(np.mean(ref[-w:]))
        if not last < first - 0.5:
            for name in impls:
                rows[name]["notes"].append(
                    f"the reference loss went only from {first:.3f} to {last:.3f} nats (mean of "
                    f"the last {w} steps): the curve says little")
    else:
        for r in rows.values():
            if "loss_curve" in r:
                r["notes"].append("no baseline ran: loss curve not checked")
    return dict(model=model.name, shape=model.shape(), batch=batch, seq=seq,
                weight_bytes=model.weight_bytes(), rounds=max(args.steps - args.warmup, 0),
                sampling_s=sampling_s, loss_reference=ref_name, loss_noise_partner=noise_name,
                loss_window=w,
                loss_noise_floor=noise,
                groups=[list(g) for g in groups],
                implementations=[rows[n] for n in impls])


def run(args, configs, device, dtype, impls, out_dir):
    """The --train run: every config, the samples file written after each; returns the exit
    code."""
    if args.lr is None:
        args.lr = LEARNING_RATE
    result = e2e.samples_header("train", args, device, dtype, dict(
        warmup=args.warmup, steps=args.steps, loss_floor=LOSS_FLOOR,
        loss_relative=LOSS_RELATIVE, noise_mult=NOISE_MULT, probe_floor=PROBE_FLOOR,
        lr=args.lr, lr_warmup_steps=WARMUP_STEPS, clip_norm=CLIP_NORM,
        data_states=DATA_STATES, data_branches=list(DATA_BRANCHES)))
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
