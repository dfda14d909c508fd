//! [`MoePlan`]: the layer resolved for a class on one device (every token range's kernels
//! loaded, the plan's token tables uploaded) and what a call's size selects: its kernels,
//! launch geometry, workspace and checks.

use super::class::{MoeArgs, MoeClass};
use super::ranges::{load, plan_selections, Bucket, TokenRange};
use super::workspace::WorkspaceLayout;
use crate::error::{Error, Result};
use crate::gpu::Device;
use crate::moe::forward::launch::pipeline_configs;
use crate::moe::forward::{
    abi::BACKEND,
    select::{self, MoeKernel},
};
use crate::moe::gemm::sm90::{self, GemmPath};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, LaunchConfig};
use std::sync::Arc;

/// The MoE layer resolved for a shape class on one device.
pub struct MoePlan {
    pub(super) class: MoeClass,
    pub(super) min_tokens: usize,
    pub(super) ctx: Arc<CudaContext>,
    /// Compute capability and the path override the plan was built with (to word the
    /// portable path's reason in reports).
    pub(super) arch: u32,
    pub(super) path: Option<String>,
    /// Every distinct kernel of the plan, loaded once.
    pub(super) loaded: Vec<(MoeKernel, CudaFunction)>,
    pub(super) topk: usize,
    pub(super) stats: usize,
    pub(super) losses: usize,
    pub(super) permute: usize,
    pub(super) combine: usize,
    pub(super) gather: Option<usize>,
    pub(super) buckets: Vec<Bucket>,
    /// `[0, max_tokens)` then the pairs `[0, T]` for T = 1..=max_tokens (module doc).
    pub(super) _tables: CudaSlice<u32>,
    pub(super) iota_addr: u64,
    pub(super) pairs_addr: u64,
}

impl std::fmt::Debug for MoePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoePlan")
            .field("class", &self.class)
            .field("token_ranges", &self.token_ranges())
            .finish()
    }
}

impl MoePlan {
    /// Resolve, compile and load every kernel `class` needs on `dev` for 1..=max_tokens
    /// tokens, the grouped-GEMM path chosen per token range ([`sm90::select_path`]).
    pub fn new(dev: &Device, class: MoeClass) -> Result<MoePlan> {
        Self::with_gemm_path(dev, class, 1, None)
    }

