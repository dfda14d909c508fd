//! Attention plans: the kernel for one shape class, resolved once, then enqueued on the
//! caller's stream over the caller's memory.
//!
//! [`AttentionPlan::new`] does the slow work once per [`AttentionClass`] (dtype, head dim,
//! head counts, causal, scale): kernel selection for the device, NVRTC compile or disk
//! cache, module load, the shared-memory attribute. A call then does O(1) shape checks,
//! encodes the four TMA tensor maps (host-only driver calls) and makes one
//! `cuLaunchKernel` on the stream it is given: no allocation, no synchronisation, no
//! compile, no file or environment access. So it can be captured in a CUDA graph.
//!
//! Two layers:
//! - [`AttentionPlan::forward_raw`]: [`RawTensor`]s and a [`RawStream`] (what C, Python or
//!   another engine holds); `unsafe`, contract in [`crate::gpu::raw`].
//! - [`AttentionPlan::forward`]: cudarc slices or views of `half::bf16` / `half::f16`
//!   (candle's storage), lengths checked against the shapes, stream order kept by cudarc.
//!
//! ALiBi ([`AttentionPlan::new_alibi`], [`AttentionPlan::forward_raw_alibi`],
//! [`AttentionPlan::forward_alibi`]) follows FlashAttention: per-head slopes (f32, shape
//! `[heads_q]` or `[batch, heads_q]`) and the bias `-slope · |i + seqlen_k - seqlen_q - j|`
//! added to the logit of query i and key j, after the softcap (so the logit is
//! `softcap · tanh(scale · q·k / softcap) - slope · |…|`, or `scale · q·k - slope · |…|`),
//! under any mask (none, causal, sliding window). It runs on the portable kernel on every
//! GPU, Hopper included: the sm_90a kernel has no ALiBi yet.
//!
//! The sm_90a kernel needs a [`Workspace`] (its rank dispenser and split-tile records):
//! [`AttentionPlan::workspace_bytes`] bytes, zeroed once; every launch leaves it zeroed.
//! Launches that may run at the same time (on different streams) need one each.

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::{KernelAbi, KernelVariant, LogitParams, Masking};
use super::tma;
use super::{abi, select};
use crate::attention::launch::{launch_with_logits, launch_with_logits_tail};
use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::gpu::raw::Element;
use crate::gpu::raw::{param, RawStream, RawTensor, RawWorkspace};
use crate::gpu::{Device, Workspace};
use crate::problem::AttentionProblem;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};
use std::sync::Arc;

/// What a plan is built for: everything about an attention call except batch size and
/// sequence lengths, which each call takes from its tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionClass {
    /// Storage of q, k, v and o: bf16 or f16 (fp32 accumulation).
    pub dtype: DType,
    pub head_dim: usize,
    pub heads_q: usize,
    /// Divides `heads_q` (GQA / MQA; equal for MHA).
    pub heads_kv: usize,
    /// Bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q.
    pub causal: bool,
    /// Multiplies q·k; None is 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
    /// Sliding window `(left, right)` around each row's bottom-right diagonal, -1 =
    /// unbounded ([`AttentionProblem::window`]; [`crate::problem::NO_WINDOW`]: none).
    /// `causal` bounds the right side at 0.
    pub window: (i32, i32),
    /// Logit softcap: scores become `softcap · tanh(scores / softcap)`; 0 = off.
    pub softcap: f32,
}

impl AttentionClass {
    /// The problem of one call of this class.
    pub fn problem(&self, batch: usize, seqlen_q: usize, seqlen_k: usize) -> AttentionProblem {
        AttentionProblem {
            batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim: self.head_dim,
            causal: self.causal,
            dtype: self.dtype,
            softmax_scale: self.softmax_scale,
            window: self.window,
            softcap: self.softcap,
        }
    }

