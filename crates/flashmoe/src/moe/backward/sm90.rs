//! The backward's routed GEMMs on sm_90a: the row GEMMs gu = X_perm·W13,
//! G = dOut_perm·W2ᵀ and dX_perm = dGU·W13ᵀ on the forward's TMA + wgmma kernel
//! `moe_gemm2_sm90` (f32 out), the last two with its K-major B variant (`FM_B_KMAJOR`: the
//! weights read as they lie); the weight gradients dW2 = (w⊙H)ᵀ·dOut_perm and
//! dW13 = X_permᵀ·dGU on `moe_wgrad_sm90` (K = an expert's rows, persistent over the
//! E · M/128 · N/256 tiles). The rows of x and dOut are first gathered densely by
//! `moe_gather_rows` ([`BwdWorkspaceLayout::perm`]): TMA reads dense operands.
//!
//! Which calls take it ([`RowsPath`]): on an sm_90 device, calls with at least
//! [`SM90_MIN_ROWS_PER_EXPERT`] rows per expert (the forward's threshold: below it both
//! paths stream weights); an explicit path forces one or the other.
//!
//! [`BwdWorkspaceLayout::perm`]: super::BwdWorkspaceLayout::perm

use super::abi::{Sm90Rows, Sm90Wgrad, PLAN};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, RawStream};
use crate::gpu::tensor_map::{self, TensorMap};
use crate::gpu::Device;
use crate::moe::forward::plan::MoeClass;
use crate::moe::gemm::sm90::{
    a_layout, b_kmajor_layout, b_layout, gather_kernel, row_tiles, sm90_bwd_tile,
    sm90_launch_config, wgrad_kernel, wgrad_operand_layout, wgrad_tiles, GATHER_THREADS,
    SM90_MIN_ROWS_PER_EXPERT, SM90_THREADS, WGRAD_TILE,
};
use crate::moe::kernel::MoeKernel;
use cudarc::driver::{CudaFunction, LaunchConfig};
use std::ffi::c_void;

/// Which kernels run the routed GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowsPath {
    /// sm_90a when the device is sm_90 and a call has enough rows per expert.
    Auto,
    Portable,
    /// sm_90a on every call; a plan error elsewhere.
    Sm90,
}

impl RowsPath {
    /// The lab's override strings, as the forward's
    /// ([`MoePlan::with_gemm_path`](crate::moe::MoePlan::with_gemm_path)): None, "" and
    /// "auto"; "portable"; "sm90" (also "sm90-bm64" / "sm90-bm128", whose tile height
    /// is the forward's: the backward has one tile).
    pub(super) fn parse(path: Option<&str>) -> Result<RowsPath> {
        match path {
            None | Some("") | Some("auto") => Ok(RowsPath::Auto),
            Some("portable") => Ok(RowsPath::Portable),
            Some("sm90") | Some("sm90-bm64") | Some("sm90-bm128") => Ok(RowsPath::Sm90),
            Some(other) => Err(Error::unsupported(
                PLAN,
                format!(
                    "gemm path override '{other}': choose auto, portable, sm90, sm90-bm64 or \
                     sm90-bm128"
                ),
            )),
        }
    }
}

/// The loaded sm_90a row-GEMM kernels of a plan.
pub(super) struct Sm90RowKernels {
    dtype: DType,
    /// B `[k][n]` (gu) and B `[n][k]` (G, dX_perm).
    mn: (MoeKernel, CudaFunction),
    km: (MoeKernel, CudaFunction),
    wgrad: (MoeKernel, CudaFunction),
    gather: CudaFunction,
    /// Resident blocks of the persistent weight-gradient kernel (one per SM).
    sm_count: u32,
    /// Every call takes them (forced), or only calls with enough rows per expert.
    forced: bool,
}

fn load(dev: &Device, k: MoeKernel) -> Result<(MoeKernel, CudaFunction)> {
    let f = dev.load_kernel(k.source_file, k.entry, &k.defines)?;
    dev.set_dynamic_shared_memory(k.entry, &f, k.shared_mem_bytes)?;
    Ok((k, f))
}

