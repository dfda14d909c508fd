//! The gradient family on the GPU: "flashmoe-grad" (and, for dense attention,
//! "flashmoe-grad-det": the backward plan in its deterministic mode), a plan-backed implementation (a
//! `PlanCall` under the lab's `PlanBacked`: L2 flush + CUDA events, poisoned outputs)
//! over the library's backward plans — `AttentionBackwardPlan` after an `AttentionPlan`
//! forward (dense), `VarlenBackwardPlan` after a `VarlenPlan` forward (packed), and
//! `MoeBackwardPlan` after the lab's `MoeRunner` forward (MoE, reading the routing the
//! forward left in its workspace and the gate/up pre-activations it kept).
//!
//! `prepare` uploads the inputs and d_out, allocates the gradients and runs the forward
//! once. A `--pass bwd` launch is the backward alone over that retained forward; a
//! `fwd+bwd` launch enqueues the forward and then the backward. The check run poisons
//! every gradient (NaN) first.

use super::{GradLayer, GradProblem, GradTensor, Pass};
use crate::results::ProblemSpec;
use crate::runner::gpu::GpuSession;
use crate::runner::plan_backed::{PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use anyhow::Context;
use cudarc::driver::{CudaSlice, DevicePtr};
use flashmoe::attention::backward::varlen::{VarlenBackwardArgs, VarlenBackwardPlan};
use flashmoe::attention::backward::{AttentionBackwardPlan, BackwardArgs, BwdMode, BWD_HEAD_DIMS};
use flashmoe::attention::decode::RawIndex;
use flashmoe::attention::{AttentionArgs, AttentionClass, AttentionPlan, VarlenArgs, VarlenPlan};
use flashmoe::gpu::{Device, DeviceTensor, RawTensor, RawU32, Workspace};
use flashmoe::moe::backward::{MoeBackwardPlan, MoeBwdArgs};
use flashmoe::moe::{MoeClass, MoeRunner};
use flashmoe::DType;
use std::rc::Rc;

pub struct GpuGrad {
    pub session: Rc<GpuSession>,
    /// The attention backward plan's mode (the other layers have one backward).
    pub mode: BwdMode,
}

impl GpuGrad {
    /// The backward plans in their fast mode ("flashmoe-grad").
    pub fn fast(session: Rc<GpuSession>) -> GpuGrad {
        GpuGrad {
            session,
            mode: BwdMode::Fast,
        }
    }
    /// The dense attention backward in its deterministic mode ("flashmoe-grad-det").
    pub fn deterministic(session: Rc<GpuSession>) -> GpuGrad {
        GpuGrad {
            session,
            mode: BwdMode::Deterministic,
        }
    }
}

impl Implementation for GpuGrad {
    fn name(&self) -> &str {
        match self.mode {
            BwdMode::Fast => "flashmoe-grad",
            BwdMode::Deterministic => "flashmoe-grad-det",
        }
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Grad(g) = problem else {
            return Err("the backward plans run gradient configs".into());
        };
        let (dtype, head_dim) = match &g.layer {
            GradLayer::Attention(a) => (a.dtype, Some(a.head_dim)),
            GradLayer::Varlen(v) => {
                // The retained forward runs on the varlen prefill kernel (sm_90a).
                let arch = self.session.device.arch();
                flashmoe::attention::varlen::varlen_variant(&v.class())
                    .map_err(|e| e.to_string())?
                    .runs_on(arch)
                    .map_err(|why| format!("the varlen forward {why} (this GPU is sm_{arch})"))?;
                (v.dtype, Some(v.head_dim))
            }
            GradLayer::Moe(m) => {
                MoeBackwardPlan::check_class(&MoeClass::of_problem(m, m.tokens))
                    .map_err(|e| e.to_string())?;
                (m.dtype, None)
            }
        };
        if !matches!(dtype, DType::Bf16 | DType::F16) {
            return Err(format!(
                "dtype {dtype}: the backward plans take bf16 and f16"
            ));
        }
        if let Some(d) = head_dim.filter(|d| !BWD_HEAD_DIMS.contains(d)) {
            return Err(format!(
                "head dim {d}: the attention backward serves {BWD_HEAD_DIMS:?}"
            ));
        }
        Ok(())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Grad(g), SuiteInputs::Grad(x)) = (problem, inputs) else {
            anyhow::bail!("the backward plans given a config without gradient inputs");
        };
        let dev = &self.session.device;
        let call = GradCall::new(dev, g, x, self.mode).with_context(|| format!("preparing {g}"))?;
        let mut backed = PlanBacked::new(&self.session, call);
        // The retained forward of `--pass bwd` (a fwd+bwd launch writes its own).
        backed.call.forward(dev)?;
        dev.synchronize()?;
        Ok(Box::new(backed))
    }
}

