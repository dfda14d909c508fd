//! GPU tests of [`MoeBackwardPlan`]: every gradient (dx, d_router, dw13, dw2, the shared
//! expert's) against the f64 ground truth [`crate::reference::moe_backward`] after a real
//! [`MoePlan`] forward (its routing and workspace feed the backward), with a global
//! relative L2 and a per-row bound; softmax and sigmoid, renormalised or not, top_k = 1,
//! top_k = experts, one expert, skewed routing (one expert with more rows than a tile,
//! empty experts), a shared expert, bf16 and fp16, odd token counts, the aux and z-loss
//! gradients; bit-identical reruns; CUDA-graph replay; bad input. Inputs are fresh random
//! values (seed printed); outputs and the workspace are poisoned (NaN) before every run and
//! every compared value must be finite. Each test prints "skipped: no GPU" without one.
//!
//! On the GPU machine: `flashmoe-gpu-tests moe::backward --test-threads=1 --nocapture`.

use super::{MoeBackwardPlan, MoeBwdArgs, SavedRouting};
use crate::dtype::DType;
use crate::gpu::raw::{RawTensor, RawU32, RawWorkspace};
use crate::gpu::test_support::{addr, fresh_seed, with_gpu};
use crate::gpu::{Device, Workspace};
use crate::inputs::{generate, TensorId};
use crate::moe::forward::plan::{MoeArgs, MoeClass, MoePlan, RoutingArgs};
use crate::moe::gemm::sm90::{WGRAD_TILE, WGRAD_TILES};
use crate::problem::Scoring;
use crate::reference::moe::{route, MoeInputs};
use crate::reference::moe_backward::moe_backward_f64;
use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtrMut};
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
struct Case {
    tokens: usize,
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    scoring: Scoring,
    renorm: bool,
    shared: bool,
    dtype: DType,
    /// Bias the router so that expert 0 takes (nearly) every token and the upper half of
    /// the experts none.
    skew: bool,
    /// (d_aux, d_z); None: the losses are not trained (null d_losses).
    d_losses: Option<(f32, f32)>,
    /// The routed GEMMs' path ([`MoeBackwardPlan::with_gemm_path`]).
    path: &'static str,
    /// The backward reads the forward's saved gate/up (`MoeBwdArgs::saved_gate_up`, its
    /// smaller workspace) instead of recomputing them.
    saved: bool,
}

impl Case {
    fn class(&self) -> MoeClass {
        MoeClass {
            dtype: self.dtype,
            hidden: self.hidden,
            intermediate: self.inter,
            experts: self.experts,
            top_k: self.top_k,
            scoring: self.scoring,
            renormalize: self.renorm,
            shared_expert: self.shared,
            max_tokens: self.tokens,
        }
    }
}

fn base() -> Case {
    // hidden 96: not a multiple of the 64-column tile (tails in N and in the weight GEMMs).
    Case {
        tokens: 37,
        hidden: 96,
        inter: 64,
        experts: 8,
        top_k: 2,
        scoring: Scoring::Softmax,
        renorm: true,
        shared: false,
        dtype: DType::Bf16,
        skew: false,
        d_losses: Some((0.7, 0.3)),
        path: "auto",
        saved: false,
    }
}

/// The row-GEMM paths a device runs: the portable kernels, and on sm_90 the sm_90a ones.
fn paths(dev: &Device) -> &'static [&'static str] {
    if dev.arch() == 90 {
        &["portable", "sm90"]
    } else {
        &["portable"]
    }
}

/// 0xFF bytes on `stream`: NaN in f32 / f16 / bf16.
fn poison<T>(stream: &Arc<CudaStream>, s: &mut CudaSlice<T>) {
    let n = s.len() * std::mem::size_of::<T>();
    let (p, _g) = s.device_ptr_mut(stream);
    unsafe { sys::cuMemsetD8Async(p, 0xFF, n, stream.cu_stream()) }
        .result()
        .unwrap();
}

/// The gradients of one backward call, as 16-bit bits.
#[derive(Debug, Clone, PartialEq)]
struct Grads {
    dx: Vec<u16>,
    d_router: Vec<u16>,
    dw13: Vec<u16>,
    dw2: Vec<u16>,
    shared: Option<(Vec<u16>, Vec<u16>)>,
}