impl Sm90RowKernels {
    /// The kernels `path` asks for on `dev` (None: the portable kernels run every GEMM).
    /// The tensor maps' rules are checked here for the largest call of `class` (a smaller
    /// call only has fewer rows).
    pub(super) fn for_path(
        dev: &Device,
        class: &MoeClass,
        path: RowsPath,
    ) -> Result<Option<Sm90RowKernels>> {
        let arch = dev.arch();
        match path {
            RowsPath::Portable => return Ok(None),
            RowsPath::Auto if arch != 90 => return Ok(None),
            RowsPath::Sm90 if arch != 90 => {
                return Err(Error::unsupported(
                    PLAN,
                    format!(
                        "the gemm path override forces sm90 but compute capability {}.{} is \
                         not 9.0",
                        arch / 10,
                        arch % 10
                    ),
                ))
            }
            _ => {}
        }
        let (h, i, e) = (class.hidden, class.intermediate, class.experts);
        let rows = class.max_tokens * class.top_k;
        let mn = sm90_bwd_tile(false).kernel(class.dtype);
        for (name, l) in [
            ("x_perm", a_layout(rows, h, mn.block_m)),
            ("dGU", a_layout(rows, 2 * i, mn.block_m)),
            ("w13", b_layout(e, h, 2 * i)),
            ("w13 as [E][H][2I] K-major", b_kmajor_layout(e, h, 2 * i)),
            ("w2 as [E][I][H] K-major", b_kmajor_layout(e, i, h)),
            ("w⊙h", wgrad_operand_layout(rows, i)),
            ("dOut_perm", wgrad_operand_layout(rows, h)),
            ("dGU", wgrad_operand_layout(rows, 2 * i)),
            ("dw2", b_layout(e, i, h)),
            ("dw13", b_layout(e, h, 2 * i)),
        ] {
            l.check(name)?;
        }
        Ok(Some(Sm90RowKernels {
            dtype: class.dtype,
            mn: load(dev, mn)?,
            km: load(dev, sm90_bwd_tile(true).kernel(class.dtype))?,
            wgrad: load(dev, wgrad_kernel(class.dtype, WGRAD_TILE))?,
            sm_count: dev.info().sm_count.max(1),
            gather: load(dev, gather_kernel())?.1,
            forced: path == RowsPath::Sm90,
        }))
    }

    /// The lab's A/B of the weight-gradient pipeline: reload that kernel with `tile`.
    #[cfg(all(test, feature = "lab"))]
    pub(super) fn set_wgrad_tile(
        &mut self,
        dev: &Device,
        tile: crate::moe::gemm::sm90::WgradTile,
    ) -> Result<()> {
        self.wgrad = load(dev, wgrad_kernel(self.dtype, tile))?;
        Ok(())
    }

    /// Whether a call of `tokens` tokens of `class` takes these kernels.
    pub(super) fn serves(&self, class: &MoeClass, tokens: usize) -> bool {
        let rows_per_expert = (tokens * class.top_k) as f64 / class.experts as f64;
        self.forced || rows_per_expert >= SM90_MIN_ROWS_PER_EXPERT
    }