/// The forward and backward launches of one family over owned buffers (one value per
/// prepared call: the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Layer {
    Attention {
        fwd: AttentionPlan,
        fwd_args: AttentionArgs,
        fwd_ws: Workspace,
        bwd: AttentionBackwardPlan,
        bwd_args: BackwardArgs,
        bwd_ws: Workspace,
    },
    Varlen {
        fwd: VarlenPlan,
        fwd_args: VarlenArgs,
        fwd_ws: Workspace,
        bwd: VarlenBackwardPlan,
        bwd_args: VarlenBackwardArgs,
        bwd_ws: Workspace,
        _cu: [CudaSlice<i32>; 2],
    },
    Moe {
        fwd: Box<MoeRunner>,
        bwd: MoeBackwardPlan,
        bwd_args: Box<MoeBwdArgs>,
        bwd_ws: Workspace,
        _d_losses: Option<CudaSlice<f32>>,
    },
}

struct GradCall {
    pass: Pass,
    layer: Layer,
    /// Inputs, o / lse, d_out: owned so the addresses in the arguments stay valid.
    _inputs: Vec<DeviceTensor>,
    /// The gradients, in `GradProblem::tensors` order.
    grads: Vec<(String, DeviceTensor)>,
}

/// Upload `values` as a 16-bit tensor and describe it with `shape`.
fn upload(
    dev: &Device,
    keep: &mut Vec<DeviceTensor>,
    dtype: DType,
    values: &[f32],
    name: &str,
    shape: &[usize],
) -> anyhow::Result<RawTensor> {
    let t = DeviceTensor::from_f32(dev, dtype, values)?;
    let raw = t.raw(dev, name, shape)?;
    keep.push(t);
    Ok(raw)
}

/// The tensors of an attention forward + backward: q, k, v and d_o uploaded in the
/// inputs' dtype, o (`o_dtype`, q's shape) and the f32 LSE allocated.
struct AttnTensors {
    q: RawTensor,
    k: RawTensor,
    v: RawTensor,
    o: RawTensor,
    lse: RawTensor,
    d_o: RawTensor,
}

#[allow(clippy::too_many_arguments)]
fn attention_tensors(
    dev: &Device,
    keep: &mut Vec<DeviceTensor>,
    dt: DType,
    o_dtype: DType,
    a: &flashmoe::reference::AttentionInputs,
    d_out: &[f32],
    q_shape: &[usize],
    kv_shape: &[usize],
    lse_shape: &[usize],
) -> anyhow::Result<AttnTensors> {
    Ok(AttnTensors {
        q: upload(dev, keep, dt, &a.q, "q", q_shape)?,
        k: upload(dev, keep, dt, &a.k, "k", kv_shape)?,
        v: upload(dev, keep, dt, &a.v, "v", kv_shape)?,
        o: output(dev, keep, o_dtype, "o", q_shape)?,
        lse: output(dev, keep, DType::F32, "lse", lse_shape)?,
        d_o: upload(dev, keep, dt, d_out, "d_o", q_shape)?,
    })
}

