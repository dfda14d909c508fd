//! Attention forward on the GPU: kernel selection ([`config`]) and launch.
pub mod config;
