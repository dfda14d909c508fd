//! Deterministic inputs: the same values for a given (seed, tensor, index) on every
//! backend, so our kernels and the Python baselines consume identical bytes.
//!
//! The generator is counter-based (no state): for tensor id `t` and flat index `i`,
//!
//! ```text
//! mix(z)  = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^ (z >> 31)
//! key     = mix(seed ^ mix(t + 0x9E3779B97F4A7C15))
//! bits    = mix(key + i * 0x9E3779B97F4A7C15)          (all arithmetic mod 2^64)
//! u       = (bits >> 40) / 2^24                         (24 bits: exact in f32, in [0, 1))
//! value   = (2u - 1) * scale                            (uniform in [-scale, scale))
//! ```
//!
//! and the value is then rounded to the tensor's dtype (round-to-nearest-even). The
//! Python worker reproduces exactly this with numpy's uint64 arithmetic.

use crate::dtype::DType;
use rayon::prelude::*;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Stable tensor identifiers. Never renumber: results files and the Python worker
/// depend on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum TensorId {
    Q = 1,
    K = 2,
    V = 3,
    /// Upstream gradient of an attention output (o's layout), for the lab's backward.
    DOut = 4,
    /// MoE input activations (tokens, hidden).
    MoeX = 10,
    /// Router weight (hidden, experts).
    MoeRouter = 11,
    /// Gate and up projections (experts, hidden, 2·intermediate).
    MoeW13 = 12,
    /// Down projection (experts, intermediate, hidden).
    MoeW2 = 13,
    /// Shared expert gate/up (hidden, 2·intermediate).
    MoeSharedW13 = 14,
    /// Shared expert down (intermediate, hidden).
    MoeSharedW2 = 15,
    /// Upstream gradient of the MoE layer output (tokens, hidden).
    MoeDOut = 16,
}

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The per-(seed, tensor) key of [`uniform`]: element `i`'s bits are
/// `mix(key + i · 0x9E3779B97F4A7C15)` (SplitMix64's finaliser), the top 24 of them the
/// value. Exposed so a device-side generator can produce the same values.
pub fn stream_key(seed: u64, tensor: TensorId) -> u64 {
    mix(seed ^ mix((tensor as u64).wrapping_add(GOLDEN)))
}

/// Uniform value in [-1, 1) for (seed, tensor, index), before any dtype rounding.
#[inline]
pub fn uniform(seed: u64, tensor: TensorId, index: u64) -> f32 {
    let key = stream_key(seed, tensor);
    let bits = mix(key.wrapping_add(index.wrapping_mul(GOLDEN)));
    let u = (bits >> 40) as f32 * (1.0 / 16_777_216.0);
    2.0 * u - 1.0
}

/// `len` values uniform in [-scale, scale), rounded to `dtype`.
pub fn generate(seed: u64, tensor: TensorId, len: usize, scale: f32, dtype: DType) -> Vec<f32> {
    (0..len)
        .into_par_iter()
        .with_min_len(4096)
        .map(|i| dtype.round(uniform(seed, tensor, i as u64) * scale))
        .collect()
}

/// FNV-1a 64 over the little-endian bytes of `dtype`-encoded values: the checksum every
/// implementation reports so identical inputs can be proven in a report.
pub fn checksum(values: &[f32], dtype: DType) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    };
    match dtype {
        DType::F32 => values
            .iter()
            .for_each(|v| v.to_le_bytes().into_iter().for_each(&mut eat)),
        // Encoded on the fly: no copy of a tensor that may be tens of GB.
        _ => values.iter().for_each(|&v| {
            dtype
                .encode_one_u16(v)
                .to_le_bytes()
                .into_iter()
                .for_each(&mut eat)
        }),
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_stable_across_versions() {
        // Frozen values: if this test fails, every recorded checksum and the Python
        // worker's generator are invalidated. Do not "fix" it by updating the numbers.
        let got: Vec<f32> = (0..4).map(|i| uniform(42, TensorId::Q, i)).collect();
        let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, FROZEN_Q_SEED42);
    }

    // Computed independently with Python (see python/flashmoe_inputs.py): -0.8231796, -0.59635735, 0.7436669, 0.1306715.
    const FROZEN_Q_SEED42: [u32; 4] = [0xbf52bbe6, 0xbf18aae0, 0x3f3e60f4, 0x3e05cec0];

    #[test]
    fn distribution_is_uniform_and_tensors_differ() {
        let xs = generate(7, TensorId::K, 100_000, 1.0, DType::F32);
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0 / 3.0).abs() < 0.01, "var {var}");
        assert!(xs.iter().all(|&x| (-1.0..1.0).contains(&x)));
        let ys = generate(7, TensorId::V, 16, 1.0, DType::F32);
        assert_ne!(&xs[..16], &ys[..]);
        let zs = generate(8, TensorId::K, 16, 1.0, DType::F32);
        assert_ne!(&xs[..16], &zs[..]);
    }

    #[test]
    fn dtype_rounding_and_checksum() {
        let a = generate(1, TensorId::Q, 1000, 1.0, DType::Bf16);
        assert!(a.iter().all(|&x| DType::Bf16.round(x) == x));
        assert_eq!(checksum(&a, DType::Bf16), checksum(&a.clone(), DType::Bf16));
        let b = generate(2, TensorId::Q, 1000, 1.0, DType::Bf16);
        assert_ne!(checksum(&a, DType::Bf16), checksum(&b, DType::Bf16));
    }
}
