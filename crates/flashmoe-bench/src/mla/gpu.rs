//! `flashmoe-mla`: the MLA decode plan ([`MlaDecodePlan`]) on an MLA config, timed with
//! CUDA events after an L2 flush like every native implementation. The plan is used as an
//! engine would: built once per class, its workspace allocated once, `forward_raw`
//! enqueued on the lab's stream over buffers that live as long as the prepared
//! implementation.
//!
//! The cache is the latent paged with the problem's page size and the shuffled block table
//! of [`crate::mla::PagedLatent`], holding the same rows as the dense latent every other
//! implementation reads.

use crate::mla::{MlaProblem, PagedLatent};
use crate::results::ProblemSpec;
use crate::runner::gpu::GpuSession;
use crate::runner::plan_backed::{AttentionOut, PlanBacked, PlanCall};
use crate::runner::{Implementation, Outputs, Prepared, SuiteInputs};
use anyhow::Context;
use cudarc::driver::{CudaSlice, DevicePtr};
use flashmoe::attention::mla::{MlaArgs, MlaDecodePlan, RawIndex, D_QK, D_V};
use flashmoe::gpu::{Device, DeviceTensor, Workspace};
use flashmoe::DType;
use std::rc::Rc;

pub struct GpuMla {
    pub session: Rc<GpuSession>,
}

impl Implementation for GpuMla {
    fn name(&self) -> &str {
        "flashmoe-mla"
    }
    fn backend(&self) -> &str {
        "cuda"
    }
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        let ProblemSpec::Mla(p) = problem else {
            return Err("the MLA decode plan runs MLA configs".into());
        };
        p.class().validate().map_err(|e| e.to_string())
    }
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        let (ProblemSpec::Mla(p), SuiteInputs::Attention(x)) = (problem, inputs) else {
            anyhow::bail!("the MLA plan given a non-MLA config");
        };
        let call = MlaCall::new(&self.session.device, p, x).context("preparing the MLA plan")?;
        Ok(Box::new(PlanBacked::new(&self.session, call)))
    }
}

/// The plan, its workspace and every buffer its raw arguments point into.
struct MlaCall {
    plan: MlaDecodePlan,
    args: MlaArgs,
    workspace: Workspace,
    splits: usize,
    m_blocks: usize,
    // Owned for the addresses in `args`.
    _q: DeviceTensor,
    _kv: DeviceTensor,
    _table: CudaSlice<i32>,
    _seqused: CudaSlice<i32>,
    out: AttentionOut,
}

impl MlaCall {
    fn new(
        dev: &Device,
        p: &MlaProblem,
        x: &flashmoe::reference::AttentionInputs,
    ) -> anyhow::Result<MlaCall> {
        let s = dev.stream();
        let (b, sq, hq) = (p.batch, p.seqlen_q, p.heads_q);
        let (nb, ps, mb) = (p.num_blocks(), p.page_size, p.max_blocks());
        let paged = PagedLatent::build(p, &x.k);
        let q = DeviceTensor::from_f32(dev, p.dtype, &x.q)?;
        let kv = DeviceTensor::from_f32(dev, p.dtype, &paged.cache)?;
        drop(paged.cache);
        let o = DeviceTensor::alloc(dev, p.dtype, p.o_elems())?;
        let lse = DeviceTensor::alloc(dev, DType::F32, p.lse_elems())?;
        let table = s.clone_htod(&paged.table)?;
        let seqused: Vec<i32> = p.seqused().into_iter().map(|n| n as i32).collect();
        let seqused = s.clone_htod(&seqused)?;
        let args = MlaArgs {
            q: q.raw(dev, "q", &[b, sq, hq, D_QK])?,
            kv_cache: kv.raw(dev, "kv_cache", &[nb, ps, D_QK])?,
            block_table: RawIndex::matrix(table.device_ptr(s).0, b, mb),
            seqused_k: RawIndex::vector(seqused.device_ptr(s).0, b),
            o: o.raw(dev, "o", &[b, sq, hq, D_V])?,
            lse: lse.raw(dev, "lse", &[b, sq, hq])?,
            max_seqlen_k: Some(p.seqlen_k),
        };
        let plan = MlaDecodePlan::new(dev, p.class())?;
        let shape = plan.check(&args)?;
        let workspace = plan.alloc_workspace(s)?;
        Ok(MlaCall {
            plan,
            args,
            workspace,
            splits: shape.splits,
            m_blocks: shape.m_blocks,
            _q: q,
            _kv: kv,
            _table: table,
            _seqused: seqused,
            out: AttentionOut { o, lse },
        })
    }
}

impl PlanCall for MlaCall {
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()> {
        let s = dev.stream();
        // SAFETY: every address in `args` points into a buffer owned by `self` and sized
        // for its tensor (checked by `plan.check` at prepare); seqused_k <= max_seqlen_k =
        // the table's capacity; the table holds a permutation of the blocks; the workspace
        // is the plan's (`workspace_bytes`, every call of the class) and used only on this
        // one stream.
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
        // The split-KV partials.
        Some(self.workspace.bytes() as u64)
    }
    fn notes(&self) -> Vec<String> {
        let k = self.plan.kernel();
        vec![format!(
            "paged latent: page {} with a shuffled block table; {} KV split(s) × {} row \
             tile(s) of 64 per sequence; {} keys a tile",
            self.plan.class().page_size,
            self.splits,
            self.m_blocks,
            k.block_n
        )]
    }
}
