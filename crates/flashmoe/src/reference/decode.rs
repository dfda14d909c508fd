//! Paged-KV decode attention ground truth in f64: the semantics of
//! [`crate::attention::decode`], computed row by row with a materialised softmax.
//!
//! Layouts (contiguous): q and o `[batch, seqlen_q, heads_q, head_dim]`; the caches
//! `[num_blocks, page_size, heads_kv, head_dim]`; block table `[batch, max_blocks]`; lse
//! `[batch, heads_q, seqlen_q]` (natural log). Key `j` of sequence `b` lives in block
//! `block_table[b][j / page_size]`, row `j % page_size`.
//!
//! Query row `i` of a sequence with `seqlen_q` rows and `seqused_k[b]` keys has the
//! diagonal `d = seqused_k[b] - seqlen_q + i` and sees keys `j < seqused_k[b]` with
//! `j >= d - window.0` (when `window.0 >= 0`) and `j <= d + window.1` (when `window.1 >= 0`);
//! causal decode is `window = (-1, 0)`.
//!
//! Mixed batches ([`PagedDecodeInputs::cu_seqlens_q`]): sequence `b` has the rows
//! `cu[b] .. cu[b+1]` of a packed q `[total_q, heads_q, head_dim]` (at most `seqlen_q`
//! each), its own `Sq_b` in the diagonal; o is `[total_q, heads_q, head_dim]` and lse
//! `[heads_q, total_q]`. Scores are `scale · q·k`, then
//! `softcap · tanh(score / softcap)` when `softcap > 0`, then with ALiBi
//! ([`paged_decode_f64_alibi`]) `- slope[b][h] · |d - j|` (FlashAttention's convention, as
//! [`attention_f64_alibi`]). A row that sees no key gets O = 0 and
//! LSE = −inf.
//!
//! [`PagedDecodeInputs::cu_seqlens_q`]: crate::reference::decode::PagedDecodeInputs::cu_seqlens_q
//! [`paged_decode_f64_alibi`]: crate::reference::decode::paged_decode_f64_alibi
//! [`attention_f64_alibi`]: crate::reference::attention::attention_f64_alibi

use super::attention::{softmax_in_place, AttentionOutput};
use crate::error::{Error, Result};

/// Shape and semantics of one paged decode call.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedDecodeSpec {
    pub batch: usize,
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    /// (left, right); -1 = unbounded.
    pub window: (i64, i64),
    /// 0 = off.
    pub softcap: f64,
    pub scale: f64,
}

/// Inputs as f32 values (already rounded to the kernel's dtype).
#[derive(Debug, Clone, PartialEq)]
pub struct PagedDecodeInputs {
    pub q: Vec<f32>,
    pub k_cache: Vec<f32>,
    pub v_cache: Vec<f32>,
    /// `[batch, max_blocks]`
    pub block_table: Vec<i32>,
    /// Keys used per sequence.
    pub seqused_k: Vec<usize>,
    /// `[batch + 1]` row offsets of a packed q (mixed batches); None: `seqlen_q` rows each.
    pub cu_seqlens_q: Option<Vec<usize>>,
}

impl PagedDecodeSpec {
    /// Visible keys `[lo, hi)` of query row `i` of a sequence of `seqlen_q` rows (empty when
    /// `hi <= lo`).
    pub fn visible(&self, seqlen_k: usize, i: usize) -> (usize, usize) {
        self.visible_of(seqlen_k, self.seqlen_q, i)
    }

    /// [`PagedDecodeSpec::visible`] for a sequence of `seqlen_q` rows (mixed batches).
    pub fn visible_of(&self, seqlen_k: usize, seqlen_q: usize, i: usize) -> (usize, usize) {
        let d = seqlen_k as i64 - seqlen_q as i64 + i as i64;
        let lo = if self.window.0 < 0 {
            0
        } else {
            (d - self.window.0).max(0)
        };
        let hi = if self.window.1 < 0 {
            seqlen_k as i64
        } else {
            (d + self.window.1 + 1).clamp(0, seqlen_k as i64)
        };
        (lo as usize, hi.max(lo) as usize)
    }

