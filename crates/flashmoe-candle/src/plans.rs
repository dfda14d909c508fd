//! Process-wide caches behind the entry points: one flashmoe plan per (GPU, [`PlanKey`]) —
//! making one compiles or loads kernels, so it happens once — and one workspace per CUDA
//! stream, grown to the largest plan that ran on it. Keyed by stream, not device, because
//! candle devices made with `new_with_stream` share a GPU but not a stream, and a
//! workspace may only be reused in stream order. Called from `cuda_fwd.rs`.

use crate::check::PlanKey;
use crate::flashmoe_api::{self as api, Plan, Workspace};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

struct Gpu {
    dev: Arc<api::Device>,
    plans: HashMap<PlanKey, Arc<Plan>>,
}

/// Plans by GPU ordinal.
static PLANS: OnceLock<Mutex<HashMap<usize, Gpu>>> = OnceLock::new();

pub(crate) struct StreamWorkspace {
    pub bytes: usize,
    pub ws: Workspace,
}

/// Workspaces by `CUstream` handle. A handle is not reused while we hold the workspace: its
/// memory keeps a reference to the stream.
static WORKSPACES: OnceLock<Mutex<HashMap<usize, StreamWorkspace>>> = OnceLock::new();

fn lock<T>(m: &'static OnceLock<Mutex<T>>, init: fn() -> T) -> MutexGuard<'static, T> {
    // A panic while holding the lock leaves the maps consistent (inserts are atomic).
    m.get_or_init(|| Mutex::new(init()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The flashmoe device of the stream's GPU, made on first use.
fn device(stream: &Arc<CudaStream>) -> Result<Arc<api::Device>> {
    let ordinal = stream.context().ordinal();
    let mut gpus = lock(&PLANS, HashMap::new);
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.dev.clone());
    }
    let dev = Arc::new(api::device(stream.context())?);
    gpus.insert(
        ordinal,
        Gpu {
            dev: dev.clone(),
            plans: HashMap::new(),
        },
    );
    Ok(dev)
}

/// Compute capability × 10 of the stream's GPU (what routes a call: `check::check_call`).
pub(crate) fn arch(stream: &Arc<CudaStream>) -> Result<u32> {
    Ok(device(stream)?.arch())
}

/// The plan for `key` on the stream's GPU, made on first use.
pub(crate) fn plan(stream: &Arc<CudaStream>, key: &PlanKey) -> Result<Arc<Plan>> {
    let ordinal = stream.context().ordinal();
    if let Some(p) = lock(&PLANS, HashMap::new)
        .get(&ordinal)
        .and_then(|g| g.plans.get(key))
    {
        return Ok(p.clone());
    }
    let dev = device(stream)?;
    // Compile outside the lock: other classes keep running meanwhile. Two threads racing
    // on a new class both compile; the first insert wins.
    let made = Arc::new(api::new_plan(&dev, key)?);
    let mut gpus = lock(&PLANS, HashMap::new);
    // clear_caches may have run meanwhile: the entry is made again then.
    let gpu = gpus.entry(ordinal).or_insert_with(|| Gpu {
        dev: dev.clone(),
        plans: HashMap::new(),
    });
    Ok(gpu.plans.entry(*key).or_insert(made).clone())
}

/// Run `f` with this stream's workspace, grown first if the call needs more than `need`
/// bytes (`api::workspace_bytes`). The lock is held while `f` enqueues work, which keeps
/// uses of one workspace in stream order.
pub(crate) fn with_workspace<R>(
    stream: &Arc<CudaStream>,
    need: usize,
    f: impl FnOnce(&mut Workspace) -> Result<R>,
) -> Result<R> {
    let mut all = lock(&WORKSPACES, HashMap::new);
    let key = stream.cu_stream() as usize;
    let grow = all.get(&key).is_none_or(|w| w.bytes < need);
    if grow {
        // Freeing the old one is stream-ordered, so work queued on it finishes first.
        all.remove(&key);
        let ws = api::alloc_workspace(stream, need)?;
        all.insert(key, StreamWorkspace { bytes: need, ws });
    }
    f(&mut all.get_mut(&key).expect("inserted above").ws)
}

/// Drop every cached plan and workspace (their GPU memory is freed in stream order).
/// Later calls make them again.
pub fn clear_caches() {
    lock(&PLANS, HashMap::new).clear();
    lock(&WORKSPACES, HashMap::new).clear();
}
