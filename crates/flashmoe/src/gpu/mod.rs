//! CUDA runtime.
