//! FlashAttention-2 forward on the CPU, in f32: the CPU backend of the benchmark lab.
//!
//! The algorithm is the GPU kernel's, tile for tile:
//!
//! - the work is split into units (batch, query head, Q tile of `block_m` rows), run in
//!   parallel with rayon;
//! - each unit streams K/V tiles of `block_n` keys; for each tile it computes
//!   S = Q·Kᵀ, then the online softmax: running row max `m`, running row sum `l`,
//!   P = exp2(S·scale·log2(e) − m·scale·log2(e)) (the scale folded into the exp2
//!   argument), rescale of the accumulator and of `l` by exp2(m_old − m_new), and
//!   acc += P·V;
//! - softcap `c > 0`: S is first replaced by c·tanh(S·scale/c) (f32 `tanh`), and the
//!   online softmax then runs on those capped scores with a scale of 1;
//! - masking (causal and sliding window, bottom-right aligned, see
//!   [`AttentionProblem::visible_range`]): only the K tiles overlapping the union of the
//!   Q tile rows' visible ranges are visited; the tiles crossing a range boundary are
//!   masked element-wise;
//! - at the end O = acc / l and LSE = m·scale + ln(l) (natural log); a row that sees no
//!   key gets O = 0 and LSE = −inf.
//!
//! Extra memory is O(N): K and V packed once per call (K as transposed tiles of
//! head_dim × block_n, V with rows padded to a multiple of 16) — the CPU stand-in for the
//! GPU's shared-memory tiles, shared by every Q tile and every query head of a KV group —
//! per worker a few tiles (Q, S/P, accumulator), and one output-sized buffer for the
//! layout change (batch, head, seq, dim) → (batch, seq, head, dim). There is never an
//! Sq×Sk buffer.
//!
//! Speed: with K packed transposed and V row-padded, both GEMMs run as 4×16
//! register-blocked micro-kernels whose inner loops are contiguous and vectorise; exp2 is
//! a branch-free polynomial (relative error ≈ 1e-7) that vectorises too. On x86-64 with
//! AVX2+FMA (detected at run time) the whole unit is compiled for those features.
//!
//! [`AttentionProblem::visible_range`]: crate::problem::AttentionProblem::visible_range

use super::attention::{bhsd_to_bshd, validate_inputs, AttentionInputs, AttentionOutput};
use crate::error::{Error, Result};
use crate::problem::AttentionProblem;
use rayon::prelude::*;

/// Default Q tile height.
pub const DEFAULT_BLOCK_M: usize = 64;
/// Default K/V tile width.
pub const DEFAULT_BLOCK_N: usize = 64;

/// Rows of the micro-kernel.
const MR: usize = 4;
/// Columns of the micro-kernel (two AVX2 registers of f32).
const NR: usize = 16;

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// FlashAttention-2 forward in f32 with Q tiles of `block_m` rows and K/V tiles of
/// `block_n` keys (clamped to the sequence lengths). Same layouts and masking as
/// [`attention_f64`](super::attention::attention_f64).
pub fn attention_tiled(
    p: &AttentionProblem,
    x: &AttentionInputs,
    block_m: usize,
    block_n: usize,
) -> Result<AttentionOutput<f32>> {
    tiled_with(p, x, block_m, block_n, Simd::detect())
}