    /// The checks of a call's inputs that need no GPU, O(1): q, k and v are 4-D views of
    /// the class's dtype and head counts with consistent batch, sequence and head dims,
    /// 16-byte aligned, innermost dimension contiguous, no dimension empty. Returns the
    /// call's batch size and sequence lengths; errors name the tensor and the rule. Plans
    /// add the kernel's own rules ([`AttentionPlan::check`]).
    pub fn check_inputs(&self, q: &RawTensor, k: &RawTensor, v: &RawTensor) -> Result<CallShape> {
        let (hq, hkv, d) = (self.heads_q, self.heads_kv, self.head_dim);
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank != 4 {
                return Err(Error::invalid(format!(
                    "{name} must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                    t.shape()
                )));
            }
        }
        let [b, sq, _, _] = q.shape;
        let sk = k.shape[1];
        q.expect("q", self.dtype, &[b, sq, hq, d], 16)?;
        k.expect("k", self.dtype, &[b, sk, hkv, d], 16)?;
        v.expect("v", self.dtype, &[b, sk, hkv, d], 16)?;
        if b == 0 || sq == 0 || sk == 0 {
            return Err(Error::invalid(format!(
                "empty attention call: batch {b}, seqlen_q {sq}, seqlen_k {sk} (each must be >= 1)"
            )));
        }
        Ok(CallShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
        })
    }
}

impl From<&AttentionProblem> for AttentionClass {
    fn from(p: &AttentionProblem) -> AttentionClass {
        AttentionClass {
            dtype: p.dtype,
            head_dim: p.head_dim,
            heads_q: p.heads_q,
            heads_kv: p.heads_kv,
            causal: p.causal,
            softmax_scale: p.softmax_scale,
            window: p.window,
            softcap: p.softcap,
        }
    }
}

/// The tensors of one call, raw. Shapes: q and o (batch, seqlen_q, heads_q, head_dim),
/// k and v (batch, seqlen_k, heads_kv, head_dim), lse (batch, heads_q, seqlen_q) f32,
/// natural log. q, k and v may be strided views (a packed QKV buffer, a transposed
/// (batch, heads, seq, dim) tensor) with a contiguous last dimension and strides that are
/// multiples of 8 elements; o too on the portable kernel (the sm_90a kernel and the fp32
/// reference take o contiguous, the reference q, k and v as well). lse is contiguous. No
/// copy is made. A query row that sees no key gets O = 0 and LSE = -inf.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub lse: RawTensor,
}

/// The portable kernel's last parameter (`FmStrides` in flash_attn_fwd.cu): the element
/// strides (batch, seq, head) of q, k, v and o.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct V1Strides {
    q: [i64; 3],
    k: [i64; 3],
    v: [i64; 3],
    o: [i64; 3],
}

/// The (batch, seq, head) strides of a 4-D view as the portable kernel takes them: each a
/// multiple of 8 elements (16-byte rows for cp.async and 16-byte stores), size-1 dimensions
/// passed as 0 (any stride there is never applied). Errors name the tensor.
fn v1_strides(name: &str, t: &RawTensor) -> Result<[i64; 3]> {
    let mut out = [0i64; 3];
    for (i, o) in out.iter_mut().enumerate() {
        if t.shape[i] <= 1 {
            continue;
        }
        let s = t.strides[i];
        if s % 8 != 0 {
            return Err(Error::invalid(format!(
                "{name}'s strides {:?} must be multiples of 8 elements in the batch, sequence \
                 and head dimensions (16-byte rows) for the portable kernel",
                t.strides()
            )));
        }
        *o = i64::try_from(s)
            .map_err(|_| Error::invalid(format!("{name}'s stride {s} exceeds i64")))?;
    }
    Ok(out)
}

/// Batch size and sequence lengths of a checked call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
}