/// Allocate an output of `shape` (kept in `keep`).
fn output(
    dev: &Device,
    keep: &mut Vec<DeviceTensor>,
    dtype: DType,
    name: &str,
    shape: &[usize],
) -> anyhow::Result<RawTensor> {
    let t = DeviceTensor::alloc(dev, dtype, shape.iter().product())?;
    let raw = t.raw(dev, name, shape)?;
    keep.push(t);
    Ok(raw)
}

impl GradCall {
    fn new(
        dev: &Device,
        g: &GradProblem,
        x: &super::GradInputs,
        mode: BwdMode,
    ) -> anyhow::Result<GradCall> {
        let s = dev.stream();
        let mut keep = Vec::new();
        let mut grads = Vec::new();
        let mut grad = |name: &str, dtype: DType, shape: &[usize]| -> anyhow::Result<RawTensor> {
            let t = DeviceTensor::alloc(dev, dtype, shape.iter().product())?;
            let raw = t.raw(dev, name, shape)?;
            grads.push((name.to_string(), t));
            Ok(raw)
        };
        let layer = match &g.layer {
            GradLayer::Attention(p) => {
                let a = x.attention()?;
                let (b, sq, sk, hq, hkv, d) = (
                    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim,
                );
                let dt = p.dtype;
                let (qs, ks) = ([b, sq, hq, d], [b, sk, hkv, d]);
                let class = AttentionClass::from(p);
                let fwd = AttentionPlan::new(dev, class)?;
                let t = attention_tensors(
                    dev,
                    &mut keep,
                    dt,
                    fwd.out_dtype(),
                    a,
                    &x.d_out,
                    &qs,
                    &ks,
                    &[b, hq, sq],
                )?;
                let AttnTensors {
                    q,
                    k,
                    v,
                    o,
                    lse,
                    d_o,
                } = t;
                let fwd_args = AttentionArgs { q, k, v, o, lse };
                fwd.check(&fwd_args)?;
                let fwd_ws = fwd.alloc_workspace(s)?;
                let bwd = match flashmoe::attention::runner::bwd_kernel_override(&class, mode)? {
                    Some(k) => AttentionBackwardPlan::with_kernel(dev, class, Some(k))?,
                    None => AttentionBackwardPlan::new(dev, class, mode)?,
                };
                let bwd_args = BackwardArgs {
                    q,
                    k,
                    v,
                    o,
                    d_o,
                    lse,
                    dq: grad("dq", dt, &qs)?,
                    dk: grad("dk", dt, &ks)?,
                    dv: grad("dv", dt, &ks)?,
                };
                bwd.check(&bwd_args)?;
                let bwd_ws = Workspace::zeroed(s, bwd.workspace_bytes(b, sq))?;
                Layer::Attention {
                    fwd,
                    fwd_args,
                    fwd_ws,
                    bwd,
                    bwd_args,
                    bwd_ws,
                }
            }
            GradLayer::Varlen(p) => {
                let a = x.attention()?;
                let (hq, hkv, d, dt) = (p.heads_q, p.heads_kv, p.head_dim, p.dtype);
                let (tq, tk, nb) = (p.total_q(), p.total_k(), p.batch());
                let (qs, ks) = ([tq, hq, d], [tk, hkv, d]);
                let to_i32 = |v: Vec<usize>| v.into_iter().map(|n| n as i32).collect::<Vec<_>>();
                let cu_q = s.clone_htod(&to_i32(p.cu_seqlens_q()))?;
                let cu_k = s.clone_htod(&to_i32(p.cu_seqlens_k()))?;
                let (cq, ck) = (
                    RawIndex::vector(cu_q.device_ptr(s).0, nb + 1),
                    RawIndex::vector(cu_k.device_ptr(s).0, nb + 1),
                );
                let t =
                    attention_tensors(dev, &mut keep, dt, dt, a, &x.d_out, &qs, &ks, &[hq, tq])?;
                let AttnTensors {
                    q,
                    k,
                    v,
                    o,
                    lse,
                    d_o,
                } = t;
                let (max_q, max_k) = (p.max_seqlen_q(), p.max_seqlen_k());
                let fwd_args = VarlenArgs {
                    q,
                    k,
                    v,
                    o,
                    lse,
                    cu_seqlens_q: cq,
                    cu_seqlens_k: ck,
                    max_seqlen_q: max_q,
                    max_seqlen_k: max_k,
                };
                let fwd = VarlenPlan::new(dev, p.class())?;
                fwd.check(&fwd_args)?;
                let fwd_ws = fwd.alloc_workspace(s)?;
                let bwd = VarlenBackwardPlan::new(dev, p.class())?;
                let bwd_args = VarlenBackwardArgs {
                    q,
                    k,
                    v,
                    o,
                    d_o,
                    lse,
                    dq: grad("dq", dt, &qs)?,
                    dk: grad("dk", dt, &ks)?,
                    dv: grad("dv", dt, &ks)?,
                    cu_seqlens_q: cq,
                    cu_seqlens_k: ck,
                    max_seqlen_q: max_q,
                    max_seqlen_k: max_k,
                };
                bwd.check(&bwd_args)?;
                let bwd_ws = Workspace::zeroed(s, bwd.workspace_bytes(tq))?;
                Layer::Varlen {
                    fwd,
                    fwd_args,
                    fwd_ws,
                    bwd,
                    bwd_args,
                    bwd_ws,
                    _cu: [cu_q, cu_k],
                }
            }
            GradLayer::Moe(p) => {
                let m = x.moe()?;
                let (t, h, i, e, dt) = (p.tokens, p.hidden, p.intermediate, p.experts, p.dtype);
                // The training path keeps gate/up from the forward for the backward (the
                // default of the PyTorch layer; docs/design/moe.md, "Save or recompute").
                let mut fwd = MoeRunner::new(dev, p, m)?;
                let gate_up = fwd.keep_gate_up(dev)?;
                let fa = *fwd.args();
                let d_out = upload(dev, &mut keep, dt, &x.d_out, "d_out", &[t, h])?;
                let d_losses = if g.trains_losses() {
                    Some(s.clone_htod(&[g.d_aux as f32, g.d_z as f32])?)
                } else {
                    None
                };
                let d_losses_raw = match &d_losses {
                    Some(buf) => Some(RawTensor::contiguous(
                        buf.device_ptr(s).0,
                        DType::F32,
                        &[2],
                    )?),
                    None => None,
                };
                let class = MoeClass::of_problem(p, t);
                // The forward (MoeRunner::new) and the backward follow the lab's path switch.
                let path = std::env::var(flashmoe::moe::runner::GEMM_PATH_ENV).ok();
                let bwd = MoeBackwardPlan::with_gemm_path(dev, class, path.as_deref())?;
                let shared = p.shared_expert;
                let args = MoeBwdArgs {
                    saved_gate_up: Some(gate_up),
                    x: fa.x,
                    router: fa.router,
                    w13: fa.w13,
                    w2: fa.w2,
                    shared_w13: fa.shared_w13,
                    shared_w2: fa.shared_w2,
                    topk_ids: fa.routing.topk_ids,
                    topk_w: fa.routing.topk_w,
                    counts: RawU32 {
                        ptr: fa.routing.counts.ptr,
                        len: fa.routing.counts.len,
                    },
                    saved: fwd.saved_routing(dev)?,
                    d_out,
                    d_losses: d_losses_raw,
                    dx: grad("dx", dt, &[t, h])?,
                    d_router: grad("d_router", dt, &[h, e])?,
                    dw13: grad("dw13", dt, &[e, h, 2 * i])?,
                    dw2: grad("dw2", dt, &[e, i, h])?,
                    d_shared_w13: if shared {
                        Some(grad("d_shared_w13", dt, &[h, 2 * i])?)
                    } else {
                        None
                    },
                    d_shared_w2: if shared {
                        Some(grad("d_shared_w2", dt, &[i, h])?)
                    } else {
                        None
                    },
                };
                bwd.check(&args)?;
                let bwd_ws = Workspace::zeroed(s, bwd.workspace_bytes_with_saved_gate_up(t)?)?;
                Layer::Moe {
                    fwd: Box::new(fwd),
                    bwd,
                    bwd_args: Box::new(args),
                    bwd_ws,
                    _d_losses: d_losses,
                }
            }
        };
        Ok(GradCall {
            pass: g.pass,
            layer,
            _inputs: keep,
            grads,
        })
    }

