//! Every attention-backward kernel variant (head dim × dtype × masking) compiles with NVRTC
//! for sm_80 and sm_90a on a machine without a GPU, fits the architectures' limits, and
//! does not spill registers. NVRTC as for `kernels_compile.rs` (scripts/install-nvrtc.sh
//! or FLASHMOE_NVRTC_LIB). With `FLASHMOE_BWD_PRECOMPILE_DIR` set, the images also go to
//! that kernel-cache directory (a device run can carry it as FLASHMOE_CACHE_DIR).

use flashmoe::attention::backward::{
    all_bwd_classes, bwd_defines, BwdTile, BWD_DKDV_ENTRY, BWD_DQ_ENTRY, BWD_SOURCE,
};
use flashmoe::gpu::{kernels, KernelCache};
mod common;
use common::{arch_limits, nvrtc, ARCHS};

#[test]
fn every_backward_variant_compiles_without_spills() {
    nvrtc();
    let src = kernels::source(BWD_SOURCE).unwrap();
    let dir = std::env::var_os("FLASHMOE_BWD_PRECOMPILE_DIR").map(std::path::PathBuf::from);
    let cache = KernelCache::offline(dir);
    for class in all_bwd_classes() {
        let tile = BwdTile::for_head_dim(class.head_dim).unwrap();
        let defs = bwd_defines(&class, &tile);
        for arch in ARCHS {
            let k = cache
                .compile(BWD_SOURCE, src, BWD_DKDV_ENTRY, &defs, arch)
                .unwrap_or_else(|e| panic!("{class:?} {arch}: {e}"))
                .compiled;
            let (smem_limit, _) = arch_limits(arch);
            assert!(tile.kv_smem_bytes() as u64 <= smem_limit);
            assert!(tile.q_smem_bytes() as u64 <= smem_limit);
            for f in &k.all_functions {
                eprintln!(
                    "D={} {:?} causal={} window={:?} softcap={} {arch} {}: {f}",
                    class.head_dim, class.dtype, class.causal, class.window, class.softcap, f.name
                );
            }
            assert!(
                k.all_functions.iter().any(|f| f.name == BWD_DQ_ENTRY),
                "{}",
                k.log
            );
            assert!(!k.spills(), "{class:?} {arch} spills: {}", k.log);
        }
    }
}

/// The varlen (`FM_VARLEN`) dK/dV + dQ module: every head dim and dtype, unmasked and with
/// every mask at once (causal, window, softcap: the most registers), for sm_80 and sm_90a.
#[test]
fn varlen_backward_variants_compile_without_spills() {
    use flashmoe::attention::backward::varlen::varlen_bwd_defines;
    nvrtc();
    let src = kernels::source(BWD_SOURCE).unwrap();
    let dir = std::env::var_os("FLASHMOE_BWD_PRECOMPILE_DIR").map(std::path::PathBuf::from);
    let cache = KernelCache::offline(dir);
    let classes = all_bwd_classes()
        .into_iter()
        .filter(|c| (!c.causal && c.softcap == 0.0) || (c.window.0 >= 0 && c.softcap > 0.0));
    for class in classes {
        let tile = BwdTile::for_head_dim(class.head_dim).unwrap();
        let defs = varlen_bwd_defines(&class, &tile);
        for arch in ARCHS {
            let k = cache
                .compile(BWD_SOURCE, src, BWD_DKDV_ENTRY, &defs, arch)
                .unwrap_or_else(|e| panic!("varlen {class:?} {arch}: {e}"))
                .compiled;
            for f in &k.all_functions {
                eprintln!(
                    "varlen D={} {:?} causal={} window={:?} softcap={} {arch} {}: {f}",
                    class.head_dim, class.dtype, class.causal, class.window, class.softcap, f.name
                );
            }
            assert!(
                k.all_functions.iter().any(|f| f.name == BWD_DQ_ENTRY),
                "{}",
                k.log
            );
            assert!(!k.spills(), "varlen {class:?} {arch} spills: {}", k.log);
        }
    }
}