/// A (batch, seq, heads, head_dim) view over a cudarc buffer (`CudaSlice`, `CudaView`,
/// `CudaViewMut`): element strides, the last 1. `B` is `&S` for inputs, `&mut S` for o.
#[derive(Debug)]
pub struct Bshd<B> {
    pub buf: B,
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

impl<B> Bshd<B> {
    pub fn new(buf: B, shape: [usize; 4], strides: [usize; 4]) -> Bshd<B> {
        Bshd {
            buf,
            shape,
            strides,
        }
    }
    /// Row-major (batch, seq, heads, head_dim).
    pub fn contiguous(buf: B, shape: [usize; 4]) -> Bshd<B> {
        let [_, s, h, d] = shape;
        Bshd {
            buf,
            shape,
            strides: [s * h * d, h * d, d, 1],
        }
    }
}

/// One attention kernel resolved for a shape class on one device.
pub struct AttentionPlan {
    class: AttentionClass,
    variant: KernelVariant,
    func: CudaFunction,
    ctx: Arc<CudaContext>,
    sm_count: u32,
    masking: Masking,
    logits: LogitParams,
    /// The variant adds ALiBi biases (`FM_ALIBI`): every call passes slopes.
    alibi: bool,
}

impl std::fmt::Debug for AttentionPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttentionPlan")
            .field("class", &self.class)
            .field("entry", &self.variant.entry)
            .field("workspace_bytes", &self.workspace_bytes())
            .finish()
    }
}