    /// Enqueue the forward.
    fn forward(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let s = dev.stream().cu_stream();
        // SAFETY (all arms): every address in the arguments is a live buffer this call
        // owns, sized for the problem and checked by the plan at construction; the
        // workspaces are this call's own, sized by their plans; all work is ordered on the
        // device's one stream.
        match &mut self.layer {
            Layer::Attention {
                fwd,
                fwd_args,
                fwd_ws,
                ..
            } => unsafe { fwd.forward_raw(s, fwd_args, fwd_ws.raw()) },
            Layer::Varlen {
                fwd,
                fwd_args,
                fwd_ws,
                ..
            } => unsafe { fwd.forward_raw(s, fwd_args, fwd_ws.raw()) },
            Layer::Moe { fwd, .. } => fwd.run(dev),
        }
    }

    /// Enqueue the backward over the forward's outputs.
    fn backward(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let s = dev.stream().cu_stream();
        // SAFETY: as in `forward`.
        match &mut self.layer {
            Layer::Attention {
                bwd,
                bwd_args,
                bwd_ws,
                ..
            } => unsafe { bwd.backward_raw(s, bwd_args, bwd_ws.raw()) },
            Layer::Varlen {
                bwd,
                bwd_args,
                bwd_ws,
                ..
            } => unsafe { bwd.backward_raw(s, bwd_args, bwd_ws.raw()) },
            Layer::Moe {
                bwd,
                bwd_args,
                bwd_ws,
                ..
            } => unsafe { bwd.backward_raw(s, bwd_args, bwd_ws.raw()) },
        }
    }
}