    fn check(&self, x: &PagedDecodeInputs) -> Result<()> {
        let (b, sq, hq, hkv, d) = (
            self.batch,
            self.seqlen_q,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        );
        if hkv == 0 || hq % hkv != 0 || self.page_size == 0 {
            return Err(Error::invalid(format!(
                "paged decode reference: heads_q {hq} must be a multiple of heads_kv {hkv} \
                 and page_size {} >= 1",
                self.page_size
            )));
        }
        let cache = self.num_blocks * self.page_size * hkv * d;
        let tokens = match &x.cu_seqlens_q {
            None => b * sq,
            Some(cu) => {
                super::check_len("cu_seqlens_q", b + 1, cu.len())?;
                if cu[0] != 0 {
                    return Err(Error::invalid(format!(
                        "cu_seqlens_q[0] = {} must be 0",
                        cu[0]
                    )));
                }
                for bi in 0..b {
                    if cu[bi + 1] < cu[bi] || cu[bi + 1] - cu[bi] > sq {
                        return Err(Error::invalid(format!(
                            "cu_seqlens_q[{}] - cu_seqlens_q[{bi}] = {} must be in 0..={sq}",
                            bi + 1,
                            cu[bi + 1] as i64 - cu[bi] as i64
                        )));
                    }
                }
                cu[b]
            }
        };
        for (name, want, got) in [
            ("q", tokens * hq * d, x.q.len()),
            ("k_cache", cache, x.k_cache.len()),
            ("v_cache", cache, x.v_cache.len()),
            ("block_table", b * self.max_blocks, x.block_table.len()),
            ("seqused_k", b, x.seqused_k.len()),
        ] {
            super::check_len(name, want, got)?;
        }
        for (bi, &n) in x.seqused_k.iter().enumerate() {
            if n > self.max_blocks * self.page_size {
                return Err(Error::invalid(format!(
                    "seqused_k[{bi}] = {n} exceeds the table's {} blocks of {} keys",
                    self.max_blocks, self.page_size
                )));
            }
            for p in 0..n.div_ceil(self.page_size) {
                let blk = x.block_table[bi * self.max_blocks + p];
                if blk < 0 || blk as usize >= self.num_blocks {
                    return Err(Error::invalid(format!(
                        "block_table[{bi}][{p}] = {blk} is outside [0, {})",
                        self.num_blocks
                    )));
                }
            }
        }
        Ok(())
    }

    /// Row `j` of head `h` of sequence `b`'s keys in a cache.
    fn cache_row<'a>(
        &self,
        cache: &'a [f32],
        table: &[i32],
        b: usize,
        j: usize,
        h: usize,
    ) -> &'a [f32] {
        let blk = table[b * self.max_blocks + j / self.page_size] as usize;
        let off = ((blk * self.page_size + j % self.page_size) * self.heads_kv + h) * self.head_dim;
        &cache[off..off + self.head_dim]
    }
}

/// The f64 ground truth of paged decode attention (see the module docs).
pub fn paged_decode_f64(
    s: &PagedDecodeSpec,
    x: &PagedDecodeInputs,
) -> Result<AttentionOutput<f64>> {
    paged_decode_f64_alibi(s, x, None, 0)
}

