//! Every MoE-backward kernel (`kernels/moe/backward/moe_backward.cu`: the grouped GEMMs over rows and
//! over an expert's rows, the SwiGLU / routing-weight epilogue, the router and the
//! un-permute) compiles with NVRTC for sm_80 and sm_90a in bf16 and fp16 on a machine
//! without a GPU, with every entry present and no register spills. NVRTC as for
//! `kernels_compile.rs` (scripts/install-nvrtc.sh or FLASHMOE_NVRTC_LIB).

use flashmoe::dtype::DType;
use flashmoe::gpu::{kernels, nvrtc_compile};
use flashmoe::moe::backward::{bwd_defines, BWD_ENTRIES, BWD_SOURCE};
mod common;
use common::{arch_limits, ARCHS};

#[test]
fn every_moe_backward_kernel_compiles_without_spills() {
    common::nvrtc();
    let src = kernels::source(BWD_SOURCE).unwrap();
    for dtype in [DType::Bf16, DType::F16] {
        let defs = bwd_defines(dtype).unwrap();
        for arch in ARCHS {
            let k = nvrtc_compile(src, BWD_ENTRIES[0], &defs, arch)
                .unwrap_or_else(|e| panic!("{dtype:?} {arch}: {e}"));
            for entry in BWD_ENTRIES {
                let f = k
                    .all_functions
                    .iter()
                    .find(|f| f.name == entry)
                    .unwrap_or_else(|| panic!("{dtype:?} {arch}: no {entry}\n{}", k.log));
                eprintln!("{dtype:?} {arch} {entry}: {f}");
                assert!(
                    f.shared_static <= arch_limits(arch).0,
                    "{entry}: shared memory"
                );
            }
            assert!(!k.spills(), "{dtype:?} {arch} spills: {}", k.log);
        }
    }
}
