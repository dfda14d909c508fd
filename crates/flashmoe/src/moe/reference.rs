//! The GPU fp32 reference of the MoE layer (`kernels/reference/moe_reference.cu`): the ground truth
//! for shapes too large for the CPU f64 reference (`reference::moe::moe_f64`), itself
//! checked against that f64 reference on small shapes (`gpu_tests.rs` and `flashmoe
//! check`).
//!
//! Independent of the fast path: its own logits kernel (the contract's fp32 summation
//! order, so routing is compared exactly), scoring / top-k / weights / losses in f64 on
//! the host by the CPU reference's code, a host-built permutation, plain fp32 tiled
//! GEMMs with h kept in f32, and a combine accumulated in f64.

use super::runner::check_inputs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{Device, DeviceTensor};
use crate::problem::MoeProblem;
use crate::reference::moe::{route_from_logits, MoeInputs, MoeOutput, Routing};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

pub const REFERENCE_SOURCE: &str = "moe_reference.cu";
pub const REF_LOGITS_ENTRY: &str = "moe_ref_logits";
pub const REF_GEMM13_ENTRY: &str = "moe_ref_gemm13";
pub const REF_GEMM2_ENTRY: &str = "moe_ref_gemm2";
pub const REF_COMBINE_ENTRY: &str = "moe_ref_combine";
/// Rows and columns per GEMM block, threads per block (mirror the .cu).
pub const REF_TILE: usize = 64;
pub const REF_THREADS: u32 = 256;
const ELEMWISE_THREADS: u32 = 256;
const MAX_GRID: u64 = i32::MAX as u64;
const MAX_GRID_Y: u64 = 65_535;

/// Defines of every reference kernel for `dtype` (for the compile test and the launcher).
pub fn reference_defines(dtype: DType) -> Result<Vec<(String, String)>> {
    match dtype {
        DType::F16 | DType::Bf16 => Ok(vec![(
            "FM_DTYPE_BF16".to_string(),
            ((dtype == DType::Bf16) as u32).to_string(),
        )]),
        DType::F32 => Err(Error::unsupported(
            "moe-gpu-reference",
            "dtype f32 is not supported (the MoE kernels take f16 or bf16 inputs)",
        )),
    }
}

/// Permuted rows of one group set: `row_token[r]`, the tile list (expert, first row,
/// end row) with at most [`REF_TILE`] rows per tile, and `slot_row[t·k + s]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RefPermutation {
    pub row_token: Vec<u32>,
    pub tiles: Vec<u32>,
    pub slot_row: Vec<u32>,
}

/// Rows grouped by expert (token order within an expert), as the CPU reference does.
pub fn permutation(routing: &Routing, tokens: usize, top_k: usize) -> RefPermutation {
    let experts = routing.expert_counts.len();
    let mut first = Vec::with_capacity(experts + 1);
    let mut acc = 0usize;
    for &c in &routing.expert_counts {
        first.push(acc);
        acc += c;
    }
    first.push(acc);
    let mut next = first.clone();
    let mut row_token = vec![0u32; acc];
    let mut slot_row = vec![0u32; tokens * top_k];
    for (a, &id) in routing.topk_ids.iter().enumerate() {
        let r = next[id as usize];
        next[id as usize] += 1;
        row_token[r] = (a / top_k) as u32;
        slot_row[a] = r as u32;
    }
    RefPermutation {
        row_token,
        tiles: tiles_of(&first),
        slot_row,
    }
}

/// Tile list over groups whose rows start at `first[g]` (`first` has groups + 1 entries).
fn tiles_of(first: &[usize]) -> Vec<u32> {
    let mut tiles = Vec::new();
    for (g, w) in first.windows(2).enumerate() {
        let mut r = w[0];
        while r < w[1] {
            let end = (r + REF_TILE).min(w[1]);
            tiles.extend([g as u32, r as u32, end as u32]);
            r = end;
        }
    }
    tiles
}

fn upload_u32(dev: &Device, name: &str, v: &[u32]) -> Result<CudaSlice<u32>> {
    // A zero-length allocation is not allowed: keep one element.
    let v: &[u32] = if v.is_empty() { &[0] } else { v };
    dev.stream().clone_htod(v).map_err(|e| {
        Error::cuda(
            format!("uploading {name} ({} × u32) to the GPU", v.len()),
            e,
        )
    })
}