    /// Like [`MoePlan::new`] for calls of `min_tokens..=max_tokens` tokens only (fewer
    /// kernels to compile; the lab's fixed-shape runner uses one token count), with the
    /// path override given explicitly ("auto", "portable", "sm90", "sm90-bm64",
    /// "sm90-bm128"; None is auto).
    pub fn with_gemm_path(
        dev: &Device,
        class: MoeClass,
        min_tokens: usize,
        path: Option<&str>,
    ) -> Result<MoePlan> {
        let pieces = plan_selections(&class, min_tokens, dev.arch(), path)?;
        let mut loaded = Vec::new();
        let first = &pieces[0].2 .0;
        let topk = load(dev, &mut loaded, &first[select::K_TOPK])?;
        let stats = load(dev, &mut loaded, &first[select::K_STATS])?;
        let losses = load(dev, &mut loaded, &select::losses_kernel())?;
        let permute = load(dev, &mut loaded, &first[select::K_PERMUTE])?;
        let combine = load(dev, &mut loaded, &first[select::K_COMBINE])?;
        let mut gather = None;
        let mut buckets = Vec::with_capacity(pieces.len());
        for (first_t, last_t, (kernels, path)) in &pieces {
            for (i, fixed) in [
                (select::K_TOPK, topk),
                (select::K_STATS, stats),
                (select::K_PERMUTE, permute),
                (select::K_COMBINE, combine),
            ] {
                // These depend on the class only; a change would be a selection bug.
                if kernels[i] != loaded[fixed].0 {
                    return Err(Error::unsupported(
                        BACKEND,
                        format!("{} changes with the token count", kernels[i].entry),
                    ));
                }
            }
            let rows = last_t * class.top_k;
            let sm90 = match path {
                Some((k13, k2)) => {
                    // The tensor maps' shapes at the largest call of the range (every
                    // other call has fewer rows, within the same limits).
                    sm90::a_layout(rows, class.hidden, k13.block_m).check("x_perm")?;
                    sm90::b_layout(class.experts, class.hidden, 2 * class.intermediate)
                        .check("w13")?;
                    sm90::a_layout(rows, class.intermediate, k2.block_m).check("h")?;
                    sm90::b_layout(class.experts, class.intermediate, class.hidden).check("w2")?;
                    gather = Some(load(dev, &mut loaded, &sm90::gather_kernel())?);
                    Some((load(dev, &mut loaded, k13)?, load(dev, &mut loaded, k2)?))
                }
                None => None,
            };
            buckets.push(Bucket {
                first: *first_t,
                last: *last_t,
                logits: load(dev, &mut loaded, &kernels[select::K_LOGITS])?,
                gemm13: load(dev, &mut loaded, &kernels[select::K_GEMM13])?,
                gemm2: load(dev, &mut loaded, &kernels[select::K_GEMM2])?,
                sm90,
            });
            // Every range's workspace and launch geometry must be computable.
            WorkspaceLayout::new(&class, *last_t, sm90.is_some())?;
        }
        let n = class.max_tokens;
        if n > u32::MAX as usize / 2 {
            return Err(Error::unsupported(
                BACKEND,
                format!("max_tokens = {n} does not fit the kernels' 32-bit row indices"),
            ));
        }
        let mut table: Vec<u32> = (0..n as u32).collect();
        table.reserve(2 * n);
        for t in 1..=n as u32 {
            table.extend([0, t]);
        }
        let stream = dev.stream();
        let tables = stream.clone_htod(&table).map_err(|e| {
            Error::cuda(
                format!(
                    "uploading the MoE plan's token tables ({} × u32)",
                    table.len()
                ),
                e,
            )
        })?;
        // Plan-time only: the tables must be on the device before any stream reads them.
        stream
            .synchronize()
            .map_err(|e| Error::cuda("cuStreamSynchronize (MoE plan tables)", e))?;
        let base = tables.device_ptr(stream).0;
        Ok(MoePlan {
            class,
            min_tokens,
            ctx: dev.context().clone(),
            arch: dev.arch(),
            path: path.map(str::to_string),
            loaded,
            topk,
            stats,
            losses,
            permute,
            combine,
            gather,
            buckets,
            _tables: tables,
            iota_addr: base,
            pairs_addr: base + 4 * n as u64,
        })
    }

    pub fn class(&self) -> &MoeClass {
        &self.class
    }

    /// Smallest token count a call may have (1 unless built with a narrower range).
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// The token ranges and what each runs.
    pub fn token_ranges(&self) -> Vec<TokenRange> {
        self.buckets
            .iter()
            .map(|b| TokenRange {
                first: b.first,
                last: b.last,
                logits: self.loaded[b.logits].0.entry,
                gemm_path: self.describe_path(b, b.first),
            })
            .collect()
    }