/// Everything of one case on the device: inputs, the forward's outputs and workspace,
/// the backward's outputs and workspace.
struct Setup {
    class: MoeClass,
    inputs: MoeInputs,
    d_out_host: Vec<f32>,
    bufs: Vec<CudaSlice<u16>>,
    routing: crate::moe::forward::plan::MoeRouting,
    fwd_ws: Workspace,
    fwd: MoePlan,
    /// The forward's arguments, without and with the gate/up output.
    fwd_args: MoeArgs,
    fwd_args_saving: MoeArgs,
    /// [T·k, 2I]: the forward's gate/up (written by the setup's forward).
    gate_up: CudaSlice<u16>,
    /// Backward calls read `gate_up` (the case's `saved`).
    use_saved: bool,
    _out: CudaSlice<u16>,
    saved: SavedRouting,
    d_losses: Option<CudaSlice<f32>>,
    outs: Vec<CudaSlice<u16>>,
    bwd_ws: Workspace,
    plan: MoeBackwardPlan,
}

fn skew_inputs(c: &Case, x: &mut MoeInputs) {
    let e = c.experts;
    for row in x.x.chunks_exact_mut(c.hidden) {
        row[0] = 1.0;
    }
    x.router[0] = 3.0;
    if c.top_k <= e / 2 {
        for v in &mut x.router[e / 2..e] {
            *v = -3.0;
        }
    }
}

// Buffer indices in Setup::bufs / Setup::outs.
const X: usize = 0;
const ROUTER: usize = 1;
const W13: usize = 2;
const W2: usize = 3;
const D_OUT: usize = 4;
const SW13: usize = 5;
const SW2: usize = 6;

impl Setup {
    fn new(dev: &Device, c: &Case, seed: u64) -> Setup {
        let s = dev.stream().clone();
        let class = c.class();
        let (t, h, i, e, k, dt) = (c.tokens, c.hidden, c.inter, c.experts, c.top_k, c.dtype);
        let p = class.problem(t);
        let mut inputs = MoeInputs::generate(&p, seed);
        if c.skew {
            skew_inputs(c, &mut inputs);
        }
        let d_out_host = generate(seed.wrapping_add(0x5eed), TensorId::MoeX, t * h, 1.0, dt);
        let up = |v: &[f32]| s.clone_htod(&dt.encode_u16(v)).unwrap();
        let mut bufs = vec![
            up(&inputs.x),
            up(&inputs.router),
            up(&inputs.w13),
            up(&inputs.w2),
            up(&d_out_host),
        ];
        if let (Some(a), Some(b)) = (&inputs.shared_w13, &inputs.shared_w2) {
            bufs.push(up(a));
            bufs.push(up(b));
        }
        let fwd = MoePlan::new(dev, class).unwrap();
        let fwd_ws = fwd.alloc_workspace(&s).unwrap();
        let routing = fwd.alloc_routing(&s).unwrap();
        let out = s.alloc_zeros::<u16>(t * h).unwrap();
        let r16 = |ptr, sh: &[usize]| RawTensor::contiguous(ptr, dt, sh).unwrap();
        let f32t = |ptr, sh: &[usize]| RawTensor::contiguous(ptr, DType::F32, sh).unwrap();
        let args = MoeArgs {
            x: r16(addr(&bufs[X], &s), &[t, h]),
            router: r16(addr(&bufs[ROUTER], &s), &[h, e]),
            w13: r16(addr(&bufs[W13], &s), &[e, h, 2 * i]),
            w2: r16(addr(&bufs[W2], &s), &[e, i, h]),
            shared_w13: c.shared.then(|| r16(addr(&bufs[SW13], &s), &[h, 2 * i])),
            shared_w2: c.shared.then(|| r16(addr(&bufs[SW2], &s), &[i, h])),
            out: r16(addr(&out, &s), &[t, h]),
            routing: RoutingArgs {
                topk_ids: RawU32 {
                    ptr: addr(&routing.topk_ids, &s),
                    len: t * k,
                },
                topk_w: f32t(addr(&routing.topk_w, &s), &[t, k]),
                counts: RawU32 {
                    ptr: addr(&routing.counts, &s),
                    len: e,
                },
                losses: f32t(addr(&routing.losses, &s), &[2]),
            },
            gate_up: None,
        };
        let mut gate_up = s.alloc_zeros::<u16>(t * k * 2 * i).unwrap();
        poison(&s, &mut gate_up);
        let args_saving = MoeArgs {
            gate_up: Some(r16(addr(&gate_up, &s), &[t * k, 2 * i])),
            ..args
        };
        unsafe { fwd.forward_raw(s.cu_stream(), &args_saving, fwd_ws.raw()) }.unwrap();
        let saved = SavedRouting::from_forward_workspace(
            &class,
            t,
            &fwd.workspace_layout(t).unwrap(),
            fwd_ws.raw(),
        )
        .unwrap();
        let d_losses = c.d_losses.map(|(a, z)| s.clone_htod(&[a, z]).unwrap());
        let mut out_lens = vec![t * h, h * e, e * h * 2 * i, e * i * h];
        if c.shared {
            out_lens.extend([h * 2 * i, i * h]);
        }
        let outs = out_lens
            .iter()
            .map(|&n| s.alloc_zeros::<u16>(n).unwrap())
            .collect();
        let plan = MoeBackwardPlan::with_gemm_path(dev, class, Some(c.path)).unwrap();
        let ws_bytes = if c.saved {
            plan.workspace_bytes_with_saved_gate_up(t).unwrap()
        } else {
            plan.workspace_bytes(t).unwrap()
        };
        let bwd_ws = Workspace::zeroed(&s, ws_bytes).unwrap();
        s.synchronize().unwrap();
        Setup {
            class,
            inputs,
            d_out_host,
            bufs,
            routing,
            fwd_ws,
            fwd,
            fwd_args: args,
            fwd_args_saving: args_saving,
            gate_up,
            use_saved: c.saved,
            _out: out,
            saved,
            d_losses,
            outs,
            bwd_ws,
            plan,
        }
    }

