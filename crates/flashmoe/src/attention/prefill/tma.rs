//! TMA tensor maps (CUtensorMap) for the sm_90a attention kernel.
//!
//! The kernel loads Q, K and V tiles with `cp.async.bulk.tensor.4d` and stores O the same
//! way (one 16-row box per consumer warp), described by tensor maps made here on the host
//! with `cuTensorMapEncodeTiled` and passed by value as `__grid_constant__` kernel
//! parameters. [`bshd_tile_params`] is the pure part (dims,
//! strides, box; unit-tested without a GPU); [`encode`] calls the driver.
//!
//! Layout (the v1 contract, abi.rs): a (batch, seq, heads, head_dim) contiguous tensor of
//! 16-bit elements is described innermost first as (head_dim, heads, seq, batch). The box
//! is (64, 1, rows, 1): 64 elements = one 128-byte row of the 128B swizzle, one head, `rows`
//! sequence positions. Rows past `seq` are out of bounds of their own batch and are written
//! as zeros, which is what makes ragged lengths safe without a bounds check in the kernel;
//! a stored box's rows past `seq` are not written. (The kernel never passes a negative
//! coordinate: an O store starting at a negative row raised an illegal instruction on the H100.)

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::tensor_map::{self, TensorMap, TiledLayout};

/// Elements per box row: 128 bytes of 16-bit values, the width of the 128B swizzle.
pub const BOX_COLS: u32 = 64;

/// Rows of the sm_90a kernel's O store box: one consumer warp's 16 rows.
pub const O_STORE_BOX_ROWS: u32 = 16;

/// Shape of one 4-D tiled tensor map, innermost dimension first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMapParams {
    /// (head_dim, heads, seq, batch) in elements.
    pub dims: [u64; 4],
    /// Byte strides of dims 1..3 (dim 0 is contiguous).
    pub strides_bytes: [u64; 3],
    /// Box (64, 1, rows, 1) in elements.
    pub box_dims: [u32; 4],
}

impl TensorMapParams {
    /// The same map as a generic [`TiledLayout`] (element strides).
    pub fn layout(&self) -> TiledLayout {
        TiledLayout {
            dims: self.dims.to_vec(),
            strides: self.strides_bytes.iter().map(|s| s / 2).collect(),
            box_dims: self.box_dims.to_vec(),
        }
    }
    /// Bytes one box load writes to shared memory (out-of-bounds elements included).
    pub fn box_bytes(&self) -> u64 {
        self.box_dims.iter().map(|&b| b as u64).product::<u64>() * 2
    }
}

/// Tensor-map shape for a contiguous (batch, seq, heads, head_dim) 16-bit tensor, loaded
/// in boxes of `box_rows` sequence positions × 64 columns of one head. Errors name the
/// limit of cuTensorMapEncodeTiled that the shape breaks.
pub fn bshd_tile_params(
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    box_rows: u32,
) -> Result<TensorMapParams> {
    let strides = [seq * heads * head_dim, heads * head_dim, head_dim, 1];
    bshd_strided_params(
        "tensor map",
        [batch, seq, heads, head_dim],
        strides,
        box_rows,
    )
}

/// Like [`bshd_tile_params`] for a strided (batch, seq, heads, head_dim) view: `strides`
/// in elements, the last 1 (a view into a packed QKV buffer has a larger seq stride).
/// `what` names the tensor in errors.
pub fn bshd_strided_params(
    what: &str,
    shape: [usize; 4],
    strides: [usize; 4],
    box_rows: u32,
) -> Result<TensorMapParams> {
    let [batch, seq, heads, head_dim] = shape;
    // Whole boxes of 64 columns, or (head dim 96) a last box that reaches 32 columns past
    // the row: TMA fills those with zeros on a load (and does not write them on a store).
    if head_dim == 0 || head_dim % (BOX_COLS as usize / 2) != 0 {
        return Err(Error::unsupported(
            what,
            format!("head dim {head_dim} is not a multiple of {}", BOX_COLS / 2),
        ));
    }
    if box_rows == 0 || box_rows > 256 {
        return Err(Error::unsupported(
            what,
            format!("box of {box_rows} rows (1..=256)"),
        ));
    }
    if strides[3] != 1 {
        return Err(Error::invalid(format!(
            "{what}: head_dim stride {} must be 1 (contiguous rows)",
            strides[3]
        )));
    }
    let dims = [head_dim as u64, heads as u64, seq as u64, batch as u64];
    for (name, d) in ["head_dim", "heads", "seq", "batch"].iter().zip(dims) {
        if d == 0 || d > 1 << 32 {
            return Err(Error::unsupported(
                what,
                format!("{name} = {d} is outside 1..=2^32"),
            ));
        }
    }
    // Innermost first: heads, seq, batch.
    let strides_bytes = [
        strides[2] as u64 * 2,
        strides[1] as u64 * 2,
        strides[0] as u64 * 2,
    ];
    for (name, s) in ["heads", "seq", "batch"].iter().zip(strides_bytes) {
        if s % 16 != 0 || s >= 1 << 40 {
            return Err(Error::invalid(format!(
                "{what}: the {name} stride ({s} bytes) must be a multiple of 16 bytes (8 \
                 elements) below 2^40, as TMA requires"
            )));
        }
    }
    Ok(TensorMapParams {
        dims,
        strides_bytes,
        box_dims: [BOX_COLS, 1, box_rows, 1],
    })
}