/// [`paged_decode_f64`] with ALiBi slopes: the slope of (sequence b, head h) is
/// `slopes[b * batch_stride + h]` (`batch_stride` 0: one `[heads_q]` vector); None = no bias.
pub fn paged_decode_f64_alibi(
    s: &PagedDecodeSpec,
    x: &PagedDecodeInputs,
    slopes: Option<&[f32]>,
    batch_stride: usize,
) -> Result<AttentionOutput<f64>> {
    s.check(x)?;
    if let Some(sl) = slopes {
        let need = (s.batch - 1) * batch_stride + s.heads_q;
        if sl.len() < need {
            return Err(Error::invalid(format!(
                "paged decode reference: {} ALiBi slopes, {need} needed",
                sl.len()
            )));
        }
    }
    let (b, hq, d) = (s.batch, s.heads_q, s.head_dim);
    let group = hq / s.heads_kv;
    // (first token, rows) of each sequence; lse index of (token, head).
    let rows: Vec<(usize, usize)> = match &x.cu_seqlens_q {
        None => (0..b).map(|bi| (bi * s.seqlen_q, s.seqlen_q)).collect(),
        Some(cu) => (0..b).map(|bi| (cu[bi], cu[bi + 1] - cu[bi])).collect(),
    };
    let tokens = x.q.len() / (hq * d);
    let lse_at = |bi: usize, tok0: usize, sq: usize, h: usize, i: usize| match x.cu_seqlens_q {
        None => (bi * hq + h) * sq + i,
        Some(_) => h * tokens + tok0 + i,
    };
    let mut o = vec![0f64; tokens * hq * d];
    let mut lse = vec![0f64; tokens * hq];
    for bi in 0..b {
        let sk = x.seqused_k[bi];
        let (tok0, sq) = rows[bi];
        for h in 0..hq {
            let kvh = h / group;
            let slope = slopes.map_or(0.0, |sl| sl[bi * batch_stride + h] as f64);
            for i in 0..sq {
                let (lo, hi) = s.visible_of(sk, sq, i);
                let diag = sk as i64 - sq as i64 + i as i64;
                let qoff = ((tok0 + i) * hq + h) * d;
                let q = &x.q[qoff..qoff + d];
                let mut scores: Vec<f64> = (lo..hi)
                    .map(|j| {
                        let k = s.cache_row(&x.k_cache, &x.block_table, bi, j, kvh);
                        let dot: f64 = q.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum();
                        let z = s.scale * dot;
                        let z = if s.softcap > 0.0 {
                            s.softcap * (z / s.softcap).tanh()
                        } else {
                            z
                        };
                        z - slope * (diag - j as i64).abs() as f64
                    })
                    .collect();
                lse[lse_at(bi, tok0, sq, h, i)] = softmax_in_place(&mut scores);
                let orow = &mut o[qoff..qoff + d];
                for (w, j) in scores.iter().zip(lo..hi) {
                    let v = s.cache_row(&x.v_cache, &x.block_table, bi, j, kvh);
                    for (od, &vd) in orow.iter_mut().zip(v) {
                        *od += w * vd as f64;
                    }
                }
            }
        }
    }
    Ok(AttentionOutput { o, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::AttentionProblem;
    use crate::reference::{attention_f64, AttentionInputs};
    use crate::DType;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A paged cache holding the dense `[b, sk, hkv, d]` k/v of `x` with shuffled block ids;
    /// returns (spec, inputs).
    fn paginate(
        p: &AttentionProblem,
        x: &AttentionInputs,
        page: usize,
        window: (i64, i64),
    ) -> (PagedDecodeSpec, PagedDecodeInputs) {
        let (b, sk, hkv, d) = (p.batch, p.seqlen_k, p.heads_kv, p.head_dim);
        let max_blocks = sk.div_ceil(page) + 1;
        let num_blocks = b * max_blocks + 3;
        // Block ids in a scrambled order: block of (seq bi, page j) = perm[bi * max_blocks + j].
        let mut perm: Vec<usize> = (0..num_blocks).collect();
        let mut seed = 7u64;
        for i in (1..perm.len()).rev() {
            let j = ((lcg(&mut seed) + 1.0) * 0.5 * (i + 1) as f32) as usize % (i + 1);
            perm.swap(i, j);
        }
        let mut kc = vec![f32::NAN; num_blocks * page * hkv * d];
        let mut vc = kc.clone();
        let mut table = vec![-1i32; b * max_blocks];
        for bi in 0..b {
            for j in 0..sk {
                let blk = perm[bi * max_blocks + j / page];
                table[bi * max_blocks + j / page] = blk as i32;
                let dst = ((blk * page + j % page) * hkv) * d;
                let src = ((bi * sk + j) * hkv) * d;
                kc[dst..dst + hkv * d].copy_from_slice(&x.k[src..src + hkv * d]);
                vc[dst..dst + hkv * d].copy_from_slice(&x.v[src..src + hkv * d]);
            }
        }
        let spec = PagedDecodeSpec {
            batch: b,
            seqlen_q: p.seqlen_q,
            heads_q: p.heads_q,
            heads_kv: hkv,
            head_dim: d,
            num_blocks,
            page_size: page,
            max_blocks,
            window,
            softcap: 0.0,
            scale: p.scale() as f64,
        };
        let inputs = PagedDecodeInputs {
            q: x.q.clone(),
            k_cache: kc,
            v_cache: vc,
            block_table: table,
            seqused_k: vec![sk; b],
            cu_seqlens_q: None,
        };
        (spec, inputs)
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
            .fold(0.0, f64::max)
    }

    /// Causal window (-1, 0) and no window (-1, -1) equal the dense reference (causal and
    /// not) on the same keys, whatever the page size; NaN in unused cache rows is never read.
    #[test]
    fn paged_matches_dense_reference() {
        for &(sq, sk, hq, hkv, page) in &[
            (1, 37, 4, 2, 16),
            (4, 100, 8, 1, 32),
            (16, 64, 2, 2, 16),
            (3, 17, 6, 3, 48),
        ] {
            for causal in [true, false] {
                let p = AttentionProblem {
                    batch: 2,
                    heads_q: hq,
                    heads_kv: hkv,
                    seqlen_q: sq,
                    seqlen_k: sk,
                    head_dim: 16,
                    causal,
                    dtype: DType::Bf16,
                    softmax_scale: None,
                    window: crate::problem::NO_WINDOW,
                    softcap: 0.0,
                };
                let x = AttentionInputs::generate(&p, 11);
                let dense = attention_f64(&p, &x).unwrap();
                let window = if causal { (-1, 0) } else { (-1, -1) };
                let (spec, inp) = paginate(&p, &x, page, window);
                let got = paged_decode_f64(&spec, &inp).unwrap();
                assert!(max_diff(&got.o, &dense.o) < 1e-12, "o sq={sq} sk={sk}");
                assert!(
                    max_diff(&got.lse, &dense.lse) < 1e-12,
                    "lse sq={sq} sk={sk}"
                );
            }
        }
    }

    /// With ALiBi slopes (one vector and per sequence), the paged reference equals the dense
    /// ALiBi reference (`attention_f64_alibi`) on the same keys, causal and not.
    #[test]
    fn paged_alibi_matches_dense_alibi_reference() {
        for &(sq, sk, hq, hkv, page) in &[(1, 37, 4, 2, 16), (4, 100, 8, 1, 32), (3, 17, 6, 3, 48)]
        {
            for causal in [true, false] {
                let p = AttentionProblem {
                    batch: 2,
                    heads_q: hq,
                    heads_kv: hkv,
                    seqlen_q: sq,
                    seqlen_k: sk,
                    head_dim: 16,
                    causal,
                    dtype: DType::Bf16,
                    softmax_scale: None,
                    window: crate::problem::NO_WINDOW,
                    softcap: 0.0,
                };
                let x = AttentionInputs::generate(&p, 5);
                let slopes: Vec<f32> = (0..2 * hq).map(|i| 0.05 + 0.11 * i as f32).collect();
                let window = if causal { (-1, 0) } else { (-1, -1) };
                let (spec, inp) = paginate(&p, &x, page, window);
                for stride in [0, hq] {
                    let dense =
                        crate::reference::attention::attention_f64_alibi(&p, &x, &slopes, stride)
                            .unwrap();
                    let got = paged_decode_f64_alibi(&spec, &inp, Some(&slopes), stride).unwrap();
                    assert!(max_diff(&got.o, &dense.o) < 1e-12, "o sq={sq} sk={sk}");
                    assert!(
                        max_diff(&got.lse, &dense.lse) < 1e-12,
                        "lse sq={sq} sk={sk}"
                    );
                }
                // The bias changes the result (the test would pass with slopes ignored
                // otherwise).
                let plain = paged_decode_f64(&spec, &inp).unwrap();
                let got = paged_decode_f64_alibi(&spec, &inp, Some(&slopes), 0).unwrap();
                assert!(max_diff(&got.lse, &plain.lse) > 1e-3);
            }
        }
        let (spec, inp) = paginate(
            &AttentionProblem::new(2, 4, 8, 16, false, DType::Bf16),
            &AttentionInputs::generate(&AttentionProblem::new(2, 4, 8, 16, false, DType::Bf16), 1),
            16,
            (-1, -1),
        );
        assert!(paged_decode_f64_alibi(&spec, &inp, Some(&[0.5; 3]), 0).is_err());
    }

    /// A window keeps exactly the keys of its band; softcap bounds every score.
    #[test]
    fn window_and_softcap_semantics() {
        let s = PagedDecodeSpec {
            batch: 1,
            seqlen_q: 4,
            heads_q: 1,
            heads_kv: 1,
            head_dim: 16,
            num_blocks: 1,
            page_size: 16,
            max_blocks: 1,
            window: (2, 1),
            softcap: 0.0,
            scale: 1.0,
        };
        // seqlen_k 10, Sq 4: diagonals 6..9; row 0 sees [4, 8), row 3 sees [7, 10).
        assert_eq!(s.visible(10, 0), (4, 8));
        assert_eq!(s.visible(10, 3), (7, 10));
        // seqlen_k 2 < Sq: causal rows 0 and 1 see nothing.
        let c = PagedDecodeSpec {
            window: (-1, 0),
            ..s.clone()
        };
        assert_eq!(c.visible(2, 0), (0, 0));
        assert_eq!(c.visible(2, 1), (0, 0));
        assert_eq!(c.visible(2, 2), (0, 1));

        let mut seed = 3u64;
        let q: Vec<f32> = (0..4 * 16).map(|_| 8.0 * lcg(&mut seed)).collect();
        let k: Vec<f32> = (0..16 * 16).map(|_| 8.0 * lcg(&mut seed)).collect();
        let v: Vec<f32> = (0..16 * 16).map(|_| lcg(&mut seed)).collect();
        let inputs = PagedDecodeInputs {
            q,
            k_cache: k,
            v_cache: v,
            block_table: vec![0],
            seqused_k: vec![2],
            cu_seqlens_q: None,
        };
        let out = paged_decode_f64(&c, &inputs).unwrap();
        assert_eq!(out.lse[0], f64::NEG_INFINITY);
        assert!(out.o[..16].iter().all(|&x| x == 0.0));
        assert!(out.lse[2].is_finite());
        // Softcap 5: lse <= log(#keys) + 5.
        let capped = PagedDecodeSpec {
            softcap: 5.0,
            window: (-1, -1),
            ..s
        };
        let inputs = PagedDecodeInputs {
            seqused_k: vec![16],
            ..inputs
        };
        let out = paged_decode_f64(&capped, &inputs).unwrap();
        for l in &out.lse {
            assert!(*l <= (16f64).ln() + 5.0 + 1e-12, "{l}");
        }
    }

    /// A mixed batch equals each sequence run alone with its own Sq (packed rows, lse
    /// `[heads_q, total_q]`); bad offsets are errors.
    #[test]
    fn mixed_batch_is_each_sequence_alone() {
        let (hq, hkv, d, page, mb) = (4, 2, 16, 16, 3);
        let lens_q = [1usize, 4, 0, 2];
        let seqused = [20usize, 3, 9, 40];
        let b = lens_q.len();
        let mut cu = vec![0usize];
        for &n in &lens_q {
            cu.push(cu.last().unwrap() + n);
        }
        let total = cu[b];
        let num_blocks = b * mb;
        let mut seed = 5u64;
        let mut gen = |n: usize| (0..n).map(|_| lcg(&mut seed)).collect::<Vec<f32>>();
        let q = gen(total * hq * d);
        let kc = gen(num_blocks * page * hkv * d);
        let vc = gen(num_blocks * page * hkv * d);
        let table: Vec<i32> = (0..num_blocks as i32).rev().collect();
        let spec = PagedDecodeSpec {
            batch: b,
            seqlen_q: 4,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            num_blocks,
            page_size: page,
            max_blocks: mb,
            window: (5, 0),
            softcap: 0.0,
            scale: 0.5,
        };
        let x = PagedDecodeInputs {
            q: q.clone(),
            k_cache: kc.clone(),
            v_cache: vc.clone(),
            block_table: table.clone(),
            seqused_k: seqused.to_vec(),
            cu_seqlens_q: Some(cu.clone()),
        };
        let mixed = paged_decode_f64(&spec, &x).unwrap();
        assert_eq!(
            (mixed.o.len(), mixed.lse.len()),
            (total * hq * d, hq * total)
        );
        for bi in 0..b {
            let sq = lens_q[bi];
            if sq == 0 {
                continue;
            }
            let one = PagedDecodeSpec {
                batch: 1,
                seqlen_q: sq,
                ..spec.clone()
            };
            let rows = cu[bi] * hq * d..cu[bi + 1] * hq * d;
            let alone = paged_decode_f64(
                &one,
                &PagedDecodeInputs {
                    q: q[rows.clone()].to_vec(),
                    k_cache: kc.clone(),
                    v_cache: vc.clone(),
                    block_table: table[bi * mb..(bi + 1) * mb].to_vec(),
                    seqused_k: vec![seqused[bi]],
                    cu_seqlens_q: None,
                },
            )
            .unwrap();
            assert_eq!(&mixed.o[rows], &alone.o[..], "o of sequence {bi}");
            for h in 0..hq {
                for i in 0..sq {
                    assert_eq!(mixed.lse[h * total + cu[bi] + i], alone.lse[h * sq + i]);
                }
            }
        }
        let mut bad = x.clone();
        bad.cu_seqlens_q = Some(vec![0, 1, 6, 6, 8]);
        let e = paged_decode_f64(&spec, &bad).unwrap_err().to_string();
        assert!(e.contains("cu_seqlens_q[2] - cu_seqlens_q[1] = 5"), "{e}");
    }

    #[test]
    fn bad_tables_are_errors() {
        let s = PagedDecodeSpec {
            batch: 1,
            seqlen_q: 1,
            heads_q: 2,
            heads_kv: 1,
            head_dim: 16,
            num_blocks: 2,
            page_size: 16,
            max_blocks: 2,
            window: (-1, 0),
            softcap: 0.0,
            scale: 1.0,
        };
        let x = PagedDecodeInputs {
            q: vec![0.0; 32],
            k_cache: vec![0.0; 2 * 16 * 16],
            v_cache: vec![0.0; 2 * 16 * 16],
            block_table: vec![0, 5],
            seqused_k: vec![20],
            cu_seqlens_q: None,
        };
        let e = paged_decode_f64(&s, &x).unwrap_err().to_string();
        assert!(e.contains("block_table[0][1] = 5"), "{e}");
        let x = PagedDecodeInputs {
            seqused_k: vec![33],
            ..x
        };
        let e = paged_decode_f64(&s, &x).unwrap_err().to_string();
        assert!(e.contains("seqused_k[0] = 33"), "{e}");
    }
}
