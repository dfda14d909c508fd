//! Every MoE kernel variant (`moe::forward::select::all_variants`) compiles with NVRTC for sm_80
//! and sm_90a on a machine without a GPU, with no register spills, within the shared
//! memory and register limits.
//!
//! NVRTC: run `scripts/install-nvrtc.sh` once (installs into `<repo>/.nvrtc`), or set
//! `FLASHMOE_NVRTC_LIB` to a directory holding `libnvrtc.so.13`. Without NVRTC these
//! tests fail (they do not skip), saying so. `--nocapture` prints the resource report.

use flashmoe::gpu::kernels;
use flashmoe::gpu::nvrtc_compile;
use flashmoe::moe::forward::select::{all_variants, MoeKernel};
mod common;
use common::{arch_limits, ARCHS};

fn describe(v: &MoeKernel) -> String {
    let defs: Vec<String> = v.defines.iter().map(|(k, x)| format!("{k}={x}")).collect();
    format!(
        "{}:{} [{}] block_m={} block_n={} threads={} dyn_smem={}",
        v.source_file,
        v.entry,
        defs.join(" "),
        v.block_m,
        v.block_n,
        v.block_threads,
        v.shared_mem_bytes
    )
}

#[test]
fn every_moe_variant_compiles_without_spills() {
    common::nvrtc();
    let variants = all_variants();
    // The router / permute / combine kernels are always present; the grouped GEMMs come
    // from moe::gemm::tiles (empty in the stub of branch moe-path).
    for entry in [
        "moe_router_logits",
        "moe_router_logits_small",
        "moe_router_topk",
        "moe_expert_stats",
        "moe_router_losses",
        "moe_permute",
        "moe_combine",
        "moe_gather_rows",
        "moe_gemm13_sm90",
        "moe_gemm2_sm90",
    ] {
        assert!(
            variants.iter().any(|v| v.entry == entry),
            "no variant of {entry} in all_variants()"
        );
    }
    if !variants.iter().any(|v| v.entry == "moe_gemm13") {
        eprintln!("note: no grouped-GEMM variants (moe::gemm::tiles stub)");
    }
    let mut failures = Vec::new();
    let mut n = 0;
    eprintln!("arch    regs spill(st/ld) stack smem(static+dyn) variant");
    for v in &variants {
        for arch in ARCHS {
            let arch_num: u32 = arch
                .trim_start_matches("sm_")
                .trim_end_matches('a')
                .parse()
                .unwrap();
            if arch_num < v.min_arch {
                continue;
            }
            n += 1;
            let what = format!("{arch} {}", describe(v));
            let compiled = kernels::source(v.source_file)
                .map_err(|e| e.to_string())
                .and_then(|src| {
                    nvrtc_compile(src, v.entry, &v.defines, arch).map_err(|e| e.to_string())
                });
            let k = match compiled {
                Ok(k) => k,
                Err(e) => {
                    eprintln!("{arch:<7} COMPILE FAILED {}", describe(v));
                    failures.push(format!("{what}: {e}"));
                    continue;
                }
            };
            let r = k.resources.clone().unwrap_or_default();
            let smem = r.shared_static + v.shared_mem_bytes as u64;
            eprintln!(
                "{arch:<7} {:>4} {:>6}/{:<6} {:>5} {:>8}+{:<8} {}",
                r.registers,
                r.spill_stores,
                r.spill_loads,
                r.stack_frame,
                r.shared_static,
                v.shared_mem_bytes,
                describe(v)
            );
            let (smem_limit, regs_per_sm) = arch_limits(arch);
            if k.log.contains("C7508") {
                failures.push(format!("{what}: setmaxnreg ignored (C7508)"));
            }
            if k.log.contains("C7515") {
                failures.push(format!("{what}: wgmma serialised by ptxas (C7515)"));
            }
            if k.spills() {
                failures.push(format!(
                    "{what}: spills ({} B stores, {} B loads)",
                    r.spill_stores, r.spill_loads
                ));
            }
            if smem > smem_limit {
                failures.push(format!(
                    "{what}: needs {smem} B shared memory, {arch} allows {smem_limit}"
                ));
            }
            if r.registers as u64 * v.block_threads as u64 > regs_per_sm {
                failures.push(format!(
                    "{what}: {} registers × {} threads exceeds {regs_per_sm}",
                    r.registers, v.block_threads
                ));
            }
        }
    }
    eprintln!("{n} compilations");
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The GPU fp32 reference kernels (`moe_reference.cu`) compile for both dtypes and
/// architectures without spills (a spilling reference would be slow, not wrong).
#[test]
fn moe_reference_kernels_compile() {
    use flashmoe::moe::reference as r;
    use flashmoe::DType;
    common::nvrtc();
    let src = kernels::source(r::REFERENCE_SOURCE).expect("moe_reference.cu is embedded");
    let mut failures = Vec::new();
    for dtype in [DType::F16, DType::Bf16] {
        let defines = r::reference_defines(dtype).unwrap();
        for entry in [
            r::REF_LOGITS_ENTRY,
            r::REF_GEMM13_ENTRY,
            r::REF_GEMM2_ENTRY,
            r::REF_COMBINE_ENTRY,
        ] {
            for arch in ARCHS {
                match nvrtc_compile(src, entry, &defines, arch) {
                    Ok(k) => {
                        let res = k.resources.clone().unwrap_or_default();
                        eprintln!("{arch} {dtype} {entry}: {} regs", res.registers);
                        if k.spills() {
                            failures.push(format!("{arch} {dtype} {entry}: spills"));
                        }
                        if res.registers as u64 * r::REF_THREADS as u64 > arch_limits(arch).1 {
                            failures.push(format!("{arch} {dtype} {entry}: too many registers"));
                        }
                    }
                    Err(e) => failures.push(format!("{arch} {dtype} {entry}: {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