/// Encode a tensor map over the device buffer at `ptr` (16-byte aligned): 128-byte
/// swizzle, zero fill out of bounds, 256-byte L2 promotion (see [`crate::gpu::tensor_map`]).
/// `what` names the tensor in errors.
/// The parameters were checked when they were made ([`bshd_strided_params`]): this is one
/// driver call, no allocation.
pub fn encode(what: &str, params: &TensorMapParams, dtype: DType, ptr: u64) -> Result<TensorMap> {
    if ptr % 16 != 0 {
        return Err(Error::invalid(format!(
            "{what}: device address {ptr:#x} is not 16-byte aligned (TMA requires it)"
        )));
    }
    let strides = params.strides_bytes.map(|s| s / 2);
    tensor_map::encode_checked(
        what,
        ptr,
        tensor_map::map_data_type(what, dtype)?,
        &params.dims,
        &strides,
        &params.box_dims,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_follow_the_bshd_layout() {
        // q of B=2, S=100, H=8, D=128, boxes of 128 rows.
        let p = bshd_tile_params(2, 100, 8, 128, 128).unwrap();
        assert_eq!(p.dims, [128, 8, 100, 2]);
        assert_eq!(p.strides_bytes, [256, 256 * 8, 256 * 8 * 100]);
        assert_eq!(p.box_dims, [64, 1, 128, 1]);
        assert_eq!(p.box_bytes(), 64 * 128 * 2);
        for s in p.strides_bytes {
            assert_eq!(s % 16, 0);
        }
        p.layout().check("q").unwrap();
        // D=64, MQA k: one head.
        let p = bshd_tile_params(1, 7, 1, 64, 128).unwrap();
        assert_eq!(p.dims, [64, 1, 7, 1]);
        assert_eq!(p.strides_bytes, [128, 128, 128 * 7]);
    }

    #[test]
    fn params_reject_what_tma_cannot_do() {
        let e = bshd_tile_params(1, 10, 2, 80, 128).unwrap_err().to_string();
        assert!(e.contains("head dim 80"), "{e}");
        // D = 96: two boxes, the second reaching 32 columns past the row (zero fill).
        let p = bshd_tile_params(1, 10, 2, 96, 128).unwrap();
        assert_eq!(p.dims, [96, 2, 10, 1]);
        assert_eq!(p.strides_bytes, [192, 384, 3840]);
        let e = bshd_tile_params(1, 10, 2, 64, 512).unwrap_err().to_string();
        assert!(e.contains("512 rows"), "{e}");
        let e = bshd_tile_params(1, 0, 2, 64, 128).unwrap_err().to_string();
        assert!(e.contains("seq = 0"), "{e}");
        // A view with a 4-element misalignment of its rows.
        let e = bshd_strided_params("q", [1, 10, 2, 64], [1300, 130, 64, 1], 128)
            .unwrap_err()
            .to_string();
        assert!(e.contains("q: the seq stride (260 bytes)"), "{e}");
    }

    #[test]
    fn strided_params_describe_a_packed_qkv_view() {
        // q of (b=2, s=100, h=8, d=128) inside qkv (2, 100, 3 * 8, 128).
        let (h, d) = (8usize, 128usize);
        let p = bshd_strided_params("q", [2, 100, h, d], [100 * 3 * h * d, 3 * h * d, d, 1], 128)
            .unwrap();
        assert_eq!(p.dims, [128, 8, 100, 2]);
        assert_eq!(p.strides_bytes, [256, 256 * 24, 256 * 24 * 100]);
        assert_eq!(
            bshd_tile_params(2, 100, 8, 128, 128).unwrap().strides_bytes,
            [256, 2048, 204800]
        );
    }
}