/// [`attention_tiled`] compiled for a chosen instruction set (tests run every path).
pub(crate) fn tiled_with(
    p: &AttentionProblem,
    x: &AttentionInputs,
    block_m: usize,
    block_n: usize,
    simd: Simd,
) -> Result<AttentionOutput<f32>> {
    validate_inputs(p, x)?;
    if block_m == 0 || block_n == 0 {
        return Err(Error::invalid(format!(
            "tile sizes must be at least 1, got block_m={block_m} block_n={block_n}"
        )));
    }
    let (b, hq, sq, d) = (p.batch, p.heads_q, p.seqlen_q, p.head_dim);
    let geo = Geometry::new(p, block_m, block_n);
    let kv = PackedKv::new(p, x, &geo);

    let mut o_bh = vec![0f32; b * hq * sq * d];
    let mut lse = vec![0f32; b * hq * sq];
    o_bh.par_chunks_mut(sq * d)
        .zip(lse.par_chunks_mut(sq))
        .enumerate()
        .for_each(|(bh, (o, l))| {
            let (bi, h) = (bh / hq, bh % hq);
            o.par_chunks_mut(geo.bm * d)
                .zip(l.par_chunks_mut(geo.bm))
                .enumerate()
                .for_each_init(
                    || Scratch::new(&geo),
                    |scr, (t, (o_tile, lse_tile))| {
                        let unit = Unit {
                            b: bi,
                            h,
                            r0: t * geo.bm,
                        };
                        simd.run(p, x, &kv, &geo, unit, scr, o_tile, lse_tile);
                    },
                );
        });
    Ok(AttentionOutput {
        o: bhsd_to_bshd(&o_bh, b, hq, sq, d),
        lse,
    })
}

/// Sizes shared by every unit of one call.
struct Geometry {
    /// Q tile rows and K/V tile width, clamped to the sequence lengths.
    bm: usize,
    bn: usize,
    /// `bm` rounded up to MR, `bn` and head_dim rounded up to NR.
    bm_p: usize,
    bn_p: usize,
    d_p: usize,
    /// K/V tiles per (batch, KV head).
    n_tiles: usize,
    group: usize,
    /// `scale / softcap` when the softcap is on (S → softcap·tanh(S·cap_in)); unused
    /// otherwise.
    cap_in: f32,
    /// The softcap (0 = off).
    softcap: f32,
    /// Scale of the scores the online softmax sees: the softmax scale, or 1 with a softcap
    /// (the capped scores are already scaled).
    scale: f32,
    /// scale·log2(e).
    scale_log2: f32,
}

impl Geometry {
    fn new(p: &AttentionProblem, block_m: usize, block_n: usize) -> Self {
        let bm = block_m.min(p.seqlen_q);
        let bn = block_n.min(p.seqlen_k);
        let softcap = p.softcap;
        let scale = if softcap > 0.0 { 1.0 } else { p.scale() };
        Geometry {
            bm,
            bn,
            bm_p: round_up(bm, MR),
            bn_p: round_up(bn, NR),
            d_p: round_up(p.head_dim, NR),
            n_tiles: p.seqlen_k.div_ceil(bn),
            group: p.group_size(),
            cap_in: if softcap > 0.0 {
                p.scale() / softcap
            } else {
                0.0
            },
            softcap,
            scale,
            scale_log2: scale * std::f32::consts::LOG2_E,
        }
    }
}

/// Per-worker tile buffers.
struct Scratch {
    /// Q tile, (bm_p, d), rows past the tile zero.
    q: Vec<f32>,
    /// S, then P in place, (bm_p, nk_p).
    s: Vec<f32>,
    /// Unnormalised output accumulator, (bm_p, d_p).
    acc: Vec<f32>,
    /// Running max of the (capped) scores before scaling, per row.
    m: Vec<f32>,
    /// Running sum of P, per row.
    l: Vec<f32>,
}

impl Scratch {
    fn new(g: &Geometry) -> Self {
        Scratch {
            q: vec![0.0; g.bm_p * g.d_p],
            s: vec![0.0; g.bm_p * g.bn_p],
            acc: vec![0.0; g.bm_p * g.d_p],
            m: vec![0.0; g.bm],
            l: vec![0.0; g.bm],
        }
    }
}

/// K and V of every (batch, KV head), packed once per call.
struct PackedKv {
    /// Per (batch, KV head, tile t): Kᵀ of keys [t·bn, t·bn + w), (d × w_p) with
    /// w_p = w rounded up to NR (zero columns past w), at offset
    /// ((b·Hkv + kvh)·n_tiles + t)·d·bn_p.
    kt: Vec<f32>,
    /// Per (batch, KV head): V rows (seqlen_k × d_p), zero columns past d.
    v: Vec<f32>,
}