    fn args(&self, s: &Arc<CudaStream>) -> MoeBwdArgs {
        self.args_for(s, self.use_saved)
    }

    /// The backward's arguments, with (`saved`) or without the forward's gate/up.
    fn args_for(&self, s: &Arc<CudaStream>, saved: bool) -> MoeBwdArgs {
        let c = &self.class;
        let (t, h, i, e, k, dt) = (
            c.max_tokens,
            c.hidden,
            c.intermediate,
            c.experts,
            c.top_k,
            c.dtype,
        );
        let r16 =
            |b: &CudaSlice<u16>, sh: &[usize]| RawTensor::contiguous(addr(b, s), dt, sh).unwrap();
        MoeBwdArgs {
            x: r16(&self.bufs[X], &[t, h]),
            router: r16(&self.bufs[ROUTER], &[h, e]),
            w13: r16(&self.bufs[W13], &[e, h, 2 * i]),
            w2: r16(&self.bufs[W2], &[e, i, h]),
            shared_w13: c.shared_expert.then(|| r16(&self.bufs[SW13], &[h, 2 * i])),
            shared_w2: c.shared_expert.then(|| r16(&self.bufs[SW2], &[i, h])),
            topk_ids: RawU32 {
                ptr: addr(&self.routing.topk_ids, s),
                len: t * k,
            },
            topk_w: RawTensor::contiguous(addr(&self.routing.topk_w, s), DType::F32, &[t, k])
                .unwrap(),
            counts: RawU32 {
                ptr: addr(&self.routing.counts, s),
                len: e,
            },
            saved: self.saved,
            saved_gate_up: saved.then(|| r16(&self.gate_up, &[t * k, 2 * i])),
            d_out: r16(&self.bufs[D_OUT], &[t, h]),
            d_losses: self
                .d_losses
                .as_ref()
                .map(|d| RawTensor::contiguous(addr(d, s), DType::F32, &[2]).unwrap()),
            dx: r16(&self.outs[0], &[t, h]),
            d_router: r16(&self.outs[1], &[h, e]),
            dw13: r16(&self.outs[2], &[e, h, 2 * i]),
            dw2: r16(&self.outs[3], &[e, i, h]),
            d_shared_w13: c.shared_expert.then(|| r16(&self.outs[4], &[h, 2 * i])),
            d_shared_w2: c.shared_expert.then(|| r16(&self.outs[5], &[i, h])),
        }
    }

    /// Poison (NaN) the outputs and the workspace.
    fn poison_all(&mut self, s: &Arc<CudaStream>) {
        for o in &mut self.outs {
            poison(s, o);
        }
        poison(s, self.bwd_ws.buffer_mut());
    }

    /// The gradients, after the stream drains.
    fn download(&self, s: &Arc<CudaStream>) -> Grads {
        let get = |b: &CudaSlice<u16>| s.clone_dtoh(b).unwrap();
        let g = Grads {
            dx: get(&self.outs[0]),
            d_router: get(&self.outs[1]),
            dw13: get(&self.outs[2]),
            dw2: get(&self.outs[3]),
            shared: self
                .class
                .shared_expert
                .then(|| (get(&self.outs[4]), get(&self.outs[5]))),
        };
        s.synchronize().unwrap();
        g
    }

    /// Poison the outputs and the workspace, run the backward, return the gradients.
    fn run(&mut self, s: &Arc<CudaStream>) -> Grads {
        self.poison_all(s);
        let args = self.args(s);
        unsafe {
            self.plan
                .backward_raw(s.cu_stream(), &args, self.bwd_ws.raw())
                .unwrap()
        };
        self.download(s)
    }
}