    pub(super) fn bucket(&self, tokens: usize) -> Result<&Bucket> {
        self.buckets
            .iter()
            .find(|b| b.first <= tokens && tokens <= b.last)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{tokens} tokens: this MoE plan takes {}..={} tokens per call \
                     (MoeClass::max_tokens)",
                    self.min_tokens, self.class.max_tokens
                ))
            })
    }

    /// Report line of a range's GEMM path; the portable path's reason is worded for
    /// `tokens` (it quotes the rows per expert).
    fn describe_path(&self, b: &Bucket, tokens: usize) -> String {
        let k = |i: usize| &self.loaded[i].0;
        match b.sm90 {
            Some((g13, g2)) => format!(
                "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), wgmma/TMA",
                k(g13).entry,
                k(g13).block_m,
                k(g13).block_n,
                k(g2).entry,
                k(g2).block_m,
                k(g2).block_n
            ),
            None => {
                let why = match sm90::select_path(
                    &self.class.problem(tokens),
                    self.arch,
                    self.path.as_deref(),
                ) {
                    Ok(GemmPath::Portable(why)) => why,
                    Ok(GemmPath::Sm90(..)) => String::new(),
                    Err(e) => e.to_string(),
                };
                format!(
                    "grouped GEMMs: {} (BM {} BN {}) + {} (BM {} BN {}), mma.sync ({why})",
                    k(b.gemm13).entry,
                    k(b.gemm13).block_m,
                    k(b.gemm13).block_n,
                    k(b.gemm2).entry,
                    k(b.gemm2).block_m,
                    k(b.gemm2).block_n,
                )
            }
        }
    }

    /// Which grouped-GEMM kernels a call of `tokens` tokens runs for the routed experts,
    /// for reports: the sm_90 entries, or the portable ones with the reason the sm_90 path
    /// was not taken.
    pub fn gemm_path(&self, tokens: usize) -> Result<String> {
        Ok(self.describe_path(self.bucket(tokens)?, tokens))
    }

    /// The seven kernels of [`select::select`]'s pipeline order that a call of `tokens`
    /// tokens runs (the routed experts' GEMMs may be the sm_90 ones instead: see
    /// [`MoePlan::gemm_path`]; the shared expert always runs these portable GEMMs).
    pub fn kernels(&self, tokens: usize) -> Result<Vec<MoeKernel>> {
        let b = self.bucket(tokens)?;
        Ok([
            b.logits,
            self.topk,
            self.stats,
            self.permute,
            b.gemm13,
            b.gemm2,
            self.combine,
        ]
        .iter()
        .map(|&i| self.loaded[i].0.clone())
        .collect())
    }

    /// Launch geometry of [`MoePlan::kernels`] for `tokens` tokens.
    pub fn launch_configs(&self, tokens: usize) -> Result<[LaunchConfig; 7]> {
        let b = self.bucket(tokens)?;
        self.configs(b, tokens)
    }

    pub(super) fn configs(&self, b: &Bucket, tokens: usize) -> Result<[LaunchConfig; 7]> {
        let k = |i: usize| &self.loaded[i].0;
        pipeline_configs(
            &self.class.problem(tokens),
            [
                k(b.logits),
                k(self.topk),
                k(self.stats),
                k(self.permute),
                k(b.gemm13),
                k(b.gemm2),
                k(self.combine),
            ],
        )
    }

    /// The workspace regions of a call of `tokens` tokens.
    pub fn workspace_layout(&self, tokens: usize) -> Result<WorkspaceLayout> {
        let b = self.bucket(tokens)?;
        WorkspaceLayout::new(&self.class, tokens, b.sm90.is_some())
    }

    /// Bytes of the workspace a call of `tokens` tokens needs.
    pub fn workspace_bytes(&self, tokens: usize) -> Result<usize> {
        Ok(self.workspace_layout(tokens)?.bytes)
    }

    /// Bytes of a workspace that serves every call of the plan.
    pub fn max_workspace_bytes(&self) -> usize {
        self.buckets
            .iter()
            .filter_map(|b| WorkspaceLayout::new(&self.class, b.last, b.sm90.is_some()).ok())
            .map(|l| l.bytes)
            .max()
            .unwrap_or(0)
    }

    /// Device bytes of the plan's own token tables.
    pub fn table_bytes(&self) -> usize {
        12 * self.class.max_tokens
    }

    /// Check a call's tensors against the class ([`MoeClass::check_args`]) and the plan's
    /// token range, O(1); returns the token count. Errors name the tensor and the rule.
    pub fn check(&self, a: &MoeArgs) -> Result<usize> {
        self.check_for(a, self.class.experts)
    }

    pub(super) fn check_for(&self, a: &MoeArgs, weight_experts: usize) -> Result<usize> {
        let t = self.class.check_args_for(a, weight_experts)?;
        if t < self.min_tokens {
            return Err(Error::invalid(format!(
                "x has {t} tokens but this MoE plan takes {}..={} (MoeClass::max_tokens)",
                self.min_tokens, self.class.max_tokens
            )));
        }
        Ok(t)
    }
}