impl PackedKv {
    fn new(p: &AttentionProblem, x: &AttentionInputs, g: &Geometry) -> Self {
        let (hkv, sk, d) = (p.heads_kv, p.seqlen_k, p.head_dim);
        let heads = p.batch * hkv;
        let kt_head = g.n_tiles * d * g.bn_p;
        let v_head = sk * g.d_p;
        let mut kt = vec![0f32; heads * kt_head];
        let mut v = vec![0f32; heads * v_head];
        kt.par_chunks_mut(kt_head)
            .zip(v.par_chunks_mut(v_head))
            .enumerate()
            .for_each(|(bk, (kt, v))| {
                let (b, kvh) = (bk / hkv, bk % hkv);
                for (t, tile) in kt.chunks_exact_mut(d * g.bn_p).enumerate() {
                    let j0 = t * g.bn;
                    let w = g.bn.min(sk - j0);
                    let w_p = round_up(w, NR);
                    for j in 0..w {
                        let off = ((b * sk + j0 + j) * hkv + kvh) * d;
                        for (dd, &kv) in x.k[off..off + d].iter().enumerate() {
                            tile[dd * w_p + j] = kv;
                        }
                    }
                }
                for (j, row) in v.chunks_exact_mut(g.d_p).enumerate() {
                    let off = ((b * sk + j) * hkv + kvh) * d;
                    row[..d].copy_from_slice(&x.v[off..off + d]);
                }
            });
        PackedKv { kt, v }
    }
}

/// One unit of work: batch `b`, query head `h`, Q tile starting at row `r0`.
#[derive(Clone, Copy)]
struct Unit {
    b: usize,
    h: usize,
    r0: usize,
}