fn grid(name: &str, x: u64, y: u64, threads: u32) -> Result<LaunchConfig> {
    if x > MAX_GRID || y > MAX_GRID_Y {
        return Err(Error::unsupported(
            name,
            format!("grid ({x}, {y}) exceeds the CUDA grid limit ({MAX_GRID}, {MAX_GRID_Y})"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (x.max(1) as u32, y.max(1) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn int(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::unsupported(
            "moe-gpu-reference",
            format!("{name} = {v} does not fit the kernels' 32-bit int parameter"),
        )
    })
}

struct Kernels {
    logits: CudaFunction,
    gemm13: CudaFunction,
    gemm2: CudaFunction,
    combine: CudaFunction,
}

/// gemm13 then gemm2 over one group set; returns y [rows, H] f32.
#[allow(clippy::too_many_arguments)]
fn expert_outputs(
    dev: &Device,
    k: &Kernels,
    x: &DeviceTensor,
    w13: &DeviceTensor,
    w2: &DeviceTensor,
    perm_row_token: &[u32],
    tiles: &[u32],
    hidden: usize,
    inter: usize,
) -> Result<DeviceTensor> {
    let rows = perm_row_token.len();
    let n_tiles = (tiles.len() / 3) as u64;
    let row_token = upload_u32(dev, "reference row_token", perm_row_token)?;
    let tiles_d = upload_u32(dev, "reference tiles", tiles)?;
    let mut h = DeviceTensor::alloc(dev, DType::F32, (rows * inter).max(1))?;
    let mut y = DeviceTensor::alloc(dev, DType::F32, (rows * hidden).max(1))?;
    if n_tiles == 0 {
        return Ok(y);
    }
    let (hid, int_) = (int("hidden", hidden)?, int("intermediate", inter)?);
    let stream = dev.stream();
    let tile = REF_TILE as u64;
    {
        let cfg = grid(
            REF_GEMM13_ENTRY,
            n_tiles,
            (inter as u64).div_ceil(tile),
            REF_THREADS,
        )?;
        let mut b = stream.launch_builder(&k.gemm13);
        b.arg(x.as_u16("x")?)
            .arg(&row_token)
            .arg(&tiles_d)
            .arg(w13.as_u16("w13")?)
            .arg(h.as_f32_mut("reference h")?)
            .arg(&hid)
            .arg(&int_);
        // SAFETY: buffers sized for the tile list and shapes documented in the .cu.
        dev.check_launch(REF_GEMM13_ENTRY, unsafe { b.launch(cfg) })?;
    }
    let cfg = grid(
        REF_GEMM2_ENTRY,
        n_tiles,
        (hidden as u64).div_ceil(tile),
        REF_THREADS,
    )?;
    let mut b = stream.launch_builder(&k.gemm2);
    b.arg(h.as_f32("reference h")?)
        .arg(&tiles_d)
        .arg(w2.as_u16("w2")?)
        .arg(y.as_f32_mut("reference y")?)
        .arg(&hid)
        .arg(&int_);
    // SAFETY: as above.
    dev.check_launch(REF_GEMM2_ENTRY, unsafe { b.launch(cfg) })?;
    // Keep row_token / tiles / h alive until the kernels have run.
    dev.synchronize()?;
    Ok(y)
}

/// The MoE layer forward of `p` on `inputs` by the GPU fp32 reference (see the module
/// docs). Output and routing in the CPU reference's types; weights live on the GPU only
/// during the call.
pub fn moe_reference_gpu(dev: &Device, p: &MoeProblem, inputs: &MoeInputs) -> Result<MoeOutput> {
    check_inputs(p, inputs)?;
    let defines = reference_defines(p.dtype)?;
    let load = |entry| dev.load_kernel(REFERENCE_SOURCE, entry, &defines);
    let k = Kernels {
        logits: load(REF_LOGITS_ENTRY)?,
        gemm13: load(REF_GEMM13_ENTRY)?,
        gemm2: load(REF_GEMM2_ENTRY)?,
        combine: load(REF_COMBINE_ENTRY)?,
    };
    let (t, h, i, e, top_k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
    let (t32, h32, e32, k32) = (
        int("tokens", t)?,
        int("hidden", h)?,
        int("experts", e)?,
        int("top_k", top_k)?,
    );
    let stream = dev.stream();

    // 1. logits on the GPU, routing on the host in f64.
    let x = DeviceTensor::from_f32(dev, p.dtype, &inputs.x)?;
    let routing = {
        let router = DeviceTensor::from_f32(dev, p.dtype, &inputs.router)?;
        let mut logits = DeviceTensor::alloc(dev, DType::F32, t * e)?;
        let cfg = grid(
            REF_LOGITS_ENTRY,
            ((t * e) as u64).div_ceil(ELEMWISE_THREADS as u64),
            1,
            ELEMWISE_THREADS,
        )?;
        let mut b = stream.launch_builder(&k.logits);
        b.arg(x.as_u16("x")?)
            .arg(router.as_u16("router")?)
            .arg(logits.as_f32_mut("reference logits")?)
            .arg(&t32)
            .arg(&h32)
            .arg(&e32);
        // SAFETY: x [T, H], router [H, E], logits [T, E].
        dev.check_launch(REF_LOGITS_ENTRY, unsafe { b.launch(cfg) })?;
        route_from_logits(p, &logits.to_f32(dev)?)?
    };

    // 2-3. routed experts, then the shared expert as one group of all tokens.
    let perm = permutation(&routing, t, top_k);
    let y = {
        let w13 = DeviceTensor::from_f32(dev, p.dtype, &inputs.w13)?;
        let w2 = DeviceTensor::from_f32(dev, p.dtype, &inputs.w2)?;
        expert_outputs(dev, &k, &x, &w13, &w2, &perm.row_token, &perm.tiles, h, i)?
    };
    let shared_y = match (&inputs.shared_w13, &inputs.shared_w2, p.shared_expert) {
        (Some(sw13), Some(sw2), true) => {
            let w13 = DeviceTensor::from_f32(dev, p.dtype, sw13)?;
            let w2 = DeviceTensor::from_f32(dev, p.dtype, sw2)?;
            let ids: Vec<u32> = (0..t as u32).collect();
            let tiles = tiles_of(&[0, t]);
            Some(expert_outputs(dev, &k, &x, &w13, &w2, &ids, &tiles, h, i)?)
        }
        _ => None,
    };

    // 4. combine.
    let slot_row = upload_u32(dev, "reference slot_row", &perm.slot_row)?;
    let w: Vec<f32> = routing.topk_weights.iter().map(|&v| v as f32).collect();
    let topk_w = DeviceTensor::from_f32(dev, DType::F32, &w)?;
    let mut out = DeviceTensor::alloc(dev, DType::F32, t * h)?;
    let has_shared = shared_y.is_some() as i32;
    let cfg = grid(
        REF_COMBINE_ENTRY,
        ((t * h) as u64).div_ceil(ELEMWISE_THREADS as u64),
        1,
        ELEMWISE_THREADS,
    )?;
    let mut b = stream.launch_builder(&k.combine);
    b.arg(y.as_f32("reference y")?)
        .arg(&slot_row)
        .arg(topk_w.as_f32("reference topk_w")?)
        .arg(
            shared_y
                .as_ref()
                .unwrap_or(&y)
                .as_f32("reference shared y")?,
        )
        .arg(out.as_f32_mut("reference out")?)
        .arg(&t32)
        .arg(&h32)
        .arg(&k32)
        .arg(&has_shared);
    // SAFETY: y [T·k, H], slot_row and topk_w [T·k], out [T, H]; shared_y read only when set.
    dev.check_launch(REF_COMBINE_ENTRY, unsafe { b.launch(cfg) })?;
    let out = out.to_f32(dev)?;
    Ok(MoeOutput {
        out: out.into_iter().map(f64::from).collect(),
        routing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_groups_rows_by_expert_in_token_order() {
        // 3 tokens, top-2, 4 experts; expert 2 gets nothing.
        let routing = Routing {
            topk_ids: vec![1, 0, 3, 1, 0, 3],
            topk_weights: vec![0.5; 6],
            expert_counts: vec![2, 2, 0, 2],
            aux_loss: 0.0,
            z_loss: 0.0,
            logits: vec![0.0; 12],
        };
        let p = permutation(&routing, 3, 2);
        assert_eq!(p.row_token, [0, 2, 0, 1, 1, 2]);
        assert_eq!(p.slot_row, [2, 0, 4, 3, 1, 5]);
        assert_eq!(p.tiles, [0, 0, 2, 1, 2, 4, 3, 4, 6]);
        for (a, &r) in p.slot_row.iter().enumerate() {
            assert_eq!(p.row_token[r as usize] as usize, a / 2);
        }
    }

    #[test]
    fn tiles_split_long_groups_and_skip_empty_ones() {
        let t = tiles_of(&[0, 130, 130, 131]);
        assert_eq!(t, [0, 0, 64, 0, 64, 128, 0, 128, 130, 2, 130, 131]);
        assert!(tiles_of(&[0, 0]).is_empty());
    }

    #[test]
    fn f32_is_unsupported() {
        assert!(reference_defines(DType::F32).is_err());
        assert_eq!(reference_defines(DType::Bf16).unwrap()[0].1, "1");
    }
}
