//! `flashmoe-decode`: the paged-KV decode plan ([`DecodePlan`]) on a decode config, timed
//! with CUDA events after an L2 flush like every native implementation. The plan is used
//! exactly as an engine would: built once per
//! class, its workspace allocated once, `forward_raw` enqueued on the lab's stream over
//! buffers that live as long as the prepared implementation.
//!
//! The cache is paged with the problem's page size and the shuffled block table of
//! [`crate::decode::block_table`], holding the same K/V as the dense inputs every other
//! implementation reads.

use crate::decode::{DecodeProblem, PagedCache};
use crate::results::ProblemSpec;
use crate::runner::gpu::GpuSession;
use crate::runner::plan_backed::{AttentionOut, PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use anyhow::Context;
use cudarc::driver::{CudaSlice, DevicePtr};
use flashmoe::attention::decode::{DecodeArgs, DecodePlan, RawIndex};
use flashmoe::gpu::{Device, DeviceTensor, Workspace};
use flashmoe::DType;
use std::rc::Rc;

pub struct GpuDecode {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuDecode {
    fn name(&self) -> &str {
        "flashmoe-decode"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Decode(p) = problem else {
            return Err("the paged decode plan runs decode configs".into());
        };
        p.class().validate().map_err(|e| e.to_string())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Decode(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("the decode plan given a non-decode config");
        };
        let call =
            DecodeCall::new(&self.session.device, p, x).context("preparing the decode plan")?;
        Ok(Box::new(PlanBacked::new(&self.session, call)))
    }
}

/// The plan, its workspace and every buffer its raw arguments point into.
struct DecodeCall {
    plan: DecodePlan,
    args: DecodeArgs,
    workspace: Workspace,
    splits: usize,
    // Owned for the addresses in `args`.
    _q: DeviceTensor,
    _k: DeviceTensor,
    _v: DeviceTensor,
    _table: CudaSlice<i32>,
    _seqused: CudaSlice<i32>,
    _cu_seqlens_q: Option<CudaSlice<i32>>,
    out: AttentionOut,
}

impl DecodeCall {
    fn new(
        dev: &Device,
        p: &DecodeProblem,
        x: &flashmoe::reference::AttentionInputs,
    ) -> anyhow::Result<DecodeCall> {
        let s = dev.stream();
        let (b, sq, hq, hkv, d) = (p.batch, p.seqlen_q, p.heads_q, p.heads_kv, p.head_dim);
        let (nb, ps, mb) = (p.num_blocks(), p.page_size, p.max_blocks());
        let cache = PagedCache::build(p, x);
        // A mixed batch packs each sequence's rows (cu_seqlens_q); o and lse follow.
        let tq = p.total_q();
        let q = DeviceTensor::from_f32(dev, p.dtype, &p.pack_q(&x.q))?;
        let k = DeviceTensor::from_f32(dev, p.dtype, &cache.k)?;
        let v = DeviceTensor::from_f32(dev, p.dtype, &cache.v)?;
        drop(cache.k);
        drop(cache.v);
        let o = DeviceTensor::alloc(dev, p.dtype, tq * hq * d)?;
        let lse = DeviceTensor::alloc(dev, DType::F32, tq * hq)?;
        let table = s.clone_htod(&cache.table)?;
        let to_i32 = |v: Vec<usize>| v.into_iter().map(|n| n as i32).collect::<Vec<_>>();
        let seqused = s.clone_htod(&to_i32(p.seqused()))?;
        let cu = p
            .cu_seqlens_q()
            .map(|cu| s.clone_htod(&to_i32(cu)))
            .transpose()?;
        let (q_shape, lse_shape): (Vec<usize>, Vec<usize>) = match cu {
            None => (vec![b, sq, hq, d], vec![b, hq, sq]),
            Some(_) => (vec![tq, hq, d], vec![hq, tq]),
        };
        let args = DecodeArgs {
            q: q.raw(dev, "q", &q_shape)?,
            k_cache: k.raw(dev, "k_cache", &[nb, ps, hkv, d])?,
            v_cache: v.raw(dev, "v_cache", &[nb, ps, hkv, d])?,
            block_table: RawIndex::matrix(table.device_ptr(s).0, b, mb),
            seqused_k: RawIndex::vector(seqused.device_ptr(s).0, b),
            o: o.raw(dev, "o", &q_shape)?,
            lse: lse.raw(dev, "lse", &lse_shape)?,
            max_seqlen_k: Some(p.seqlen_k),
            cu_seqlens_q: cu
                .as_ref()
                .map(|cu| RawIndex::vector(cu.device_ptr(s).0, b + 1)),
        };
        let plan = DecodePlan::new(dev, p.class())?;
        let shape = plan.check(&args)?;
        let workspace = plan.alloc_workspace(s, b, p.seqlen_k)?;
        Ok(DecodeCall {
            plan,
            args,
            workspace,
            splits: shape.splits,
            _q: q,
            _k: k,
            _v: v,
            _table: table,
            _seqused: seqused,
            _cu_seqlens_q: cu,
            out: AttentionOut { o, lse },
        })
    }
}

impl PlanCall for DecodeCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let s = dev.stream();
        // SAFETY: every address in `args` points into a buffer owned by `self` and sized
        // for its tensor (checked by `plan.check` at prepare); seqused_k = max_seqlen_k;
        // the table holds a permutation of the blocks; the workspace is the plan's, sized
        // for (batch, max_seqlen_k), and used only on this one stream.
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
        // The split-KV partials; the paged cache replaces the dense one.
        Some(self.workspace.bytes() as u64)
    }
    fn notes(&self) -> Vec<String> {
        let c = self.plan.class();
        vec![format!(
            "paged cache: page {} with a shuffled block table; {} KV split(s), {} CTAs/SM",
            c.page_size,
            self.splits,
            self.plan.ctas_per_sm()
        )]
    }
}
