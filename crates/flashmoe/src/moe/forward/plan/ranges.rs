//! Kernel resolution by token range: which kernels a token count selects
//! ([`select::select`], [`sm90::select_path`]), the maximal ranges of token counts
//! with one selection (found by bisection), and loading each distinct kernel once.

use super::class::MoeClass;
use crate::error::{Error, Result};
use crate::gpu::Device;
use crate::moe::forward::select::{self, MoeKernel};
use crate::moe::gemm::sm90::{self, GemmPath};
use cudarc::driver::CudaFunction;

/// The maximal token ranges `[first, last]` of `lo..=hi` on which `key` is constant, with
/// their keys, found by bisection: O(pieces · log(hi − lo)) evaluations. Correct when each
/// component of the key changes monotonically with the token count (never returns to a
/// value it left), which holds for every choice [`select::select`] and
/// [`sm90::select_path`] make (thresholds on tokens or rows per expert); a unit test
/// checks it against an exhaustive scan.
pub(crate) fn token_pieces<K: PartialEq>(
    lo: usize,
    hi: usize,
    mut key: impl FnMut(usize) -> Result<K>,
) -> Result<Vec<(usize, usize, K)>> {
    let mut out = Vec::new();
    let mut first = lo;
    let mut k_first = key(lo)?;
    loop {
        // Last token with the key of `first`: invariant key(a) == k_first != key(b).
        let k_hi = key(hi)?;
        let last = if k_hi == k_first {
            hi
        } else {
            let (mut a, mut b) = (first, hi);
            while b - a > 1 {
                let m = a + (b - a) / 2;
                if key(m)? == k_first {
                    a = m;
                } else {
                    b = m;
                }
            }
            a
        };
        out.push((first, last, k_first));
        if last == hi {
            return Ok(out);
        }
        first = last + 1;
        k_first = key(first)?;
    }
}

/// One range of token counts with the same kernels (indices into `MoePlan::loaded`).
#[derive(Debug, Clone)]
pub(super) struct Bucket {
    pub(super) first: usize,
    pub(super) last: usize,
    pub(super) logits: usize,
    pub(super) gemm13: usize,
    pub(super) gemm2: usize,
    /// (gemm13, gemm2) of the sm_90 path, or None: the portable kernels.
    pub(super) sm90: Option<(usize, usize)>,
}

/// A token range of a plan and the kernels its calls run (for reports and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRange {
    pub first: usize,
    pub last: usize,
    /// The router-logits kernel's entry.
    pub logits: &'static str,
    /// Report line of the grouped-GEMM path (as
    /// [`MoePlan::gemm_path`](super::MoePlan::gemm_path) at `first`).
    pub gemm_path: String,
}

pub(super) fn load(
    dev: &Device,
    loaded: &mut Vec<(MoeKernel, CudaFunction)>,
    k: &MoeKernel,
) -> Result<usize> {
    if let Some(i) = loaded.iter().position(|(l, _)| l == k) {
        return Ok(i);
    }
    if dev.arch() < k.min_arch {
        return Err(Error::unsupported(
            k.entry,
            format!(
                "needs compute capability {}.{} or newer but {} is {}.{}",
                k.min_arch / 10,
                k.min_arch % 10,
                dev.info().name,
                dev.info().compute_capability.0,
                dev.info().compute_capability.1
            ),
        ));
    }
    let f = dev.load_kernel(k.source_file, k.entry, &k.defines)?;
    dev.set_dynamic_shared_memory(k.entry, &f, k.shared_mem_bytes)?;
    loaded.push((k.clone(), f));
    Ok(loaded.len() - 1)
}

/// What a token count selects: the seven pipeline kernels and the sm_90 (gemm13, gemm2)
/// kernels when that path runs (None: the portable ones). The portable path's reason is
/// left out: it quotes the rows per expert, which change with every token count.
type Selection = (Vec<MoeKernel>, Option<(MoeKernel, MoeKernel)>);

