//! Shared by the NVRTC compile tests: the target architectures, their limits, and loading
//! NVRTC (failing, not skipping, when it is missing).

use flashmoe::gpu::nvrtc::{self, Nvrtc};
use std::path::PathBuf;

pub const ARCHS: [&str; 2] = ["sm_80", "sm_90a"];

/// Shared-memory limit per block (opt-in maximum) and registers per SM of the
/// architectures compiled here: a variant above them could never launch.
pub fn arch_limits(arch: &str) -> (u64, u64) {
    match arch {
        // A100: 163 KiB per block; H100: 227 KiB per block. 64K registers per SM.
        "sm_80" => (163 * 1024, 65_536),
        "sm_90a" => (227 * 1024, 65_536),
        other => panic!("no limits for {other}"),
    }
}

fn nvrtc_lib_dir() -> PathBuf {
    match std::env::var_os("FLASHMOE_NVRTC_LIB") {
        Some(p) => PathBuf::from(p),
        None => nvrtc::dev_checkout_nvrtc_dir(),
    }
}

/// NVRTC from `$FLASHMOE_NVRTC_LIB` or `<repo>/.nvrtc`; panics with the fix when absent.
pub fn nvrtc() -> &'static Nvrtc {
    let dir = nvrtc_lib_dir();
    if !dir.exists() {
        panic!(
            "NVRTC not found at {}: run scripts/install-nvrtc.sh (installs the \
             nvidia-cuda-nvrtc==13.0.88 wheel into <repo>/.nvrtc), or set \
             FLASHMOE_NVRTC_LIB to the directory holding libnvrtc.so.13",
            dir.display()
        );
    }
    match flashmoe::gpu::init_nvrtc_from(&dir) {
        Ok(n) => n,
        Err(e) => panic!(
            "cannot load NVRTC from {}: {e}\nrun scripts/install-nvrtc.sh or fix \
             FLASHMOE_NVRTC_LIB",
            dir.display()
        ),
    }
}