impl AttentionPlan {
    /// Resolve the kernel [`select::select`] picks for `class` on `dev` (the sm_90a kernel
    /// on Hopper for head dims 64 and 128, else the portable one), compile or load it and
    /// set its shared-memory limit.
    pub fn new(dev: &Device, class: AttentionClass) -> Result<AttentionPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        let variant = select::select(&problem, dev.arch())?;
        Self::with_variant(dev, class, variant)
    }

    /// A plan for ALiBi calls of `class` (module docs): the portable kernel with the class's
    /// masking (none, causal, sliding window) and softcap, on any GPU from sm_80 (the sm_90a
    /// kernel has no ALiBi). Calls go through [`AttentionPlan::forward_raw_alibi`] or
    /// [`AttentionPlan::forward_alibi`] with the slopes.
    pub fn new_alibi(dev: &Device, class: AttentionClass) -> Result<AttentionPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        let variant = select::select_v1_alibi(&problem)?;
        Self::with_variant(dev, class, variant)
    }

    /// Like [`AttentionPlan::new`] with a given kernel variant (the lab runs v1 on Hopper
    /// and the fp32 reference kernel this way).
    pub fn with_variant(
        dev: &Device,
        class: AttentionClass,
        variant: KernelVariant,
    ) -> Result<AttentionPlan> {
        let problem = class.problem(1, 1, 1);
        problem.validate()?;
        if let Err(why) = variant.runs_on(dev.arch()) {
            return Err(Error::unsupported(
                variant.entry,
                format!(
                    "{why}, but {} is {}.{}",
                    dev.info().name,
                    dev.info().compute_capability.0,
                    dev.info().compute_capability.1
                ),
            ));
        }
        let func = dev.load_kernel(variant.source_file, variant.entry, &variant.defines)?;
        dev.set_dynamic_shared_memory(variant.entry, &func, variant.shared_mem_bytes)?;
        let masking = Masking::of(&problem);
        if variant.define("FM_WINDOW").is_some() != masking.window
            || variant.define("FM_SOFTCAP").is_some() != masking.softcap
        {
            return Err(Error::unsupported(
                variant.entry,
                format!(
                    "the variant's defines {:?} do not match the class's window {:?} and \
                     softcap {}",
                    variant.defines, class.window, class.softcap
                ),
            ));
        }
        let alibi = variant.define("FM_ALIBI").is_some();
        Ok(AttentionPlan {
            alibi,
            class,
            masking,
            logits: LogitParams::of(&problem),
            variant,
            func,
            ctx: dev.context().clone(),
            sm_count: dev.info().sm_count,
        })
    }

    /// Multiprocessors of the plan's device (the persistent grid's size).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    pub fn class(&self) -> &AttentionClass {
        &self.class
    }
    pub fn variant(&self) -> &KernelVariant {
        &self.variant
    }
    /// Whether the plan adds ALiBi biases ([`AttentionPlan::new_alibi`]).
    pub fn alibi(&self) -> bool {
        self.alibi
    }

    /// Check the ALiBi slopes of a call of `batch` sequences against the plan: present
    /// exactly when the plan is an ALiBi one, f32, shape `[heads_q]` (one slope per head for
    /// the whole batch) or `[batch, heads_q]`, contiguous heads, 4-byte aligned. Returns the
    /// kernel's batch stride (0 for one vector).
    pub fn check_alibi(&self, slopes: Option<&RawTensor>, batch: usize) -> Result<i32> {
        let hq = self.class.heads_q;
        let s = match (self.alibi, slopes) {
            (false, None) => return Ok(0),
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "ALiBi slopes were passed to a plan built without ALiBi (build it with \
                     AttentionPlan::new_alibi)",
                ))
            }
            (true, None) => {
                return Err(Error::invalid(
                    "this plan adds ALiBi biases (AttentionPlan::new_alibi): pass the slopes \
                     (forward_raw_alibi / forward_alibi)",
                ))
            }
            (true, Some(s)) => s,
        };
        match s.rank {
            1 => {
                s.expect("alibi_slopes", DType::F32, &[hq], 4)?;
                Ok(0)
            }
            2 => {
                s.expect("alibi_slopes", DType::F32, &[batch, hq], 4)?;
                let stride = if batch == 1 { 0 } else { s.strides[0] };
                i32::try_from(stride).map_err(|_| {
                    Error::invalid(format!(
                        "alibi_slopes' batch stride {stride} does not fit the kernel's int"
                    ))
                })
            }
            _ => Err(Error::invalid(format!(
                "alibi_slopes must have shape [heads_q] = [{hq}] or [batch, heads_q] = \
                 [{batch}, {hq}] (f32) but has shape {:?}",
                s.shape()
            ))),
        }
    }
    /// Element type of o: the class's dtype, or f32 for the reference kernel.
    pub fn out_dtype(&self) -> DType {
        if self.variant.entry == abi::REFERENCE_ENTRY {
            DType::F32
        } else {
            self.class.dtype
        }
    }

    /// Bytes of the zeroed workspace each launch needs (0: none).
    pub fn workspace_bytes(&self) -> usize {
        match self.variant.abi {
            KernelAbi::TensorMaps {
                workspace_bytes, ..
            } => workspace_bytes,
            KernelAbi::Pointers => 0,
        }
    }

    /// A zeroed workspace for this plan on `stream` (allocates: do it once).
    pub fn alloc_workspace(&self, stream: &Arc<CudaStream>) -> Result<Workspace> {
        Workspace::zeroed(stream, self.workspace_bytes())
    }

    /// Check a call's tensors against the class and the kernel's rules, O(1); returns the
    /// batch size and sequence lengths. Errors name the tensor and the rule.
    pub fn check(&self, a: &AttentionArgs) -> Result<CallShape> {
        let shape = self.class.check_inputs(&a.q, &a.k, &a.v)?;
        let CallShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
        } = shape;
        let c = &self.class;
        let (hq, d) = (c.heads_q, c.head_dim);
        if a.o.rank != 4 {
            return Err(Error::invalid(format!(
                "o must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                a.o.shape()
            )));
        }
        let portable = self.variant.entry == abi::FLASH_ENTRY;
        if portable {
            a.o.expect("o", self.out_dtype(), &[b, sq, hq, d], 16)?;
        } else {
            a.o.expect_contiguous("o", self.out_dtype(), &[b, sq, hq, d], 16)?;
        }
        a.lse
            .expect_contiguous("lse", DType::F32, &[b, hq, sq], 4)?;
        for (what, value) in [("seqlen_q", sq), ("seqlen_k", sk)] {
            if value > abi::MAX_SEQLEN {
                return Err(Error::unsupported(
                    self.variant.entry,
                    format!("{what} = {value} exceeds {}", abi::MAX_SEQLEN),
                ));
            }
        }
        match self.variant.abi {
            KernelAbi::Pointers if portable => {
                for (name, t) in [("q", &a.q), ("k", &a.k), ("v", &a.v), ("o", &a.o)] {
                    v1_strides(name, t)?;
                }
            }
            KernelAbi::Pointers => {
                for (name, t) in [("q", &a.q), ("k", &a.k), ("v", &a.v)] {
                    if !t.is_contiguous() {
                        return Err(Error::unsupported(
                            self.variant.entry,
                            format!(
                                "{name} is a strided view (strides {:?}); the reference kernel \
                                 takes contiguous q, k and v",
                                t.strides()
                            ),
                        ));
                    }
                }
            }
            KernelAbi::TensorMaps { .. } => {
                let tiles = select::sm90_work_tiles(&c.problem(b, sq, sk), self.variant.block_m);
                if 2 * tiles > i32::MAX as u64 {
                    return Err(Error::unsupported(
                        self.variant.entry,
                        format!("{tiles} work tiles exceed the kernel's int work-tile counter"),
                    ));
                }
            }
        }
        Ok(shape)
    }

    /// Enqueue the forward pass on `stream`: `o = softmax(scale · q kᵀ [+ causal mask]) v`
    /// and `lse`. Asynchronous; O(1) checks ([`AttentionPlan::check`]), no allocation.
    ///
    /// # Safety
    /// The contract of [`crate::gpu::raw`]: every address in `a` and `workspace ..
    /// workspace + workspace_bytes()` is live device memory of this plan's context covering
    /// its tensor's span, the workspace is zeroed (as every launch leaves it) and not used
    /// by a launch that may run at the same time, and `stream` belongs to the context.
    /// The workspace is checked for size and alignment.
    pub unsafe fn forward_raw(
        &self,
        stream: RawStream,
        a: &AttentionArgs,
        workspace: RawWorkspace,
    ) -> Result<()> {
        self.forward_raw_alibi(stream, a, None, workspace)
    }

    /// [`AttentionPlan::forward_raw`] with ALiBi slopes (module docs): `alibi_slopes` is
    /// `Some` exactly on a plan from [`AttentionPlan::new_alibi`] ([`AttentionPlan::check_alibi`]
    /// names the rules).
    ///
    /// # Safety
    /// As [`AttentionPlan::forward_raw`]; the slopes' address is live device memory of the
    /// plan's context covering their span.
    pub unsafe fn forward_raw_alibi(
        &self,
        stream: RawStream,
        a: &AttentionArgs,
        alibi_slopes: Option<&RawTensor>,
        workspace: RawWorkspace,
    ) -> Result<()> {
        let shape = self.check(a)?;
        let alibi_stride = self.check_alibi(alibi_slopes, shape.batch)?;
        let alibi_ptr = alibi_slopes.map_or(0, |s| s.ptr);
        workspace.check(self.workspace_bytes(), 16, "AttentionPlan")?;
        crate::gpu::device::bind_context(&self.ctx)?;
        let problem = self
            .class
            .problem(shape.batch, shape.seqlen_q, shape.seqlen_k);
        let (sq, sk, hq, hkv, b) = (
            shape.seqlen_q as i32,
            shape.seqlen_k as i32,
            self.class.heads_q as i32,
            self.class.heads_kv as i32,
            shape.batch as i32,
        );
        let (q, k, v, o, lse) = (a.q.ptr, a.k.ptr, a.v.ptr, a.o.ptr, a.lse.ptr);
        match self.variant.abi {
            KernelAbi::Pointers => {
                let cfg = crate::attention::launch::launch_config(&problem, &self.variant)?;
                let params = [
                    param(&q),
                    param(&k),
                    param(&v),
                    param(&o),
                    param(&lse),
                    param(&sq),
                    param(&sk),
                    param(&hq),
                    param(&hkv),
                    param(&self.logits.scale_log2),
                ];
                // The portable kernel ends with the ALiBi slopes (FM_ALIBI) and the strides;
                // the reference kernel has neither.
                let strides = if self.variant.entry == abi::FLASH_ENTRY {
                    Some(V1Strides {
                        q: v1_strides("q", &a.q)?,
                        k: v1_strides("k", &a.k)?,
                        v: v1_strides("v", &a.v)?,
                        o: v1_strides("o", &a.o)?,
                    })
                } else {
                    None
                };
                let mut tail = [std::ptr::null_mut(); 3];
                let mut n = 0;
                if self.alibi {
                    tail[0] = param(&alibi_ptr);
                    tail[1] = param(&alibi_stride);
                    n = 2;
                }
                if let Some(st) = &strides {
                    tail[n] = param(st);
                    n += 1;
                }
                launch_with_logits_tail(
                    self.variant.entry,
                    &self.func,
                    cfg,
                    stream,
                    &params,
                    self.masking,
                    &self.logits,
                    &tail[..n],
                )
            }
            KernelAbi::TensorMaps {
                block_n,
                persistent,
                ..
            } => {
                let dt = self.class.dtype;
                let bm = self.variant.block_m;
                let pq = tma::bshd_strided_params("q", a.q.shape, a.q.strides, bm)?;
                let pk = tma::bshd_strided_params("k", a.k.shape, a.k.strides, block_n)?;
                let pv = tma::bshd_strided_params("v", a.v.shape, a.v.strides, block_n)?;
                let po =
                    tma::bshd_strided_params("o", a.o.shape, a.o.strides, tma::O_STORE_BOX_ROWS)?;
                let maps = [
                    tma::encode("q", &pq, dt, q)?,
                    tma::encode("k", &pk, dt, k)?,
                    tma::encode("v", &pv, dt, v)?,
                    tma::encode("o", &po, dt, o)?,
                ];
                let cfg = LaunchConfig {
                    grid_dim: (
                        select::sm90_grid_x(&problem, bm, persistent, self.sm_count),
                        1,
                        1,
                    ),
                    block_dim: (self.variant.block_threads, 1, 1),
                    shared_mem_bytes: self.variant.shared_mem_bytes,
                };
                let ws = workspace.ptr;
                let params = [
                    param(&maps[0]),
                    param(&maps[1]),
                    param(&maps[2]),
                    param(&maps[3]),
                    param(&o),
                    param(&lse),
                    param(&sq),
                    param(&sk),
                    param(&hq),
                    param(&hkv),
                    param(&self.logits.scale_log2),
                    param(&b),
                    param(&ws),
                ];
                launch_with_logits(
                    self.variant.entry,
                    &self.func,
                    cfg,
                    stream,
                    &params,
                    self.masking,
                    &self.logits,
                )
            }
        }
    }

    /// [`AttentionPlan::forward_raw`] over cudarc buffers on a cudarc stream (candle's
    /// storage and stream): each buffer's length is checked against its view's span, the
    /// stream against the plan's context, and cudarc's stream-order tracking is kept.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T, Q, K, V, O, L>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        k: Bshd<&K>,
        v: Bshd<&V>,
        o: Bshd<&mut O>,
        lse: &mut L,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        V: DevicePtr<T>,
        O: DevicePtrMut<T>,
        L: DevicePtrMut<f32>,
    {
        self.forward_impl::<T, Q, K, V, O, L, cudarc::driver::CudaSlice<f32>>(
            stream, q, k, v, o, lse, None, workspace,
        )
    }

    /// [`AttentionPlan::forward`] with ALiBi slopes over a cudarc buffer: `slopes` holds
    /// `[heads_q]` or `[batch, heads_q]` f32 values (`slopes_shape`, row-major; module docs),
    /// its length checked against the shape.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_alibi<T, Q, K, V, O, L, S>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        k: Bshd<&K>,
        v: Bshd<&V>,
        o: Bshd<&mut O>,
        lse: &mut L,
        slopes: (&S, &[usize]),
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        V: DevicePtr<T>,
        O: DevicePtrMut<T>,
        L: DevicePtrMut<f32>,
        S: DevicePtr<f32>,
    {
        self.forward_impl(stream, q, k, v, o, lse, Some(slopes), workspace)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_impl<T, Q, K, V, O, L, S>(
        &self,
        stream: &Arc<CudaStream>,
        q: Bshd<&Q>,
        k: Bshd<&K>,
        v: Bshd<&V>,
        o: Bshd<&mut O>,
        lse: &mut L,
        slopes: Option<(&S, &[usize])>,
        workspace: &mut Workspace,
    ) -> Result<()>
    where
        T: Element,
        Q: DevicePtr<T>,
        K: DevicePtr<T>,
        V: DevicePtr<T>,
        O: DevicePtrMut<T>,
        L: DevicePtrMut<f32>,
        S: DevicePtr<f32>,
    {
        crate::gpu::device::check_stream_context(stream, &self.ctx)?;
        workspace.check_for(stream, self.workspace_bytes(), "AttentionPlan")?;
        let (hq, sq, b) = (self.class.heads_q, q.shape[1], q.shape[0]);
        let (qp, _gq) = q.buf.device_ptr(stream);
        let (kp, _gk) = k.buf.device_ptr(stream);
        let (vp, _gv) = v.buf.device_ptr(stream);
        let (o_len, lse_len) = (o.buf.len(), lse.len());
        let (op, _go) = o.buf.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let args = AttentionArgs {
            q: RawTensor::new(qp, T::DTYPE, &q.shape, &q.strides)?,
            k: RawTensor::new(kp, T::DTYPE, &k.shape, &k.strides)?,
            v: RawTensor::new(vp, T::DTYPE, &v.shape, &v.strides)?,
            o: RawTensor::new(op, T::DTYPE, &o.shape, &o.strides)?,
            lse: RawTensor::contiguous(lp, DType::F32, &[b, hq, sq])?,
        };
        let shape = self.check(&args)?;
        let (sp, _gs) = match slopes {
            Some((buf, dims)) => {
                let (p, g) = buf.device_ptr(stream);
                let t = RawTensor::contiguous(p, DType::F32, dims)?;
                if t.span_elems() > buf.len() as u64 {
                    return Err(Error::invalid(format!(
                        "alibi_slopes' shape {dims:?} spans {} elements but its buffer holds {}",
                        t.span_elems(),
                        buf.len()
                    )));
                }
                (Some(t), Some(g))
            }
            None => (None, None),
        };
        self.check_alibi(sp.as_ref(), shape.batch)?;
        for (name, t, len) in [
            ("q", &args.q, q.buf.len()),
            ("k", &args.k, k.buf.len()),
            ("v", &args.v, v.buf.len()),
            ("o", &args.o, o_len),
            ("lse", &args.lse, lse_len),
        ] {
            t.check_within(name, len)?;
        }
        let ws = workspace.raw();
        // SAFETY: every buffer is a live cudarc allocation of the plan's context (checked
        // above) covering its view's span; the guards keep cudarc's stream order until
        // after the launch; the workspace is the plan's size, zeroed when allocated and
        // left zeroed by every launch, and bound to this stream (launches in order).
        unsafe { self.forward_raw_alibi(stream.cu_stream(), &args, sp.as_ref(), ws) }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<AttentionPlan>();
    f::<Workspace>();
}
