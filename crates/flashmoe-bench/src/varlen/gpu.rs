//! Varlen prefill on the GPU, timed with CUDA events after an L2 flush like every native
//! implementation:
//!
//! - `flashmoe-sm90`: the varlen plan ([`VarlenPlan`]) used as an engine would: built once
//!   per class, its workspace allocated once, `forward_raw` enqueued on the lab's stream
//!   over the packed buffers and the int32 offsets in device memory, which live as long as
//!   the prepared implementation;
//! - `flashmoe-sm90-dense`: the dense sm_90a kernel (the attention suite's `flashmoe-sm90`)
//!   on configs whose sequences all have the same lengths, where the packed tensors are a
//!   dense `(B, S, H, D)` batch: the "dense on the same tokens" row of issue 22's target
//!   (its LSE `(B, Hq, S)` is rearranged to the packed `(Hq, B · S)` for the gate).

use crate::attention::gpu::RunnerCall;
use crate::results::ProblemSpec;
use crate::runner::gpu::GpuSession;
use crate::runner::plan_backed::{AttentionOut, PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use crate::varlen::VarlenProblem;
use anyhow::Context;
use cudarc::driver::{CudaSlice, DevicePtr};
use flashmoe::attention::decode::RawIndex;
use flashmoe::attention::prefill::abi;
use flashmoe::attention::{varlen, AttentionRunner, VarlenArgs, VarlenPlan};
use flashmoe::gpu::{Device, DeviceTensor, Workspace};
use flashmoe::reference::AttentionInputs;
use flashmoe::DType;
use std::rc::Rc;

/// `flashmoe-sm90` on a varlen config: one [`VarlenPlan`] launch over the packed batch.
pub struct GpuVarlen {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuVarlen {
    fn name(&self) -> &str {
        "flashmoe-sm90"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Varlen(p) = problem else {
            return Err("the varlen plan runs varlen configs".into());
        };
        let variant = varlen::varlen_variant(&p.class()).map_err(|e| e.to_string())?;
        let arch = self.session.device.arch();
        variant
            .runs_on(arch)
            .map_err(|why| format!("the varlen kernel {why} (this GPU is sm_{arch})"))?;
        for (what, n) in [("total_q", p.total_q()), ("total_k", p.total_k())] {
            if n > abi::MAX_SEQLEN {
                return Err(format!(
                    "{what} = {n} exceeds the kernel's {}",
                    abi::MAX_SEQLEN
                ));
            }
        }
        Ok(())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Varlen(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("the varlen plan given a non-varlen config");
        };
        let call =
            VarlenCall::new(&self.session.device, p, x).context("preparing the varlen plan")?;
        Ok(Box::new(PlanBacked::new(&self.session, call)))
    }
}

/// The plan, its workspace and every buffer its raw arguments point into.
struct VarlenCall {
    plan: VarlenPlan,
    args: VarlenArgs,
    workspace: Workspace,
    sequences: usize,
    // Owned for the addresses in `args`.
    _q: DeviceTensor,
    _k: DeviceTensor,
    _v: DeviceTensor,
    _cu_seqlens_q: CudaSlice<i32>,
    _cu_seqlens_k: CudaSlice<i32>,
    out: AttentionOut,
}

impl VarlenCall {
    fn new(dev: &Device, p: &VarlenProblem, x: &AttentionInputs) -> anyhow::Result<VarlenCall> {
        let s = dev.stream();
        let (hq, hkv, d) = (p.heads_q, p.heads_kv, p.head_dim);
        let (tq, tk, b) = (p.total_q(), p.total_k(), p.batch());
        let q = DeviceTensor::from_f32(dev, p.dtype, &x.q)?;
        let k = DeviceTensor::from_f32(dev, p.dtype, &x.k)?;
        let v = DeviceTensor::from_f32(dev, p.dtype, &x.v)?;
        let o = DeviceTensor::alloc(dev, p.dtype, tq * hq * d)?;
        let lse = DeviceTensor::alloc(dev, DType::F32, hq * tq)?;
        let to_i32 = |v: Vec<usize>| v.into_iter().map(|n| n as i32).collect::<Vec<_>>();
        let cu_q = s.clone_htod(&to_i32(p.cu_seqlens_q()))?;
        let cu_k = s.clone_htod(&to_i32(p.cu_seqlens_k()))?;
        let args = VarlenArgs {
            q: q.raw(dev, "q", &[tq, hq, d])?,
            k: k.raw(dev, "k", &[tk, hkv, d])?,
            v: v.raw(dev, "v", &[tk, hkv, d])?,
            o: o.raw(dev, "o", &[tq, hq, d])?,
            lse: lse.raw(dev, "lse", &[hq, tq])?,
            cu_seqlens_q: RawIndex::vector(cu_q.device_ptr(s).0, b + 1),
            cu_seqlens_k: RawIndex::vector(cu_k.device_ptr(s).0, b + 1),
            max_seqlen_q: p.max_seqlen_q(),
            max_seqlen_k: p.max_seqlen_k(),
        };
        let plan = VarlenPlan::new(dev, p.class())?;
        plan.check(&args)?;
        let workspace = plan.alloc_workspace(s)?;
        Ok(VarlenCall {
            plan,
            args,
            workspace,
            sequences: b,
            _q: q,
            _k: k,
            _v: v,
            _cu_seqlens_q: cu_q,
            _cu_seqlens_k: cu_k,
            out: AttentionOut { o, lse },
        })
    }
}

impl PlanCall for VarlenCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let s = dev.stream();
        // SAFETY: every address in `args` points into a buffer owned by `self` and sized
        // for its tensor (checked by `plan.check` at prepare); the offsets are the
        // problem's, non-decreasing from 0 to the totals; the workspace is the plan's,
        // zeroed when allocated and left zeroed by every launch, used only on this stream.
        unsafe {
            self.plan
                .forward_raw(s.cu_stream(), &self.args, self.workspace.raw())
        }
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.out.poison(dev)
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        self.out.download(dev)
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        // The work-tile dispenser; the offsets are inputs.
        Some(self.workspace.bytes() as u64)
    }
    fn notes(&self) -> Vec<String> {
        vec![format!(
            "VarlenPlan: one launch over {} packed sequences (int32 cu_seqlens on the device)",
            self.sequences
        )]
    }
}

