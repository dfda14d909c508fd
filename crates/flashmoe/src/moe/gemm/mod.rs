//! The grouped GEMMs of the MoE layer, forward and backward: [`tiles`] selects the portable
//! (mma.sync) kernels' tiles, [`sm90`] describes the Hopper (TMA + wgmma) kernels and their
//! tensor maps.

pub mod sm90;
pub mod tiles;
