//! The KV append: new rows written into the paged caches at each sequence's current length
//! ([`AppendArgs`]; raw layer [`DecodePlan::append_kv_raw`], cudarc layer
//! [`DecodePlan::append_kv`]).

use super::abi::{AppendParams, APPEND_ENTRY};
use super::args::{check_cache, check_strides_16b};
use super::class::DecodeClass;
use super::plan::DecodePlan;
use crate::attention::plan::Bshd;
use crate::error::{Error, Result};
use crate::gpu::raw::{self, param, Element, RawIndex, RawStream, RawTensor};
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::ffi::c_void;
use std::sync::Arc;

/// The tensors of one append: new rows `[B, Snew, Hkv, D]` written at positions
/// `seqused_k[b] .. seqused_k[b] + Snew` of each sequence's pages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AppendArgs {
    pub k_new: RawTensor,
    pub v_new: RawTensor,
    pub k_cache: RawTensor,
    pub v_cache: RawTensor,
    pub block_table: RawIndex,
    pub seqused_k: RawIndex,
}

impl DecodeClass {
    /// Check an append call without a device (the checks of
    /// [`DecodePlan::append_kv_raw`]); returns (batch, Snew).
    pub fn check_append(&self, a: &AppendArgs) -> Result<(usize, usize)> {
        let c = self;
        if a.k_new.rank != 4 {
            return Err(Error::invalid(format!(
                "k_new must be 4-D (batch, s_new, heads_kv, head_dim) but has shape {:?}",
                a.k_new.shape()
            )));
        }
        let [b, sn, _, _] = a.k_new.shape;
        let shape = [b, sn, c.heads_kv, c.head_dim];
        a.k_new.expect("k_new", c.dtype, &shape, 16)?;
        a.v_new.expect("v_new", c.dtype, &shape, 16)?;
        check_strides_16b("k_new", &a.k_new)?;
        check_strides_16b("v_new", &a.v_new)?;
        if b == 0 || sn == 0 {
            return Err(Error::invalid(format!(
                "empty append: batch {b}, s_new {sn} (each must be >= 1)"
            )));
        }
        if b > 65_535 || sn > i32::MAX as usize {
            return Err(Error::unsupported(
                APPEND_ENTRY,
                format!("batch {b} (<= 65535) or s_new {sn} out of the grid's range"),
            ));
        }
        check_cache(c, &a.k_cache, &a.v_cache, &a.block_table, b)?;
        a.seqused_k.expect("seqused_k", b, Some(1))?;
        Ok((b, sn))
    }
}

impl DecodePlan {
    /// Check an append call; returns (batch, Snew).
    pub fn check_append(&self, a: &AppendArgs) -> Result<(usize, usize)> {
        self.class.check_append(a)
    }

    /// Enqueue the append of `k_new`/`v_new` into the caches at positions
    /// `seqused_k[b] .. + Snew` (the lengths before this step; advance `seqused_k` after).
    ///
    /// # Safety
    /// As [`DecodePlan::forward_raw`]; positions past the table's capacity or on block ids
    /// outside `[0, num_blocks)` are skipped, so the caller makes sure the pages exist.
    pub unsafe fn append_kv_raw(&self, stream: RawStream, a: &AppendArgs) -> Result<()> {
        let (b, sn) = self.check_append(a)?;
        let (_, ps, mb) = (a.k_cache.shape[0], a.k_cache.shape[1], a.block_table.cols);
        crate::gpu::device::bind_context(&self.split.ctx)?;
        let st = |t: &RawTensor, i: usize| t.strides[i] as i64;
        let (kn, vn, k, v) = (&a.k_new, &a.v_new, &a.k_cache, &a.v_cache);
        let p = AppendParams {
            k_new: kn.ptr,
            v_new: vn.ptr,
            k_cache: k.ptr,
            v_cache: v.ptr,
            block_table: a.block_table.ptr,
            seqused_k: a.seqused_k.ptr,
            kn_sb: st(kn, 0),
            kn_ss: st(kn, 1),
            kn_sh: st(kn, 2),
            vn_sb: st(vn, 0),
            vn_ss: st(vn, 1),
            vn_sh: st(vn, 2),
            k_sblk: st(k, 0),
            k_srow: st(k, 1),
            k_sh: st(k, 2),
            v_sblk: st(v, 0),
            v_srow: st(v, 1),
            v_sh: st(v, 2),
            bt_stride: a.block_table.row_stride as i64,
            heads_kv: self.class.heads_kv as i32,
            page_size: ps as i32,
            max_blocks: mb as i32,
            num_blocks: k.shape[0] as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (sn as u32, b as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params: [*mut c_void; 1] = [param(&p)];
        raw::launch(APPEND_ENTRY, &self.append, cfg, stream, &mut params)
    }

    /// [`DecodePlan::append_kv_raw`] over cudarc buffers (see [`DecodePlan::forward`]).
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv<T, KN, VN, K, V>(
        &self,
        stream: &Arc<CudaStream>,
        k_new: Bshd<&KN>,
        v_new: Bshd<&VN>,
        k_cache: Bshd<&mut K>,
        v_cache: Bshd<&mut V>,
        block_table: &CudaSlice<i32>,
        seqused_k: &CudaSlice<i32>,
    ) -> Result<()>
    where
        T: Element,
        KN: DevicePtr<T>,
        VN: DevicePtr<T>,
        K: DevicePtrMut<T>,
        V: DevicePtrMut<T>,
    {
        self.check_stream(stream)?;
        let b = k_new.shape[0];
        let (kc_len, vc_len) = (k_cache.buf.len(), v_cache.buf.len());
        let (knp, _g1) = k_new.buf.device_ptr(stream);
        let (vnp, _g2) = v_new.buf.device_ptr(stream);
        let (kp, _g3) = k_cache.buf.device_ptr_mut(stream);
        let (vp, _g4) = v_cache.buf.device_ptr_mut(stream);
        let (btp, _g5) = block_table.device_ptr(stream);
        let (sup, _g6) = seqused_k.device_ptr(stream);
        let args = AppendArgs {
            k_new: RawTensor::new(knp, T::DTYPE, &k_new.shape, &k_new.strides)?,
            v_new: RawTensor::new(vnp, T::DTYPE, &v_new.shape, &v_new.strides)?,
            k_cache: RawTensor::new(kp, T::DTYPE, &k_cache.shape, &k_cache.strides)?,
            v_cache: RawTensor::new(vp, T::DTYPE, &v_cache.shape, &v_cache.strides)?,
            block_table: RawIndex::block_table(btp, block_table.len(), b)?,
            seqused_k: RawIndex::vector(sup, seqused_k.len()),
        };
        self.check_append(&args)?;
        for (name, t, len) in [
            ("k_new", &args.k_new, k_new.buf.len()),
            ("v_new", &args.v_new, v_new.buf.len()),
            ("k_cache", &args.k_cache, kc_len),
            ("v_cache", &args.v_cache, vc_len),
        ] {
            t.check_within(name, len)?;
        }
        // SAFETY: as in `forward`.
        unsafe { self.append_kv_raw(stream.cu_stream(), &args) }
    }
}