impl PlanCall for GradCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        if self.pass.includes_forward() {
            self.forward(dev)?;
        }
        self.backward(dev)
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        for (_, t) in &mut self.grads {
            t.poison(dev)?;
        }
        Ok(())
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        let mut out = Vec::with_capacity(self.grads.len());
        for (name, t) in &self.grads {
            out.push(GradTensor {
                name: name.clone(),
                values: t.to_f32(dev)?,
            });
        }
        Ok(Outputs::Gradients(out))
    }
    /// The backward's workspace, and for the MoE layer the gate/up the forward kept for it
    /// (the forward's workspace is the forward suites' figure).
    fn peak_extra_bytes(&self) -> Option<u64> {
        Some(match &self.layer {
            Layer::Attention { bwd_ws, .. } | Layer::Varlen { bwd_ws, .. } => bwd_ws.bytes() as u64,
            Layer::Moe {
                bwd,
                bwd_args,
                bwd_ws,
                ..
            } => {
                let kept = bwd.saved_gate_up_bytes(bwd_args.x.shape[0]).ok()?;
                (bwd_ws.bytes() + kept) as u64
            }
        })
    }
    fn notes(&self) -> Vec<String> {
        let what = match &self.layer {
            Layer::Attention { bwd, .. } => format!(
                "AttentionBackwardPlan ({:?} kernels) after an AttentionPlan forward",
                bwd.kernel()
            ),
            Layer::Varlen { .. } => "VarlenBackwardPlan after a VarlenPlan forward".into(),
            Layer::Moe { fwd, .. } => format!(
                "MoeBackwardPlan after the MoE forward ({}), gate/up kept from the forward",
                fwd.gemm_path()
            ),
        };
        let pass = match self.pass {
            Pass::Bwd => "timed: the backward alone over a retained forward",
            _ => "timed: forward then backward",
        };
        vec![what, pass.into()]
    }
}
