//! candle-flash-attn's API on flashmoe: every function candle-flash-attn 0.11 exports,
//! re-exported from flashmoe-candle, so candle-transformers' `flash-attn` feature runs
//! flashmoe's kernels with no change to the model code.
pub use flashmoe_candle::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed, flash_attn_alibi_windowed_softcap,
    flash_attn_varlen, flash_attn_varlen_alibi, flash_attn_varlen_alibi_windowed,
    flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_windowed, flash_attn_windowed,
};
