//! [`MlaDecodePlan`]: the kernels of one class, resolved once; the raw layer (pointers on
//! the caller's stream) and the cudarc layer.

use super::abi::*;
use super::args::*;
use super::class::MlaDecodeClass;
use super::select::*;
use crate::attention::launch::SplitDevice;
use crate::attention::plan::Bshd;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, Element, RawIndex, RawStream, RawTensor, RawWorkspace};
use crate::gpu::{Device, Workspace};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use std::ffi::c_void;
use std::sync::Arc;

/// MLA decode kernels resolved for one class on one device.
pub struct MlaDecodePlan {
    class: MlaDecodeClass,
    kernel: MlaKernel,
    fwd: CudaFunction,
    combine: CudaFunction,
    split: SplitDevice,
}

impl std::fmt::Debug for MlaDecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlaDecodePlan")
            .field("class", &self.class)
            .field("kernel", &self.kernel)
            .field("split", &self.split)
            .finish()
    }
}

impl MlaDecodePlan {
    /// Validate `class`, compile (or load from the disk cache) its kernels for `dev`, set
    /// the shared-memory limit and read the occupancy the split heuristic uses.
    pub fn new(dev: &Device, class: MlaDecodeClass) -> Result<MlaDecodePlan> {
        let kernel = Self::kernels_for(dev, class.dtype)?[0].clone();
        Self::with_kernel(dev, class, kernel)
    }

    /// The builds `dev` can run for `dtype`, the one [`MlaDecodePlan::new`] selects first
    /// (on sm_90a: wgmma, then the portable mma.sync build, for tests and the lab).
    pub fn kernels_for(dev: &Device, dtype: DType) -> Result<Vec<MlaKernel>> {
        let optin = dev.info().max_shared_memory_per_block_optin;
        let sm90a = dev.arch() == 90 && dev.compile_arch()? == "sm_90a";
        let mut v = vec![MlaKernel::for_device(dtype, optin, sm90a)];
        let portable = MlaKernel::for_device(dtype, optin, false);
        if !v.contains(&portable) {
            v.push(portable);
        }
        Ok(v)
    }

    /// [`MlaDecodePlan::new`] with a given build (one of [`MlaDecodePlan::kernels_for`]).
    pub fn with_kernel(
        dev: &Device,
        class: MlaDecodeClass,
        kernel: MlaKernel,
    ) -> Result<MlaDecodePlan> {
        class.validate()?;
        if !Self::kernels_for(dev, class.dtype)?.contains(&kernel) {
            return Err(Error::unsupported(
                MLA_ENTRY,
                format!("build {kernel:?} does not run on {}", dev.info().name),
            ));
        }
        let defs = kernel.defines();
        let (fwd, split) = SplitDevice::load_main(
            dev,
            "mma.sync, cp.async",
            MLA_SOURCE,
            MLA_ENTRY,
            &defs,
            kernel.shared_mem_bytes(),
            THREADS,
        )?;
        let combine = dev.load_kernel(MLA_SOURCE, COMBINE_ENTRY, &defs)?;
        Ok(MlaDecodePlan {
            class,
            kernel,
            fwd,
            combine,
            split,
        })
    }

    /// Force the number of KV splits (clamped to 1..=[`MAX_SPLITS`]); None restores the
    /// heuristic. [`MlaDecodePlan::workspace_bytes`] follows.
    pub fn with_splits(mut self, splits: Option<usize>) -> MlaDecodePlan {
        self.split.set_override(splits, MAX_SPLITS);
        self
    }

    pub fn class(&self) -> &MlaDecodeClass {
        &self.class
    }
    pub fn kernel(&self) -> &MlaKernel {
        &self.kernel
    }

    /// KV splits of a call with `batch` sequences of at most `max_seqlen_k` keys: the
    /// override, else [`mla_split_heuristic`] over B · row blocks (at `max_q_per_seq`) CTAs.
    /// Independent of the call's Sq.
    pub fn splits(&self, batch: usize, max_seqlen_k: usize) -> usize {
        let ctas = batch * self.class.m_blocks(self.class.max_q_per_seq);
        self.split
            .splits(|slots| mla_split_heuristic(ctas, slots, max_seqlen_k.div_ceil(64)))
    }