/// Instruction set the unit is compiled for, chosen once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Simd {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Simd {
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Simd::Avx2Fma;
            }
        }
        Simd::Portable
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        self,
        p: &AttentionProblem,
        x: &AttentionInputs,
        kv: &PackedKv,
        g: &Geometry,
        u: Unit,
        scr: &mut Scratch,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        match self {
            Simd::Portable => run_unit::<false>(p, x, kv, g, u, scr, o, lse),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::Avx2Fma` is only chosen after run-time detection of AVX2 and FMA.
            Simd::Avx2Fma => unsafe { run_unit_avx2_fma(p, x, kv, g, u, scr, o, lse) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_unit_avx2_fma(
    p: &AttentionProblem,
    x: &AttentionInputs,
    kv: &PackedKv,
    g: &Geometry,
    u: Unit,
    scr: &mut Scratch,
    o: &mut [f32],
    lse: &mut [f32],
) {
    run_unit::<true>(p, x, kv, g, u, scr, o, lse)
}

/// `a·b + c`, fused when the unit is compiled with FMA.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn lanes(s: &[f32]) -> &[f32; NR] {
    s[..NR].try_into().expect("slice of NR elements")
}

/// 2^x for x ≤ 0 (−inf → 0, NaN → NaN), branch-free so it vectorises: round x to the
/// nearest integer n with the 1.5·2^23 trick, 2^(x−n) by its degree-7 Taylor polynomial
/// on [−½, ½] (truncation error < 6e-9 relative), then scale by 2^n through the exponent
/// bits. Results below 2^−126 flush to 0 (irrelevant next to the row maximum's 1).
#[inline(always)]
pub(crate) fn exp2_fast<const FMA: bool>(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23
                                     // Taylor coefficients ln(2)^k / k! of 2^f = e^(f·ln 2).
    const L: f64 = std::f64::consts::LN_2;
    const C: [f32; 8] = [
        1.0,
        L as f32,
        (L * L / 2.0) as f32,
        (L * L * L / 6.0) as f32,
        (L * L * L * L / 24.0) as f32,
        (L * L * L * L * L / 120.0) as f32,
        (L * L * L * L * L * L / 720.0) as f32,
        (L * L * L * L * L * L * L / 5040.0) as f32,
    ];
    let xc = if x < -126.0 { -126.0 } else { x };
    let t = xc + MAGIC;
    let n = t - MAGIC;
    let f = xc - n;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let mut poly = C[7];
    for &c in C[..7].iter().rev() {
        poly = madd::<FMA>(poly, f, c);
    }
    let pow = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let r = poly * pow;
    if x < -126.0 {
        0.0
    } else {
        r
    }
}

/// Maximum of a row whose length is a multiple of NR (NaN ignored).
#[inline(always)]
fn row_max(s: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; NR];
    for c in s.chunks_exact(NR) {
        for (mi, &v) in m.iter_mut().zip(c) {
            *mi = if v > *mi { v } else { *mi };
        }
    }
    m.iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// P = exp2(S·scale_log2 − m_scaled) in place over a row whose length is a multiple of
/// NR; returns ΣP.
#[inline(always)]
fn exp_row<const FMA: bool>(s: &mut [f32], scale_log2: f32, m_scaled: f32) -> f32 {
    let mut sum = [0f32; NR];
    for c in s.chunks_exact_mut(NR) {
        for (si, v) in sum.iter_mut().zip(c.iter_mut()) {
            let pv = exp2_fast::<FMA>(madd::<FMA>(*v, scale_log2, -m_scaled));
            *v = pv;
            *si += pv;
        }
    }
    sum.iter().sum()
}

/// S (rows_p × nk_p, stride nk_p) = Q (rows_p × d) · Kᵀ (d × nk_p, stride ldk ≥ nk_p),
/// 4×16 blocks.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn qk_kernel<const FMA: bool>(
    q: &[f32],
    d: usize,
    kt: &[f32],
    ldk: usize,
    nk_p: usize,
    s: &mut [f32],
    rows_p: usize,
) {
    for r in (0..rows_p).step_by(MR) {
        let qr: [&[f32]; MR] = std::array::from_fn(|i| &q[(r + i) * d..(r + i + 1) * d]);
        for c in (0..nk_p).step_by(NR) {
            let mut acc = [[0f32; NR]; MR];
            for dd in 0..d {
                let k = lanes(&kt[dd * ldk + c..]);
                for (a, qrow) in acc.iter_mut().zip(&qr) {
                    let qv = qrow[dd];
                    for (ai, &kv) in a.iter_mut().zip(k) {
                        *ai = madd::<FMA>(qv, kv, *ai);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let off = (r + i) * nk_p + c;
                s[off..off + NR].copy_from_slice(a);
            }
        }
    }
}

/// acc (rows_p × d_p) += P (rows_p × nk, stride nk_p) · V (nk × d_p), 4×16 blocks.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_kernel<const FMA: bool>(
    pm: &[f32],
    nk_p: usize,
    nk: usize,
    v: &[f32],
    d_p: usize,
    acc: &mut [f32],
    rows_p: usize,
) {
    for r in (0..rows_p).step_by(MR) {
        let pr: [&[f32]; MR] = std::array::from_fn(|i| &pm[(r + i) * nk_p..(r + i) * nk_p + nk]);
        for c in (0..d_p).step_by(NR) {
            let mut a: [[f32; NR]; MR] = std::array::from_fn(|i| *lanes(&acc[(r + i) * d_p + c..]));
            for j in 0..nk {
                let vr = lanes(&v[j * d_p + c..]);
                for (ai, prow) in a.iter_mut().zip(&pr) {
                    let pv = prow[j];
                    for (x, &vv) in ai.iter_mut().zip(vr) {
                        *x = madd::<FMA>(pv, vv, *x);
                    }
                }
            }
            for (i, ai) in a.iter().enumerate() {
                let off = (r + i) * d_p + c;
                acc[off..off + NR].copy_from_slice(ai);
            }
        }
    }
}

/// One (batch, head, Q tile) unit: writes its O rows (row-major, head_dim wide) and LSE.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn run_unit<const FMA: bool>(
    p: &AttentionProblem,
    x: &AttentionInputs,
    kv: &PackedKv,
    g: &Geometry,
    u: Unit,
    scr: &mut Scratch,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (hq, hkv) = (p.heads_q, p.heads_kv);
    let (sq, sk, d) = (p.seqlen_q, p.seqlen_k, p.head_dim);
    let d_p = g.d_p;
    let kvh = u.h / g.group;
    let rows = lse.len();
    let rows_p = round_up(rows, MR);

    // Q tile, rows past the tile zeroed (their results are discarded).
    for r in 0..rows {
        let off = ((u.b * sq + u.r0 + r) * hq + u.h) * d;
        scr.q[r * d..(r + 1) * d].copy_from_slice(&x.q[off..off + d]);
    }
    scr.q[rows * d..rows_p * d].fill(0.0);
    scr.acc[..rows_p * d_p].fill(0.0);
    scr.m[..rows].fill(f32::NEG_INFINITY);
    scr.l[..rows].fill(0.0);

    // Union of the rows' visible key ranges: the K tiles outside it are fully masked for
    // every row and never visited. The walk starts at the tile holding `kv_start` so it
    // stays on the packed tile grid.
    let (mut kv_start, mut kv_end) = (sk, 0);
    for r in 0..rows {
        let range = p.visible_range(u.r0 + r);
        if !range.is_empty() {
            kv_start = kv_start.min(range.start);
            kv_end = kv_end.max(range.end);
        }
    }
    let mut j0 = kv_start / g.bn * g.bn;
    while j0 < kv_end {
        let nk = g.bn.min(kv_end - j0);
        let nk_p = round_up(nk, NR);

        // This tile's packed Kᵀ (stride = its full packed width) and V rows.
        let t = j0 / g.bn;
        let ldk = round_up(g.bn.min(sk - j0), NR);
        let head = u.b * hkv + kvh;
        let kt_off = (head * g.n_tiles + t) * d * g.bn_p;
        let kt = &kv.kt[kt_off..kt_off + d * ldk];
        let v_off = (head * sk + j0) * d_p;
        let v = &kv.v[v_off..v_off + nk * d_p];

        qk_kernel::<FMA>(&scr.q, d, kt, ldk, nk_p, &mut scr.s, rows_p);

        // Softcap, mask, online softmax, rescale.
        for r in 0..rows {
            let srow = &mut scr.s[r * nk_p..(r + 1) * nk_p];
            // This row's visible columns of the tile: lo..hi.
            let range = p.visible_range(u.r0 + r);
            let lo = range.start.saturating_sub(j0).min(nk);
            let hi = range.end.saturating_sub(j0).min(nk);
            if lo >= hi {
                // Nothing visible in this tile: P = 0, state unchanged.
                srow.fill(0.0);
                continue;
            }
            if g.softcap > 0.0 {
                for s in &mut srow[lo..hi] {
                    *s = g.softcap * (*s * g.cap_in).tanh();
                }
            }
            srow[..lo].fill(f32::NEG_INFINITY);
            srow[hi..].fill(f32::NEG_INFINITY);
            let m_old = scr.m[r];
            let m_new = m_old.max(row_max(srow));
            let m_scaled = m_new * g.scale_log2;
            let sum = exp_row::<FMA>(srow, g.scale_log2, m_scaled);
            if m_old == f32::NEG_INFINITY {
                scr.l[r] = sum;
            } else {
                let alpha = exp2_fast::<FMA>(madd::<FMA>(m_old, g.scale_log2, -m_scaled));
                scr.l[r] = madd::<FMA>(scr.l[r], alpha, sum);
                if alpha != 1.0 {
                    for a in &mut scr.acc[r * d_p..(r + 1) * d_p] {
                        *a *= alpha;
                    }
                }
            }
            scr.m[r] = m_new;
        }

        pv_kernel::<FMA>(&scr.s, nk_p, nk, v, d_p, &mut scr.acc, rows_p);
        j0 += nk;
    }

    // Normalise and write out.
    for r in 0..rows {
        let orow = &mut o[r * d..(r + 1) * d];
        let l = scr.l[r];
        if l > 0.0 {
            let inv = 1.0 / l;
            for (od, &a) in orow.iter_mut().zip(&scr.acc[r * d_p..r * d_p + d]) {
                *od = a * inv;
            }
            lse[r] = scr.m[r] * g.scale + l.ln();
        } else {
            orow.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        }
    }
}
