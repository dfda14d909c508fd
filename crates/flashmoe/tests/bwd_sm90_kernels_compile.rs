//! Every sm_90a attention-backward variant (head dim × dtype × masking, production tiles
//! and the other tiles the lab times) compiles with NVRTC for sm_90a on a machine without
//! a GPU, fits the shared-memory limit, does not spill registers and keeps its wgmmas
//! pipelined (no ptxas C7511). NVRTC as for
//! `kernels_compile.rs` (scripts/install-nvrtc.sh or FLASHMOE_NVRTC_LIB). With
//! FLASHMOE_BWD_CUBIN_DIR set, every variant's cubin is written there (for nvdisasm).

use flashmoe::attention::backward::{
    all_sm90_bwd_classes, sm90_bwd_defines, Sm90BwdTile, BWD_SM90_DKDV_ENTRY,
    BWD_SM90_DQ_CONVERT_ENTRY, BWD_SM90_DQ_ENTRY, BWD_SM90_DQ_ZERO_ENTRY, BWD_SM90_SOURCE,
};
use flashmoe::gpu::{kernels, KernelCache};
mod common;
use common::{arch_limits, nvrtc, ARCHS};

#[test]
fn every_sm90_backward_variant_compiles_without_spills() {
    nvrtc();
    let src = kernels::source(BWD_SM90_SOURCE).unwrap();
    let cache = KernelCache::offline(None);
    let arch = "sm_90a";
    assert!(ARCHS.contains(&arch));
    let classes = all_sm90_bwd_classes();
    assert_eq!(
        classes.len(),
        3 * 2 * 6,
        "head dims 64/96/128 x bf16/f16 x (non-causal, causal, window) x (softcap or not)"
    );
    for class in classes {
        // Every class: the production tile, the fused-dQ tiles and the producer builds that
        // serve its masking; bf16 causal without softcap: every tile the lab times.
        let mut tiles = Sm90BwdTile::lab_tiles(class.head_dim);
        let plain_causal =
            class.causal && class.window == flashmoe::problem::NO_WINDOW && class.softcap == 0.0;
        if !(plain_causal && class.dtype == flashmoe::DType::Bf16) {
            let prod = tiles[0];
            tiles.retain(|t| *t == prod || t.dq.fused() || t.producer());
        }
        tiles.retain(|t| t.serves(&class));
        for tile in tiles {
            let defs = sm90_bwd_defines(&class, &tile);
            let k = cache
                .compile(BWD_SM90_SOURCE, src, BWD_SM90_DKDV_ENTRY, &defs, arch)
                .unwrap_or_else(|e| panic!("{class:?} {tile:?}: {e}"))
                .compiled;
            // FLASHMOE_BWD_CUBIN_DIR=dir: each variant's cubin there, for nvdisasm.
            if let Some(dir) = std::env::var_os("FLASHMOE_BWD_CUBIN_DIR") {
                let name = format!(
                    "bwd-d{}-{:?}-c{}-w{}-cap{}-m{}-n{}-s{}-{:?}-p{}.cubin",
                    class.head_dim,
                    class.dtype,
                    u8::from(class.causal),
                    u8::from(class.window != flashmoe::problem::NO_WINDOW),
                    u8::from(class.softcap > 0.0),
                    tile.kv_block_m,
                    tile.q_block_n,
                    tile.stages,
                    tile.dq,
                    tile.producer_warps
                );
                std::fs::write(std::path::Path::new(&dir).join(name), &k.image).unwrap();
            }
            let (smem_limit, _) = arch_limits(arch);
            assert!(tile.kv_smem_bytes() as u64 <= smem_limit);
            assert!(tile.q_smem_bytes() as u64 <= smem_limit);
            for f in &k.all_functions {
                eprintln!(
                    "sm90 bwd D={} {:?} causal={} {tile:?}: {f}",
                    class.head_dim, class.dtype, class.causal
                );
            }
            let others: &[&str] = if tile.dq.fused() {
                &[BWD_SM90_DQ_CONVERT_ENTRY, BWD_SM90_DQ_ZERO_ENTRY]
            } else {
                &[BWD_SM90_DQ_ENTRY]
            };
            for entry in others {
                assert!(
                    k.all_functions.iter().any(|f| f.name == *entry),
                    "{entry}: {}",
                    k.log
                );
            }
            assert!(!k.spills(), "{class:?} {tile:?} spills: {}", k.log);
            // ptxas serialises the wgmmas (C7511) when their accumulators do not fit: the
            // kernel runs, 20-25 % slower (measured, docs/design/attention-backward.md v4).
            assert!(
                !k.log.contains("C7511"),
                "{class:?} {tile:?}: wgmmas serialised: {}",
                k.log
            );
        }
    }
}

/// The varlen builds (`FM_VARLEN`) of every class's dQ-kernel tiles: the dK/dV and dQ
/// kernels compile without spills and without serialised wgmmas, and the fused-dQ
/// workspace kernels are not in them (varlen runs the dQ kernel).
#[test]
fn every_sm90_varlen_backward_variant_compiles_without_spills() {
    use flashmoe::attention::backward::varlen::varlen_sm90_bwd_defines;
    nvrtc();
    let src = kernels::source(BWD_SM90_SOURCE).unwrap();
    let cache = KernelCache::offline(None);
    let arch = "sm_90a";
    let mut built = 0;
    for class in all_sm90_bwd_classes() {
        let tiles = Sm90BwdTile::lab_tiles(class.head_dim);
        for tile in tiles
            .into_iter()
            .filter(|t| !t.dq.fused() && !t.producer() && t.serves(&class))
        {
            let defs = varlen_sm90_bwd_defines(&class, &tile);
            let k = cache
                .compile(BWD_SM90_SOURCE, src, BWD_SM90_DKDV_ENTRY, &defs, arch)
                .unwrap_or_else(|e| panic!("varlen {class:?} {tile:?}: {e}"))
                .compiled;
            for f in &k.all_functions {
                eprintln!(
                    "sm90 varlen bwd D={} {:?} causal={} softcap={} {tile:?}: {f}",
                    class.head_dim, class.dtype, class.causal, class.softcap
                );
            }
            assert!(k.all_functions.iter().any(|f| f.name == BWD_SM90_DQ_ENTRY));
            for entry in [BWD_SM90_DQ_CONVERT_ENTRY, BWD_SM90_DQ_ZERO_ENTRY] {
                assert!(!k.all_functions.iter().any(|f| f.name == entry), "{entry}");
            }
            assert!(!k.spills(), "varlen {class:?} {tile:?} spills: {}", k.log);
            assert!(
                !k.log.contains("C7511"),
                "varlen {class:?} {tile:?}: wgmmas serialised: {}",
                k.log
            );
            built += 1;
        }
    }
    assert!(built >= 24, "{built} varlen variants");
}