pub(super) fn selection(
    class: &MoeClass,
    tokens: usize,
    arch: u32,
    path: Option<&str>,
) -> Result<Selection> {
    let p = class.problem(tokens);
    let kernels = select::select(&p)?;
    let sm90 = match sm90::select_path(&p, arch, path)? {
        GemmPath::Sm90(k13, k2) => Some((k13, k2)),
        GemmPath::Portable(_) => None,
    };
    Ok((kernels, sm90))
}

/// The token ranges of `class` over `min_tokens..=max_tokens` and their selections, for
/// compute capability `arch` (pure: no device).
pub(crate) fn plan_selections(
    class: &MoeClass,
    min_tokens: usize,
    arch: u32,
    path: Option<&str>,
) -> Result<Vec<(usize, usize, Selection)>> {
    class.problem(1).validate()?;
    if min_tokens == 0 || min_tokens > class.max_tokens {
        return Err(Error::invalid(format!(
            "an MoE plan needs 1 <= min_tokens ({min_tokens}) <= max_tokens ({})",
            class.max_tokens
        )));
    }
    // Limits at the largest call first: a clear error before any bisection.
    select::check_limits(&class.problem(class.max_tokens))?;
    token_pieces(min_tokens, class.max_tokens, |t| {
        selection(class, t, arch, path)
    })
}

#[cfg(test)]
mod tests {
    use super::super::class::tests::class;
    use super::*;

    /// The bisection finds exactly the ranges an exhaustive scan finds, for the model
    /// shapes of the presets (E = 8, 32, 64, 128, 256; with and without E % 32 == 0),
    /// on sm_90 and sm_80, auto and forced paths.
    #[test]
    fn token_ranges_match_an_exhaustive_scan() {
        let shapes = [
            (4096, 14336, 8, 2),
            (4096, 11008, 32, 2),
            (2048, 768, 128, 8),
            (7168, 2048, 256, 8),
            (1024, 512, 64, 8),
            (256, 256, 48, 4),
        ];
        for (h, i, e, k) in shapes {
            let c = MoeClass {
                hidden: h,
                intermediate: i,
                experts: e,
                top_k: k,
                ..class(2200)
            };
            for (arch, path) in [
                (90, None),
                (80, None),
                (90, Some("sm90")),
                (90, Some("portable")),
            ] {
                let Ok(pieces) = plan_selections(&c, 1, arch, path) else {
                    continue;
                };
                let mut t = 1;
                for (first, last, sel) in &pieces {
                    assert_eq!(*first, t, "{c:?}");
                    for tok in *first..=*last {
                        assert_eq!(
                            &selection(&c, tok, arch, path).unwrap(),
                            sel,
                            "{c:?} arch {arch} {path:?} tokens {tok}"
                        );
                    }
                    t = last + 1;
                }
                assert_eq!(t, 2201);
                assert!(pieces.len() < 16, "{}", pieces.len());
            }
        }
    }

    #[test]
    fn pieces_of_a_step_function() {
        let p = token_pieces(1, 100, |t| Ok(t / 30)).unwrap();
        let ranges: Vec<(usize, usize, usize)> = p;
        assert_eq!(
            ranges,
            vec![(1, 29, 0), (30, 59, 1), (60, 89, 2), (90, 100, 3)]
        );
        assert_eq!(token_pieces(5, 5, |_| Ok(1)).unwrap(), vec![(5, 5, 1)]);
        assert!(token_pieces(1, 9, |t| if t > 4 {
            Err(Error::invalid("x"))
        } else {
            Ok(0)
        })
        .is_err());
    }

    #[test]
    fn plan_selection_errors_are_clear() {
        let e = plan_selections(&class(0), 1, 90, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_tokens (0)"), "{e}");
        let e = plan_selections(
            &MoeClass {
                experts: 300,
                ..class(16)
            },
            1,
            90,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("experts = 300"), "{e}");
        let e = plan_selections(&class(16), 1, 80, Some("sm90"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm90"), "{e}");
        let e = plan_selections(&class(16), 1, 90, Some("fast"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("auto, portable, sm90"), "{e}");
    }
}