    /// `dst[r] = src[row_token[r]]` for `rows` rows of `cols` 16-bit elements.
    ///
    /// # Safety
    /// The addresses hold those rows on the plan's context; `row_token` entries index
    /// `src`'s rows.
    pub(super) unsafe fn gather(
        &self,
        stream: RawStream,
        (src, row_token, dst): (u64, u64, u64),
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let cols = cols as i32;
        let mut p: [*mut c_void; 4] = [param(&src), param(&row_token), param(&dst), param(&cols)];
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (GATHER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        raw::launch("moe_gather_rows", &self.gather, cfg, stream, &mut p)
    }

    /// One row GEMM, tensor maps encoded over this call's addresses.
    ///
    /// # Safety
    /// As [`Self::gather`]: every address of `g` holds its operand (16-byte aligned) on the
    /// plan's context; `offsets` is non-decreasing from 0 to `g.rows`.
    pub(super) unsafe fn rows(&self, stream: RawStream, g: &Sm90Rows) -> Result<()> {
        let (kernel, func) = if g.b_kmajor { &self.km } else { &self.mn };
        let dt = tensor_map::map_data_type("the backward's row GEMM", self.dtype)?;
        let (n, k, e, r) = (g.n as u64, g.k as u64, g.experts as u64, g.rows as u64);
        // Layout rules checked at plan time (`for_path`); only the rows vary.
        let b_map = if g.b_kmajor {
            tensor_map::encode_checked(
                "B [E][n][k]",
                g.b,
                dt,
                &[k, n, e],
                &[k, n * k],
                &[64, 64, 1],
            )
        } else {
            tensor_map::encode_checked(
                "B [E][k][n]",
                g.b,
                dt,
                &[n, k, e],
                &[n, k * n],
                &[64, 64, 1],
            )
        }?;
        let maps: [TensorMap; 2] = [
            tensor_map::encode_checked("A rows", g.a, dt, &[k, r], &[k], &[64, kernel.block_m])?,
            b_map,
        ];
        let cfg = sm90_launch_config(kernel, g.rows, g.experts, g.n)?;
        let (ni, ki, ei) = (g.n as i32, g.k as i32, g.experts as i32);
        let tiles = row_tiles(g.rows, g.experts, kernel.block_m) as i32;
        let mut p: [*mut c_void; 8] = [
            param(&maps[0]),
            param(&maps[1]),
            param(&g.offsets),
            param(&g.c),
            param(&ni),
            param(&ki),
            param(&ei),
            param(&tiles),
        ];
        raw::launch(kernel.entry, func, cfg, stream, &mut p)
    }

    /// One weight gradient, tensor maps encoded over this call's addresses.
    ///
    /// # Safety
    /// As [`Self::rows`]; `dw` holds `[E][m][n]` 16-bit elements.
    pub(super) unsafe fn wgrad(&self, stream: RawStream, g: &Sm90Wgrad) -> Result<()> {
        let (kernel, func) = &self.wgrad;
        let dt = tensor_map::map_data_type("the backward's weight gradient", self.dtype)?;
        let (m, n, r) = (g.m as u64, g.n as u64, g.rows as u64);
        // Layout rules checked at plan time (`for_path`); only the rows vary.
        let e = g.experts as u64;
        let maps: [TensorMap; 3] = [
            tensor_map::encode_checked("wgrad A", g.a, dt, &[m, r], &[m], &[64, 64])?,
            tensor_map::encode_checked("wgrad B", g.b, dt, &[n, r], &[n], &[64, 64])?,
            tensor_map::encode_checked("dW", g.dw, dt, &[n, m, e], &[n, m * n], &[64, 64, 1])?,
        ];
        let tiles = wgrad_tiles(g.experts, g.m, g.n);
        let tiles = i32::try_from(tiles).map_err(|_| {
            Error::unsupported(kernel.entry, format!("{tiles} weight-gradient tiles"))
        })?;
        let cfg = LaunchConfig {
            grid_dim: ((tiles as u32).min(self.sm_count).max(1), 1, 1),
            block_dim: (SM90_THREADS, 1, 1),
            shared_mem_bytes: kernel.shared_mem_bytes,
        };
        let (mi, ni, ei) = (g.m as i32, g.n as i32, g.experts as i32);
        let mut p: [*mut c_void; 8] = [
            param(&maps[0]),
            param(&maps[1]),
            param(&maps[2]),
            param(&g.offsets),
            param(&mi),
            param(&ni),
            param(&ei),
            param(&tiles),
        ];
        raw::launch(kernel.entry, func, cfg, stream, &mut p)
    }
}