    /// Workspace bytes of a call of `batch` sequences bounded by `max_seqlen_k` keys (0 when
    /// it runs unsplit).
    pub fn call_workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        partial_bytes(
            self.splits(batch, max_seqlen_k),
            batch * self.class.max_q_per_seq * self.class.heads_q,
        )
        .1
    }

    /// Workspace bytes that serve every call of the class (batch <= `max_batch`, keys <=
    /// `max_seqlen_k`): the largest [`MlaDecodePlan::call_workspace_bytes`] (O(max_batch),
    /// once per plan).
    pub fn workspace_bytes(&self) -> usize {
        (1..=self.class.max_batch)
            .map(|b| self.call_workspace_bytes(b, self.class.max_seqlen_k))
            .max()
            .unwrap_or(0)
    }

    /// A workspace for every call of the class on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.workspace_bytes())
    }

    /// Check a call against the class and the kernel's rules, O(1); errors name the tensor
    /// and the rule.
    pub fn check(&self, a: &MlaArgs) -> Result<MlaShape> {
        check_call(&self.class, a, |b, n| self.splits(b, n))
    }

    /// Enqueue MLA decode on `stream`: one launch, plus the split merge when the call is
    /// split. Reads and writes only the caller's memory and `workspace`.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` is live device memory of
    /// this plan's context covering its tensor's span; `seqused_k[b] <= max_seqlen_k` (the
    /// kernel clamps to the table's capacity and never reads a block id outside
    /// `[0, num_blocks)`); the table's entries for the keys in use are valid block ids;
    /// `workspace` covers [`MlaDecodePlan::call_workspace_bytes`] (any contents) and no
    /// launch that may run at the same time uses it; `stream` belongs to the context.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &MlaArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let s = self.check(a)?;
        let c = &self.class;
        let rows = s.batch * s.seqlen_q * c.heads_q;
        let (lse_off, need) = partial_bytes(s.splits, rows);
        workspace.check(need, 16, "MlaDecodePlan")?;
        crate::gpu::device::bind_context(&self.split.ctx)?;
        let st = |t: &RawTensor, i: usize| t.strides[i] as i64;
        let split = need > 0;
        let (o_part, lse_part) = if split {
            (workspace.ptr, workspace.ptr + lse_off as u64)
        } else {
            (0, 0)
        };
        let p = MlaParams {
            q: a.q.ptr,
            kv: a.kv_cache.ptr,
            o: a.o.ptr,
            lse: a.lse.ptr,
            block_table: a.block_table.ptr,
            seqused_k: a.seqused_k.ptr,
            o_part,
            lse_part,
            q_sb: st(&a.q, 0),
            q_ss: st(&a.q, 1),
            q_sh: st(&a.q, 2),
            kv_sblk: st(&a.kv_cache, 0),
            kv_srow: st(&a.kv_cache, 1),
            bt_stride: a.block_table.row_stride as i64,
            batch: s.batch as i32,
            seqlen_q: s.seqlen_q as i32,
            heads_q: c.heads_q as i32,
            page_size: s.page_size as i32,
            max_blocks: s.max_blocks as i32,
            num_blocks: s.num_blocks as i32,
            splits: s.splits as i32,
            m_blocks: s.m_blocks as i32,
            scale_log2: c.softmax_scale * std::f32::consts::LOG2_E,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: ((s.splits * s.m_blocks) as u32, s.batch as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.kernel.shared_mem_bytes(),
        };
        let mut params: [*mut c_void; 1] = [param(&p)];
        raw::launch(MLA_ENTRY, &self.fwd, cfg, stream, &mut params)?;
        if split {
            let cp = CombineParams {
                o_part,
                lse_part,
                o: a.o.ptr,
                lse: a.lse.ptr,
                rows: i32_of("output rows", rows)?,
                splits: s.splits as i32,
            };
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params: [*mut c_void; 1] = [param(&cp)];
            raw::launch(COMBINE_ENTRY, &self.combine, cfg, stream, &mut params)?;
        }
        Ok(())
    }

    /// [`MlaDecodePlan::forward_raw`] over cudarc buffers on a cudarc stream: lengths checked
    /// against the views' spans, the stream against the plan's context and the workspace's
    /// stream. `kv_cache` is viewed `[num_blocks, page_size, 1, 576]`, `block_table`
    /// `[B, max_blocks]` row-major, lse `[B, Sq, Hq]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, Q, K, O>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        kv_cache: Bshd<&K>,
        block_table: &CudaSlice<i32>,
        seqused_k: &CudaSlice<i32>,
        o: Bshd<&mut O>,
        lse: &mut CudaSlice<f32>,
        max_seqlen_k: Option<usize>,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        crate::gpu::device::check_stream_context(stream, &self.split.ctx)?;
        let b = q.shape[0];
        let (hq, sq) = (self.class.heads_q, q.shape[1]);
        let (qp, _gq) = q.buf.device_ptr(stream);
        let (kp, _gk) = kv_cache.buf.device_ptr(stream);
        let (btp, _gb) = block_table.device_ptr(stream);
        let (sup, _gs) = seqused_k.device_ptr(stream);
        let (o_len, lse_len) = (o.buf.len(), lse.len());
        let (op, _go) = o.buf.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let args = MlaArgs {
            q: RawTensor::new(qp, T::DTYPE, &q.shape, &q.strides)?,
            kv_cache: RawTensor::new(kp, T::DTYPE, &kv_cache.shape, &kv_cache.strides)?,
            block_table: RawIndex::block_table(btp, block_table.len(), b)?,
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
            o: RawTensor::new(op, T::DTYPE, &o.shape, &o.strides)?,
            lse: RawTensor::contiguous(lp, DType::F32, &[b, sq, hq])?,
            max_seqlen_k,
        };
        let shape = self.check(&args)?;
        for (name, t, len) in [
            ("q", &args.q, q.buf.len()),
            ("kv_cache", &args.kv_cache, kv_cache.buf.len()),
            ("o", &args.o, o_len),
            ("lse", &args.lse, lse_len),
        ] {
            t.check_within(name, len)?;
        }
        let need = partial_bytes(shape.splits, b * sq * hq).1;
        workspace.check_for(stream, need, "MlaDecodePlan")?;
        let raw_ws = workspace.raw();
        // SAFETY: every buffer is a live cudarc allocation of the plan's context covering
        // its view's span (checked above); the guards keep cudarc's stream order until after
        // the launches; the workspace is bound to this stream (launches in order).
        unsafe { self.forward_raw(stream.cu_stream(), &args, raw_ws) }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<MlaDecodePlan>();
}
