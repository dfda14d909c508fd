//! Element types of kernel inputs and outputs.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Storage type of a tensor. Accumulation is always f32 (kernels) or f64 (reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F16,
    Bf16,
    F32,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
        }
    }

    /// Round an f32 to this type and back: what a kernel reading this type sees.
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F16 => half::f16::from_f32(x).to_f32(),
            DType::Bf16 => half::bf16::from_f32(x).to_f32(),
            DType::F32 => x,
        }
    }

    /// Encode f32 values to this type's little-endian bits (2 bytes per element for
    /// f16/bf16), as uploaded to a device buffer.
    pub fn encode_u16(self, xs: &[f32]) -> Vec<u16> {
        use rayon::prelude::*;
        // Parallel: MoE weights reach 11·10⁹ values (DeepSeek-V3), uploaded per config.
        match self {
            DType::F16 => xs
                .par_iter()
                .with_min_len(1 << 16)
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect(),
            DType::Bf16 => xs
                .par_iter()
                .with_min_len(1 << 16)
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect(),
            DType::F32 => panic!("encode_u16 called for f32"),
        }
    }

    /// The 16-bit encoding of one value (`encode_u16` of a single element).
    pub fn encode_one_u16(self, x: f32) -> u16 {
        match self {
            DType::F16 => half::f16::from_f32(x).to_bits(),
            DType::Bf16 => half::bf16::from_f32(x).to_bits(),
            DType::F32 => panic!("encode_one_u16 called for f32"),
        }
    }

    /// Decode 16-bit values of this type back to f32.
    pub fn decode_u16(self, bits: &[u16]) -> Vec<f32> {
        match self {
            DType::F16 => bits
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
            DType::Bf16 => bits
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect(),
            DType::F32 => panic!("decode_u16 called for f32"),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            other => Err(format!(
                "unknown dtype '{other}': expected one of f16, bf16, f32"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_round_trip() {
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::Bf16);
        assert_eq!("FP16".parse::<DType>().unwrap(), DType::F16);
        assert!("int8".parse::<DType>().unwrap_err().contains("int8"));
        let xs = [1.0f32, -0.5, 3.140625];
        for dt in [DType::F16, DType::Bf16] {
            let back = dt.decode_u16(&dt.encode_u16(&xs));
            assert_eq!(back, xs.to_vec());
        }
        // bf16 keeps 8 mantissa bits: 1 + 2^-9 rounds to 1.
        assert_eq!(DType::Bf16.round(1.0 + 1.0 / 512.0), 1.0);
        assert_ne!(DType::F16.round(1.0 + 1.0 / 512.0), 1.0);
    }
}
