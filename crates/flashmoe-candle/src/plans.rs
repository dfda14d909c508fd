//! Process-wide caches behind the entry points, on the library's
//! `flashmoe::attention::cache`: one flashmoe device per GPU, one plan per (GPU,
//! [`PlanKey`]) — making one compiles or loads kernels, so it happens once — and one
//! workspace per CUDA stream, grown to the largest plan that ran on it. Keyed by stream,
//! not device, because candle devices made with `new_with_stream` share a GPU but not a
//! stream, and a workspace may only be reused in stream order. Called from `cuda_fwd.rs`.

use crate::check::PlanKey;
use crate::flashmoe_api::{self as api, Plan, Workspace};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;
use flashmoe::attention::cache::{PlanCache, StreamCache};
use std::sync::{Arc, OnceLock};

/// flashmoe devices by GPU ordinal.
static DEVICES: OnceLock<PlanCache<usize, api::Device>> = OnceLock::new();
/// Plans by (GPU ordinal, key).
static PLANS: OnceLock<PlanCache<(usize, PlanKey), Plan>> = OnceLock::new();
/// Workspaces by `CUstream` handle. A handle is not reused while we hold the workspace: its
/// memory keeps a reference to the stream.
static WORKSPACES: OnceLock<StreamCache<Workspace>> = OnceLock::new();

/// The flashmoe device of the stream's GPU, made on first use (the MLA plans' too).
pub(crate) fn device(stream: &Arc<CudaStream>) -> Result<Arc<api::Device>> {
    DEVICES
        .get_or_init(PlanCache::new)
        .get_or_try_make(stream.context().ordinal(), || api::device(stream.context()))
}

/// Compute capability × 10 of the stream's GPU (what routes a call: `check::check_call`).
pub(crate) fn arch(stream: &Arc<CudaStream>) -> Result<u32> {
    Ok(device(stream)?.arch())
}

/// The plan for `key` on the stream's GPU, made on first use (compiled outside the cache's
/// lock: other classes keep running meanwhile).
pub(crate) fn plan(stream: &Arc<CudaStream>, key: &PlanKey) -> Result<Arc<Plan>> {
    let plans = PLANS.get_or_init(PlanCache::new);
    let k = (stream.context().ordinal(), *key);
    if let Some(p) = plans.get(&k) {
        return Ok(p);
    }
    let dev = device(stream)?;
    plans.get_or_try_make(k, || api::new_plan(&dev, key))
}

/// Run `f` with this stream's workspace, grown first if the call needs more than `need`
/// bytes (`api::workspace_bytes`). The cache's lock is held while `f` enqueues work, which
/// keeps uses of one workspace in stream order.
pub(crate) fn with_workspace<R>(
    stream: &Arc<CudaStream>,
    need: usize,
    f: impl FnOnce(&mut Workspace) -> Result<R>,
) -> Result<R> {
    WORKSPACES.get_or_init(StreamCache::new).with(
        stream.cu_stream() as usize,
        need,
        |n| api::alloc_workspace(stream, n),
        f,
    )
}

/// Drop the cached attention plans, devices and workspaces (their GPU memory is freed in
/// stream order; `crate::clear_caches` calls it). Later calls make them again.
pub(crate) fn clear() {
    if let Some(c) = PLANS.get() {
        c.clear();
    }
    if let Some(c) = DEVICES.get() {
        c.clear();
    }
    if let Some(c) = WORKSPACES.get() {
        c.clear();
    }
}