/// `flashmoe-sm90-dense`: the dense sm_90a kernel on a uniform varlen config viewed as a
/// dense batch ([`VarlenProblem::dense`]).
pub struct GpuVarlenDense {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuVarlenDense {
    fn name(&self) -> &str {
        "flashmoe-sm90-dense"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Varlen(p) = problem else {
            return Err("the dense comparison runs varlen configs".into());
        };
        let d = p.dense().ok_or(
            "the dense kernel runs only batches whose sequences all have the same lengths",
        )?;
        let variant =
            flashmoe::attention::runner::select_sm90_for_lab(&d).map_err(|e| e.to_string())?;
        let arch = self.session.device.arch();
        variant
            .runs_on(arch)
            .map_err(|why| format!("{why} (this GPU is sm_{arch})"))
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Varlen(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("the dense comparison given a non-varlen config");
        };
        let d = p
            .dense()
            .context("the dense comparison given a ragged varlen config")?;
        let dev = &self.session.device;
        let runner = AttentionRunner::with_variant(
            dev,
            &d,
            &x.q,
            &x.k,
            &x.v,
            flashmoe::attention::runner::select_sm90_for_lab(&d)?,
        )
        .context("preparing the dense sm_90a kernel")?;
        let call = DenseCall {
            dense: RunnerCall { runner },
            problem: d,
        };
        Ok(Box::new(PlanBacked::new(&self.session, call)))
    }
}

/// The dense kernel's call ([`RunnerCall`]) with its LSE in the packed varlen layout.
struct DenseCall {
    dense: RunnerCall,
    problem: flashmoe::AttentionProblem,
}

impl PlanCall for DenseCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.dense.launch(dev)
    }
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.dense.poison(dev)
    }
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs> {
        match self.dense.outputs(dev)? {
            Outputs::Attention { o, lse } => Ok(Outputs::Attention {
                o,
                lse: dense_lse_to_packed(&self.problem, &lse),
            }),
            other => Ok(other),
        }
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        self.dense.peak_extra_bytes()
    }
    fn notes(&self) -> Vec<String> {
        let p = &self.problem;
        vec![format!(
            "the dense sm_90a kernel on (B={}, S={}, H, D): the packed tensors as a dense batch",
            p.batch, p.seqlen_q
        )]
    }
}

/// A dense LSE `(B, Hq, S)` as the packed varlen LSE `(Hq, B · S)`.
pub fn dense_lse_to_packed(p: &flashmoe::AttentionProblem, lse: &[f32]) -> Vec<f32> {
    let (b, hq, s) = (p.batch, p.heads_q, p.seqlen_q);
    let mut out = vec![0f32; lse.len()];
    for bi in 0..b {
        for h in 0..hq {
            let src = (bi * hq + h) * s;
            let dst = h * b * s + bi * s;
            out[dst..dst + s].copy_from_slice(&lse[src..src + s]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::reference::attention_f64;

    /// The dense reference of a uniform batch, its LSE rearranged, is the varlen
    /// reference: what the dense comparison row is gated against.
    #[test]
    fn dense_lse_rearranged_is_the_varlen_layout() {
        let p = VarlenProblem::new(&[9, 9, 9], 4, 2, 64, true, DType::Bf16);
        let d = p.dense().unwrap();
        let x = AttentionInputs::generate(&p.packed(), 5);
        let dense = attention_f64(&d, &x).unwrap();
        let packed = crate::varlen::reference_f64(&p, &x).unwrap();
        assert_eq!(dense.o, packed.o);
        let lse32: Vec<f32> = dense.lse.iter().map(|&v| v as f32).collect();
        let want: Vec<f32> = packed.lse.iter().map(|&v| v as f32).collect();
        assert_eq!(dense_lse_to_packed(&d, &lse32), want);
    }
}