impl Grads {
    /// Every gradient finite.
    fn assert_finite(&self, tag: &str, dt: DType) {
        let mut all = vec![&self.dx, &self.d_router, &self.dw13, &self.dw2];
        if let Some((a, b)) = &self.shared {
            all.extend([a, b]);
        }
        for v in all {
            assert!(
                dt.decode_u16(v).iter().all(|x| x.is_finite()),
                "{tag}: non-finite gradient"
            );
        }
    }
}

/// Relative L2 over everything, the worst row's ‖out_r − ref_r‖ / max(‖ref_r‖, rms row
/// norm / 4), and the count of non-finite outputs.
fn errors(out: &[f32], reference: &[f64], row: usize) -> (f64, f64, usize) {
    let bad = out.iter().filter(|v| !v.is_finite()).count();
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &r) in out.iter().zip(reference) {
        num += (a as f64 - r).powi(2);
        den += r * r;
    }
    let rows = reference.len() / row;
    let floor = (den / rows.max(1) as f64).sqrt() / 4.0;
    let mut worst = 0f64;
    for (o, r) in out.chunks(row).zip(reference.chunks(row)) {
        let e = o
            .iter()
            .zip(r)
            .map(|(&a, &b)| (a as f64 - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let n = r.iter().map(|b| b * b).sum::<f64>().sqrt();
        worst = worst.max(e / n.max(floor).max(1e-30));
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (rel, worst, bad)
}

/// Largest |Δ logit| (f64) between two experts of a token that the GPU's and the f64
/// reference's top-k disagree on below which the disagreement is a near tie (the GPU's
/// f32 logits of bf16 inputs differ from f64 by ~1e-5): the inputs are redrawn.
const NEAR_TIE_LOGITS: f64 = 1e-3;

/// Run `c` against the f64 reference; returns the worst (rel L2, row error). A routing
/// near tie (the f32 and f64 top-k disagree on experts whose logits are within
/// [`NEAR_TIE_LOGITS`]) redraws the inputs with the next seed, up to 4 times; any other
/// routing difference fails.
fn check_case(dev: &Device, c: &Case, seed: u64) -> (f64, f64) {
    for attempt in 0..4 {
        match try_case(dev, c, seed + attempt) {
            Some(w) => return w,
            None => println!(
                "{c:?}: a routing near tie at seed {}: redrawn",
                seed + attempt
            ),
        }
    }
    panic!("{c:?}: routing near ties at 4 seeds from {seed}");
}

/// [`check_case`] at one seed; None on a routing near tie.
fn try_case(dev: &Device, c: &Case, seed: u64) -> Option<(f64, f64)> {
    let s = dev.stream().clone();
    let mut st = Setup::new(dev, c, seed);
    let g = st.run(&s);
    let p = st.class.problem(c.tokens);
    // The reference routes in f64; the GPU's top-k (f32) must pick the same experts.
    let routing = route(&p, &st.inputs).unwrap();
    let ids = s.clone_dtoh(&st.routing.topk_ids).unwrap();
    s.synchronize().unwrap();
    for (tok, (a, b)) in ids
        .chunks(c.top_k)
        .zip(routing.topk_ids.chunks(c.top_k))
        .enumerate()
    {
        let (mut a, mut b) = (a.to_vec(), b.to_vec());
        a.sort_unstable();
        b.sort_unstable();
        if a == b {
            continue;
        }
        let differ: Vec<f64> = a
            .iter()
            .chain(&b)
            .filter(|ex| !(a.contains(ex) && b.contains(ex)))
            .map(|&ex| routing.logits[tok * c.experts + ex as usize])
            .collect();
        let spread = differ.iter().cloned().fold(f64::MIN, f64::max)
            - differ.iter().cloned().fold(f64::MAX, f64::min);
        assert!(
            spread <= NEAR_TIE_LOGITS,
            "{c:?}: token {tok} routed to {a:?} by the GPU forward and {b:?} by the f64 \
             reference, logits {differ:?} apart by {spread:.3e} (not a near tie; seed {seed})"
        );
        return None;
    }
    let (d_aux, d_z) = c.d_losses.unwrap_or((0.0, 0.0));
    let r = moe_backward_f64(&p, &st.inputs, &st.d_out_host, d_aux as f64, d_z as f64).unwrap();
    let (h, i, e) = (c.hidden, c.inter, c.experts);
    let mut checks: Vec<(&str, &[u16], &[f64], usize)> = vec![
        ("dx", &g.dx, &r.dx, h),
        ("d_router", &g.d_router, &r.d_router, e),
        ("dw13", &g.dw13, &r.dw13, 2 * i),
        ("dw2", &g.dw2, &r.dw2, h),
    ];
    if let (Some((a, b)), Some(ra), Some(rb)) = (&g.shared, &r.d_shared_w13, &r.d_shared_w2) {
        checks.push(("d_shared_w13", a, ra, 2 * i));
        checks.push(("d_shared_w2", b, rb, h));
    }
    assert_eq!(c.shared, g.shared.is_some() && r.d_shared_w13.is_some());
    let tol = crate::accuracy::tolerance(c.dtype).rel_l2;
    let row_tol = 4.0 * tol;
    let mut report = String::new();
    let mut worst = (0f64, 0f64);
    for (name, out, reference, row) in checks {
        let (rel, row_err, bad) = errors(&c.dtype.decode_u16(out), reference, row);
        report.push_str(&format!(" {name} {rel:.2e}/{row_err:.2e};"));
        assert_eq!(
            bad, 0,
            "{c:?}: {name} has {bad} non-finite values (seed {seed})"
        );
        assert!(
            rel <= tol && row_err <= row_tol,
            "{c:?}: {name} rel L2 {rel:.3e} (tol {tol:.1e}), worst row {row_err:.3e} (tol \
             {row_tol:.1e}) (seed {seed})"
        );
        worst = (worst.0.max(rel), worst.1.max(row_err));
    }
    println!("{c:?}:{report}");
    Some(worst)
}

#[test]
fn backward_matches_f64_reference() {
    with_gpu("moe-bwd-reference", |dev| {
        let seed = fresh_seed("moe-bwd-reference");
        let b = base();
        let cases = [
            b,
            Case {
                dtype: DType::F16,
                renorm: false,
                tokens: 41,
                ..b
            },
            Case {
                scoring: Scoring::Sigmoid,
                ..b
            },
            Case {
                scoring: Scoring::Sigmoid,
                renorm: false,
                dtype: DType::F16,
                top_k: 3,
                tokens: 33,
                ..b
            },
            Case {
                top_k: 1,
                tokens: 29,
                d_losses: None,
                ..b
            },
            Case {
                experts: 4,
                top_k: 4,
                tokens: 23,
                ..b
            },
            Case {
                experts: 1,
                top_k: 1,
                tokens: 19,
                ..b
            },
            Case {
                skew: true,
                tokens: 131,
                ..b
            },
            Case {
                skew: true,
                scoring: Scoring::Sigmoid,
                renorm: false,
                tokens: 97,
                dtype: DType::F16,
                ..b
            },
            Case { shared: true, ..b },
            Case {
                shared: true,
                scoring: Scoring::Sigmoid,
                dtype: DType::F16,
                tokens: 1,
                ..b
            },
            Case {
                tokens: 1,
                hidden: 64,
                inter: 32,
                ..b
            },
            // d_router over 3 chunks of tokens (523 + 523 + 522)
            Case {
                tokens: 1568,
                scoring: Scoring::Sigmoid,
                ..b
            },
        ];
        for &path in paths(dev) {
            for saved in [false, true] {
                let mut worst = (0f64, 0f64);
                for c in &cases {
                    let w = check_case(dev, &Case { path, saved, ..*c }, seed);
                    worst = (worst.0.max(w.0), worst.1.max(w.1));
                }
                let gu = if saved { "saved" } else { "recomputed" };
                println!(
                    "moe bwd ({path} GEMMs, gate/up {gu}): {} cases passed; worst rel L2 \
                     {:.2e}, worst row {:.2e}",
                    cases.len(),
                    worst.0,
                    worst.1
                );
            }
        }
    });
}

#[test]
fn backward_is_bit_identical_run_to_run() {
    with_gpu("moe-bwd-rerun", |dev| {
        let seed = fresh_seed("moe-bwd-rerun");
        let s = dev.stream().clone();
        let cases = [
            Case {
                skew: true,
                tokens: 131,
                ..base()
            },
            Case {
                shared: true,
                scoring: Scoring::Sigmoid,
                ..base()
            },
        ];
        for c in paths(dev).iter().flat_map(|&path| {
            cases
                .iter()
                .flat_map(move |c| [false, true].map(|saved| Case { path, saved, ..*c }))
        }) {
            let mut st = Setup::new(dev, &c, seed);
            let a = st.run(&s);
            let b = st.run(&s);
            a.assert_finite(&format!("{c:?} (seed {seed})"), c.dtype);
            assert!(
                a == b,
                "{c:?}: gradients differ between two runs (seed {seed})"
            );
            println!("{c:?}: bit-identical (seed {seed})");
        }
    });
}

#[test]
fn backward_rejects_bad_input() {
    with_gpu("moe-bwd-bad-input", |dev| {
        let s = dev.stream().clone();
        let c = Case {
            shared: true,
            ..base()
        };
        let st = Setup::new(dev, &c, fresh_seed("moe-bwd-bad-input"));
        let good = st.args(&s);
        let ws = st.bwd_ws.raw();
        let (t, h) = (c.tokens, c.hidden);
        let expect = |a: &MoeBwdArgs, ws: RawWorkspace, what: &str| {
            let e = unsafe { st.plan.backward_raw(s.cu_stream(), a, ws) }
                .expect_err(what)
                .to_string();
            assert!(
                e.contains(what),
                "expected an error naming {what:?}, got: {e}"
            );
        };
        let mut a = good;
        a.d_out = RawTensor::contiguous(good.d_out.ptr, c.dtype, &[t, h + 32]).unwrap();
        expect(&a, ws, "d_out");
        let mut a = good;
        a.dw2.dtype = DType::F16;
        expect(&a, ws, "dw2");
        let mut a = good;
        a.d_shared_w2 = None;
        expect(&a, ws, "d_shared_w2");
        let mut a = good;
        a.saved.slot_row.len -= 1;
        expect(&a, ws, "slot_row");
        let (k, i) = (c.top_k, c.inter);
        let mut a = good;
        a.saved_gate_up =
            Some(RawTensor::contiguous(addr(&st.gate_up, &s), c.dtype, &[t * k, i]).unwrap());
        expect(&a, ws, "saved_gate_up");
        let mut a = good;
        a.x = RawTensor::contiguous(good.x.ptr, c.dtype, &[t + 1, h]).unwrap();
        expect(&a, ws, "tokens");
        let mut a = good;
        a.d_losses = Some(RawTensor::contiguous(good.dx.ptr, DType::F32, &[3]).unwrap());
        expect(&a, ws, "d_losses");
        let small = RawWorkspace {
            ptr: ws.ptr,
            bytes: ws.bytes - 1,
        };
        expect(&good, small, "workspace");
        let e = MoeBackwardPlan::with_gemm_path(dev, st.class, Some("fast"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("auto, portable, sm90"), "{e}");
        if dev.arch() != 90 {
            let e = MoeBackwardPlan::with_gemm_path(dev, st.class, Some("sm90"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("not 9.0"), "{e}");
        }
        // Nothing was enqueued by the failed calls: a good call still works.
        unsafe { st.plan.backward_raw(s.cu_stream(), &good, ws) }.unwrap();
        s.synchronize().unwrap();
        println!("bad input: every case rejected with a named error");
    });
}

/// The backward captured in a CUDA graph, replayed with a new d_out each time (outputs and
/// workspace poisoned before every replay), equals the eager call bit for bit.
#[test]
fn backward_graph_replay_matches_eager() {
    with_gpu("moe-bwd-graph", |dev| {
        let seed = fresh_seed("moe-bwd-graph");
        let s = dev.stream().clone();
        for &path in paths(dev) {
            let c = Case {
                shared: true,
                skew: true,
                tokens: 97,
                path,
                ..base()
            };
            let mut st = Setup::new(dev, &c, seed);
            let args = st.args(&s);
            let ws = st.bwd_ws.raw();
            s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            unsafe { st.plan.backward_raw(s.cu_stream(), &args, ws).unwrap() };
            let graph = s
                .end_capture(
                    sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                )
                .unwrap()
                .expect("a captured graph");
            let mut prev: Option<Grads> = None;
            for replay in 0..3u64 {
                let d = generate(
                    seed.wrapping_add(100 + replay),
                    TensorId::MoeX,
                    c.tokens * c.hidden,
                    1.0,
                    c.dtype,
                );
                s.memcpy_htod(&c.dtype.encode_u16(&d), &mut st.bufs[D_OUT])
                    .unwrap();
                st.poison_all(&s);
                graph.launch().unwrap();
                let g = st.download(&s);
                let tag = format!("replay {replay} (seed {seed})");
                g.assert_finite(&tag, c.dtype);
                let e = st.run(&s);
                assert!(g == e, "{tag}: graph replay differs from the eager call");
                if let Some(p) = &prev {
                    assert!(p.dx != g.dx, "{tag}: a new d_out left dx unchanged");
                }
                prev = Some(g);
            }
            println!("graph replay ({path} GEMMs): 3 replays bit-identical to eager (seed {seed})");
        }
    });
}

/// What each launch of a non-shared backward computes, in `backward_steps` order, and its
/// FLOPs (R = T·k rows) as a multiple of R·H·I (GEMMs) or T·H·E (router): the portable
/// path's 10 launches; the sm_90a path's 12 are [`GATHER_LABELS`] and these.
const STEP_LABELS: [(&str, f64, f64); 10] = [
    ("1 gu = X_perm·W13", 4.0, 0.0),
    ("2 G = dOut_perm·W2ᵀ", 2.0, 0.0),
    ("2 swiglu / dw epilogue", 0.0, 0.0),
    ("3 dW2 = (w⊙H)ᵀ·dOut", 2.0, 0.0),
    ("4 dX_perm = dGU·W13ᵀ", 4.0, 0.0),
    ("5 dW13 = X_permᵀ·dGU", 4.0, 0.0),
    ("6 router dZ", 0.0, 0.0),
    ("6 d_router = xᵀ·dZ", 0.0, 2.0),
    ("6 d_router chunks summed", 0.0, 0.0),
    ("8 un-permute (+ dZ·Rᵀ)", 0.0, 2.0),
];
/// The sm_90a path's launches before those of [`STEP_LABELS`] (the same ones in order).
const GATHER_LABELS: [(&str, f64, f64); 2] = [
    ("0 gather x_perm", 0.0, 0.0),
    ("0 gather dOut_perm", 0.0, 0.0),
];

/// Speed of the backward at the shapes (seed003 at 2048 and 32768 tokens,
/// Qwen3-30B-A3B at 8192), bf16, softmax top-k renormalised, losses trained, on each path
/// of the routed GEMMs in turn over the same inputs: the median of whole calls between CUDA
/// events, and one call with an event after every launch (the per-kernel breakdown).
/// TFLOP/s use docs/design/moe.md's backward model, 2 × `MoeProblem::flops()` (the gu
/// recompute not counted). Run on its own:
/// `flashmoe-gpu-tests moe::backward::gpu_tests::speed --ignored --nocapture`.
#[test]
#[ignore = "speed measurement at model shapes (GBs of inputs); run with --ignored"]
fn speed_backward_per_kernel() {
    with_gpu("moe-bwd-speed", |dev| {
        let s = dev.stream().clone();
        let shapes = [
            ("seed003", 2048, 4096, 11008, 32, 2),
            ("qwen3-30b", 8192, 2048, 768, 128, 8),
            ("seed003", 32768, 4096, 11008, 32, 2),
        ];
        let event = || {
            dev.context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap()
        };
        let median = |f: &dyn Fn()| {
            let mut times = Vec::new();
            for _ in 0..5 {
                let (a, b) = (event(), event());
                a.record(&s).unwrap();
                f();
                b.record(&s).unwrap();
                b.synchronize().unwrap();
                times.push(a.elapsed_ms(&b).unwrap() as f64);
            }
            times.sort_by(f64::total_cmp);
            times
        };
        for (name, tokens, hidden, inter, experts, top_k) in shapes {
            let c = Case {
                tokens,
                hidden,
                inter,
                experts,
                top_k,
                path: paths(dev)[0],
                ..base()
            };
            let mut st = Setup::new(dev, &c, 7);
            let p = st.class.problem(tokens);
            let flops = 2.0 * p.flops();
            let rhi = (tokens * top_k * hidden * inter) as f64;
            let the = (tokens * hidden * experts) as f64;
            let fwd_ms = |a: &MoeArgs| {
                median(&|| {
                    unsafe { st.fwd.forward_raw(s.cu_stream(), a, st.fwd_ws.raw()) }.unwrap()
                })[2]
            };
            let (f_ms, fs_ms) = (fwd_ms(&st.fwd_args), fwd_ms(&st.fwd_args_saving));
            println!(
                "moe fwd {name} T={tokens} H={hidden} I={inter} E={experts} k={top_k} bf16: \
                 {f_ms:.3} ms; writing gate/up {fs_ms:.3} ms"
            );
            // The weight-gradient kernel's pipelines (WGRAD_TILES, production first), gate/up
            // saved: the backward's time, its two weight-gradient launches' (the 4th and 6th
            // after the gathers), and dW bit-identical across them (the same sums in the
            // same order; only the staging of the stores differs).
            if st.plan.uses_sm90(tokens) {
                let args = st.args_for(&s, true);
                let ws = st.bwd_ws.raw();
                let mut first: Option<Grads> = None;
                for tile in WGRAD_TILES {
                    st.plan.set_wgrad_tile(dev, tile).unwrap();
                    let call =
                        || unsafe { st.plan.backward_raw(s.cu_stream(), &args, ws) }.unwrap();
                    call();
                    s.synchronize().unwrap();
                    let ms = median(&call)[2];
                    let evs: Vec<_> = (0..=16).map(|_| event()).collect();
                    evs[0].record(&s).unwrap();
                    let mut n = 0;
                    unsafe {
                        st.plan
                            .backward_raw_each(s.cu_stream(), &args, ws, &mut |i, _| {
                                n = i + 1;
                                evs[i + 1]
                                    .record(&s)
                                    .map_err(|e| crate::error::Error::cuda("cuEventRecord", e))
                            })
                    }
                    .unwrap();
                    evs[n].synchronize().unwrap();
                    let t = |i: usize| evs[i].elapsed_ms(&evs[i + 1]).unwrap() as f64;
                    // gathers (2), G, swiglu, dW2, dX, dW13 (gate/up saved: no gu launch).
                    let (dw2, dw13) = (t(4), t(6));
                    println!(
                        "  wgrad {tile:?}: backward {ms:.3} ms; dW2 {dw2:.3} ms = {:.1} TFLOP/s, \
                         dW13 {dw13:.3} ms = {:.1} TFLOP/s",
                        2.0 * rhi / dw2 / 1e9,
                        4.0 * rhi / dw13 / 1e9
                    );
                    let g = st.download(&s);
                    match &first {
                        Some(f) => assert!(
                            f.dw13 == g.dw13 && f.dw2 == g.dw2,
                            "{name} T={tokens}: wgrad {tile:?} changed dW's bits"
                        ),
                        None => first = Some(g),
                    }
                }
                st.plan.set_wgrad_tile(dev, WGRAD_TILE).unwrap();
            }
            let runs = paths(dev)
                .iter()
                .enumerate()
                .flat_map(|(n, &path)| [(n, path, false), (n, path, true)]);
            for (n_path, path, saved) in runs {
                if n_path > 0 && !saved {
                    st.plan = MoeBackwardPlan::with_gemm_path(dev, st.class, Some(path)).unwrap();
                    st.bwd_ws =
                        Workspace::zeroed(&s, st.plan.workspace_bytes(tokens).unwrap()).unwrap();
                }
                let gu = if saved {
                    "gate/up saved"
                } else {
                    "gate/up recomputed"
                };
                let args = st.args_for(&s, saved);
                let fwd_args = if saved {
                    &st.fwd_args_saving
                } else {
                    &st.fwd_args
                };
                let fwd = || {
                    unsafe { st.fwd.forward_raw(s.cu_stream(), fwd_args, st.fwd_ws.raw()) }.unwrap()
                };
                let ws = st.bwd_ws.raw();
                let call = || unsafe { st.plan.backward_raw(s.cu_stream(), &args, ws) }.unwrap();
                fwd();
                call();
                s.synchronize().unwrap();
                let times = median(&call);
                let ms = times[times.len() / 2];
                let fb_ms = median(&|| {
                    fwd();
                    call()
                })[2];
                println!(
                    "moe bwd speed {name} T={tokens} [{path} GEMMs, {gu}]: {ms:.3} ms (median \
                     of 5, min {:.3}) = {:.1} TFLOP/s (model {:.3} TF); fwd+bwd {fb_ms:.3} ms \
                     = {:.1} TFLOP/s (3 × flops()); saved gate/up {} MB, workspace {} MB",
                    times[0],
                    flops / ms / 1e9,
                    flops / 1e12,
                    3.0 * p.flops() / fb_ms / 1e9,
                    st.plan.saved_gate_up_bytes(tokens).unwrap() >> 20,
                    st.plan.workspace_layout_for(tokens, saved).unwrap().bytes >> 20
                );
                let mut labels: Vec<(&str, f64, f64)> = if st.plan.uses_sm90(tokens) {
                    [&GATHER_LABELS[..], &STEP_LABELS[..]].concat()
                } else {
                    STEP_LABELS.to_vec()
                };
                if saved {
                    labels.retain(|l| l.0 != STEP_LABELS[0].0);
                }
                let evs: Vec<_> = (0..=labels.len()).map(|_| event()).collect();
                evs[0].record(&s).unwrap();
                let mut kinds = Vec::new();
                unsafe {
                    st.plan
                        .backward_raw_each(s.cu_stream(), &args, ws, &mut |i, kind| {
                            kinds.push(kind);
                            evs[i + 1]
                                .record(&s)
                                .map_err(|e| crate::error::Error::cuda("cuEventRecord", e))
                        })
                }
                .unwrap();
                evs[kinds.len()].synchronize().unwrap();
                assert_eq!(kinds.len(), labels.len(), "{kinds:?}");
                for (i, ((label, gemm, router), kind)) in labels.iter().zip(&kinds).enumerate() {
                    let t = evs[i].elapsed_ms(&evs[i + 1]).unwrap() as f64;
                    let f = gemm * rhi + router * the;
                    let rate = if f > 0.0 {
                        format!(" {:.1} TFLOP/s", f / t / 1e9)
                    } else {
                        String::new()
                    };
                    println!(
                        "  {label:<28} [{kind}] {t:8.3} ms {:5.1} %{rate}",
                        100.0 * t / ms
                    );
                }
                let g = st.download(&s);
                g.assert_finite(&format!("speed {name} T={tokens} {path} {gu}"), c.dtype);
            }
        }
    });
}
