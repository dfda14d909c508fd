//! Every attention kernel variant compiles with NVRTC for sm_80 and sm_90a, on a machine
//! without a GPU, and the hot kernels do not spill registers.
//!
//! NVRTC comes from the `nvidia-cuda-nvrtc==13.0.88` wheel: run
//! `scripts/install-nvrtc.sh` once (installs into `<repo>/.nvrtc`), or set
//! `FLASHMOE_NVRTC_LIB` to a directory holding `libnvrtc.so.13`. Without NVRTC these
//! tests fail (they do not skip), saying so.
//!
//! Run with `--nocapture` to see the resource report of each variant.

use flashmoe::attention::prefill::abi::KernelVariant;
#[cfg(feature = "lab")]
use flashmoe::attention::prefill::select::all_reference_variants;
use flashmoe::attention::prefill::select::{
    all_sm90_variants, all_sm90_varlen_variants, all_v1_variants, sm90_lab_variants,
    v1_extra_head_dim_variants, v1_masked_compile_variants,
};
use flashmoe::gpu::kernels;
use flashmoe::gpu::{nvrtc_compile, CompiledKernel, ImageKind, KernelCache};
use flashmoe::Error;
mod common;
use common::{arch_limits, nvrtc, ARCHS};

#[test]
fn nvrtc_is_loaded_and_supports_the_target_archs() {
    let nv = nvrtc();
    eprintln!(
        "NVRTC {} from {} (archs {:?})",
        nv.version_string(),
        nv.location,
        nv.supported_archs
    );
    assert_eq!(
        nv.version.0, 13,
        "expected NVRTC 13.x to match the GPU machine's CUDA 13.0"
    );
    for a in [80, 90] {
        assert!(
            nv.supported_archs.contains(&a),
            "NVRTC cannot target sm_{a}"
        );
    }
}

fn check_cubin(k: &CompiledKernel) {
    assert_eq!(k.kind, ImageKind::Cubin);
    assert!(k.image.starts_with(b"\x7fELF"), "CUBIN is not an ELF image");
}

#[test]
fn builtin_kernel_compiles_for_every_arch() {
    nvrtc();
    for arch in ARCHS {
        let k = nvrtc_compile(kernels::SELFTEST_SOURCE, kernels::SELFTEST_ENTRY, &[], arch)
            .unwrap_or_else(|e| panic!("{e}"));
        check_cubin(&k);
        let r = k.resources.as_ref().expect("ptxas report");
        eprintln!("{}", k.summary());
        assert!(r.registers > 0 && r.registers <= 255);
        assert!(!k.spills());
        assert_eq!(r.shared_static, 0);
        assert!(k.log.contains(&format!("for '{arch}'")), "{}", k.log);
    }
    // PTX target (the fallback for devices newer than the NVRTC).
    let p = nvrtc_compile(
        kernels::SELFTEST_SOURCE,
        kernels::SELFTEST_ENTRY,
        &[],
        "compute_90",
    )
    .unwrap();
    assert_eq!(p.kind, ImageKind::Ptx);
    assert!(String::from_utf8_lossy(&p.image).contains(".entry flashmoe_selftest_axpy"));
}

#[test]
fn compile_errors_carry_the_full_log() {
    nvrtc();
    let src = "extern \"C\" __global__ void broken(float* o) { o[0] = undefined_name; }";
    match nvrtc_compile(src, "broken", &[], "sm_90a") {
        Err(Error::Compile { kernel, arch, log }) => {
            assert_eq!(kernel, "broken");
            assert_eq!(arch, "sm_90a");
            assert!(log.contains("undefined_name"), "{log}");
            assert!(
                log.contains("-arch=sm_90a"),
                "options are in the log: {log}"
            );
        }
        Err(e) => panic!("expected a compile error, got {e}"),
        Ok(_) => panic!("broken source compiled"),
    }
    // An entry name that is not in the module is caught without a GPU.
    match nvrtc_compile(kernels::SELFTEST_SOURCE, "no_such_entry", &[], "sm_80") {
        Err(Error::Compile { log, .. }) => assert!(log.contains("flashmoe_selftest_axpy")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn defines_reach_the_compiler() {
    nvrtc();
    let src = r#"
#ifndef FM_TILE
#error "FM_TILE is not defined"
#endif
extern "C" __global__ void k(float* o) { __shared__ float s[FM_TILE]; s[threadIdx.x] = 1.f; __syncthreads(); o[threadIdx.x] = s[FM_TILE - 1 - threadIdx.x]; }
"#;
    let err = nvrtc_compile(src, "k", &[], "sm_80")
        .unwrap_err()
        .to_string();
    assert!(err.contains("FM_TILE is not defined"), "{err}");
    let k = nvrtc_compile(src, "k", &[("FM_TILE".into(), "256".into())], "sm_80").unwrap();
    assert_eq!(k.shared_static(), Some(1024));
}

#[test]
fn spills_are_detected() {
    nvrtc();
    let src = r#"
extern "C" __global__ void __launch_bounds__(1024, 2) spill(float* o, const float* a) {
  float acc[96];
  #pragma unroll
  for (int j = 0; j < 96; ++j) acc[j] = a[threadIdx.x + j * 1024];
  #pragma unroll
  for (int r = 0; r < 8; ++r) {
    #pragma unroll
    for (int j = 0; j < 96; ++j) acc[j] = acc[j] * acc[(j + r + 1) % 96] + 1.0f;
  }
  float s = 0.f;
  #pragma unroll
  for (int j = 0; j < 96; ++j) s += acc[j] * (j + 1);
  o[threadIdx.x] = s;
}
"#;
    let k = nvrtc_compile(src, "spill", &[], "sm_80").unwrap();
    eprintln!("{}", k.summary());
    assert!(k.spills(), "expected spills: {}", k.log);
    assert!(k.spill_stores().unwrap() > 0 && k.spill_loads().unwrap() > 0);
}

#[test]
fn disk_cache_round_trip() {
    nvrtc();
    let dir = std::env::temp_dir().join(format!("flashmoe-kc-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::offline(Some(dir.clone()));
    let defs = vec![("FM_UNUSED".to_string(), "1".to_string())];
    let a = cache
        .compile(
            "selftest.cu",
            kernels::SELFTEST_SOURCE,
            kernels::SELFTEST_ENTRY,
            &defs,
            "sm_90a",
        )
        .unwrap();
    assert!(!a.from_disk);
    let path = a.path.clone().unwrap();
    assert!(path.exists());
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("selftest-sm_90a-") && name.ends_with(".cubin"),
        "{name}"
    );
    assert!(path.with_extension("log").exists());
    let b = cache
        .compile(
            "selftest.cu",
            kernels::SELFTEST_SOURCE,
            kernels::SELFTEST_ENTRY,
            &defs,
            "sm_90a",
        )
        .unwrap();
    assert!(b.from_disk);
    assert_eq!(a.key, b.key);
    assert_eq!(a.compiled.image, b.compiled.image);
    assert_eq!(a.compiled.resources, b.compiled.resources);
    // Another arch or define is another entry.
    let c = cache
        .compile(
            "selftest.cu",
            kernels::SELFTEST_SOURCE,
            kernels::SELFTEST_ENTRY,
            &defs,
            "sm_80",
        )
        .unwrap();
    assert!(!c.from_disk);
    assert_ne!(a.key, c.key);
    // A truncated log (e.g. disk full mid-way before atomic writes) is not trusted:
    // the entry is missing from it, so the kernel is recompiled.
    std::fs::write(path.with_extension("log"), "").unwrap();
    let d = cache
        .compile(
            "selftest.cu",
            kernels::SELFTEST_SOURCE,
            kernels::SELFTEST_ENTRY,
            &defs,
            "sm_90a",
        )
        .unwrap();
    assert!(!d.from_disk);
    let _ = std::fs::remove_dir_all(&dir);
}

struct Row {
    kind: &'static str,
    variant: KernelVariant,
    arch: &'static str,
    outcome: std::result::Result<CompiledKernel, String>,
}

fn compile_variants(kind: &'static str, variants: Vec<KernelVariant>) -> Vec<Row> {
    let mut rows = Vec::new();
    for v in variants {
        for arch in ARCHS {
            let arch_num: u32 = arch
                .trim_start_matches("sm_")
                .trim_end_matches('a')
                .parse()
                .unwrap();
            if arch_num < v.min_arch {
                continue;
            }
            let outcome = kernels::source(v.source_file)
                .map_err(|e| e.to_string())
                .and_then(|src| {
                    nvrtc_compile(src, v.entry, &v.defines, arch).map_err(|e| e.to_string())
                });
            rows.push(Row {
                kind,
                variant: v.clone(),
                arch,
                outcome,
            });
        }
    }
    rows
}

fn describe(v: &KernelVariant) -> String {
    let defs: Vec<String> = v.defines.iter().map(|(k, x)| format!("{k}={x}")).collect();
    format!(
        "{}:{} [{}] block_m={} threads={} dyn_smem={}",
        v.source_file,
        v.entry,
        defs.join(" "),
        v.block_m,
        v.block_threads,
        v.shared_mem_bytes
    )
}

/// The one sm_90a variant allowed to spill: D=64 fp16 dense with a window and a softcap (3
/// consumer warpgroups at 160 registers; fp16 keeps the softcap's online max, which bf16
/// drops: docs/design/attention-varlen-window.md, "Softcap"). ptxas keeps a few words in local memory, about 6
/// local accesses per key tile (L1 hits). Anything more fails.
fn known_spill(v: &KernelVariant, r: &flashmoe::gpu::KernelResources) -> bool {
    v.define("FM_HEAD_DIM") == Some("64")
        && v.define("FM_DTYPE_BF16") == Some("0")
        && v.define("FM_WINDOW") == Some("1")
        && v.define("FM_SOFTCAP") == Some("1")
        && v.define("FM_VARLEN").is_none()
        && r.spill_stores <= 64
        && r.spill_loads <= 64
        && r.stack_frame <= 64
}

#[test]
fn every_attention_variant_compiles_without_spills() {
    nvrtc();
    let v1 = all_v1_variants();
    if v1.is_empty() {
        eprintln!("note: select::all_v1_variants() is empty: no v1 kernel variants defined yet");
    }
    let mut rows = compile_variants("v1", v1);
    // The portable kernel's ALiBi / window / softcap variants (the ALiBi route).
    rows.extend(compile_variants("v1", v1_masked_compile_variants()));
    // Head dims between the tile table's (every multiple of 8 up to 256 is served).
    rows.extend(compile_variants("v1", v1_extra_head_dim_variants()));
    // The sm_90a kernel has min_arch 90: compiled for sm_90a only.
    rows.extend(compile_variants("sm90", all_sm90_variants()));
    rows.extend(compile_variants("sm90-vl", all_sm90_varlen_variants()));
    // D = 96 (two panels, the second half zero fill): the lab's tile, dense ("sm90": the hot
    // kernel's checks) and varlen.
    let (lab_vl, lab): (Vec<_>, Vec<_>) = sm90_lab_variants()
        .into_iter()
        .partition(|v| v.define("FM_VARLEN").is_some());
    rows.extend(compile_variants("sm90", lab));
    rows.extend(compile_variants("sm90-vl", lab_vl));
    // The lab's fp32 reference (embedded with the lab feature only).
    #[cfg(feature = "lab")]
    rows.extend(compile_variants("reference", all_reference_variants()));

    let mut failures = Vec::new();
    eprintln!("\n{:-<100}", "");
    eprintln!("kind       arch    regs spill(st/ld)  stack  smem(static+dyn)  variant");
    for row in &rows {
        let what = format!("{} {} {}", row.kind, row.arch, describe(&row.variant));
        match &row.outcome {
            Err(e) => {
                eprintln!(
                    "{:<10} {:<7} COMPILE FAILED  {}",
                    row.kind,
                    row.arch,
                    describe(&row.variant)
                );
                failures.push(format!("{what}: {e}"));
            }
            Ok(k) => {
                let r = k.resources.clone().unwrap_or_default();
                let smem = r.shared_static + row.variant.shared_mem_bytes as u64;
                eprintln!(
                    "{:<10} {:<7} {:>4} {:>6}/{:<6} {:>6} {:>8}+{:<8} {}",
                    row.kind,
                    row.arch,
                    r.registers,
                    r.spill_stores,
                    r.spill_loads,
                    r.stack_frame,
                    r.shared_static,
                    row.variant.shared_mem_bytes,
                    describe(&row.variant)
                );
                let (smem_limit, regs_per_sm) = arch_limits(row.arch);
                if k.spills() {
                    let msg = format!(
                        "{what}: spills ({} B stores, {} B loads; any function: {})",
                        r.spill_stores,
                        r.spill_loads,
                        k.all_functions
                            .iter()
                            .filter(|f| f.spills())
                            .map(|f| f.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    if row.kind == "v1"
                        || (row.kind.starts_with("sm90") && !known_spill(&row.variant, &r))
                    {
                        failures.push(msg);
                    } else {
                        eprintln!("  warning (reference kernel, not hot): {msg}");
                    }
                }
                if row.kind == "sm90" {
                    // Hot Hopper kernel: no stack frame either, and setmaxnreg must take
                    // effect (ptxas warns C7508 when it cannot).
                    if r.stack_frame != 0 && !known_spill(&row.variant, &r) {
                        failures.push(format!("{what}: {} B stack frame", r.stack_frame));
                    }
                    if k.log.contains("C7508") || k.log.contains("setmaxnreg") {
                        failures.push(format!("{what}: setmaxnreg ignored:\n{}", k.log));
                    }
                    // C7515: ptxas could not prove the wgmma pipeline safe and serialised
                    // every wgmma of the kernel (a wait after each one): correct, but slow.
                    if k.log.contains("C7515") {
                        failures.push(format!("{what}: wgmma serialised by ptxas:\n{}", k.log));
                    }
                    if r.registers as u64 * row.variant.block_threads as u64 > regs_per_sm {
                        failures.push(format!("{what}: register cap at entry too high"));
                    }
                    // The kernel's setmaxnreg split (static_assert against LAUNCH_REGS)
                    // assumes the launch allocates the full cap per thread: with fewer,
                    // setmaxnreg.inc would wait forever for registers the pool lacks.
                    let cap = (65536 / row.variant.block_threads as u64) / 8 * 8;
                    if r.registers as u64 != cap {
                        failures.push(format!(
                            "{what}: {} registers at entry, the setmaxnreg split assumes {cap}",
                            r.registers
                        ));
                    }
                }
                if smem > smem_limit {
                    failures.push(format!(
                        "{what}: needs {smem} B shared memory per block, {} allows {smem_limit}",
                        row.arch
                    ));
                }
                if r.registers as u64 * row.variant.block_threads as u64 > regs_per_sm {
                    failures.push(format!(
                        "{what}: {} registers × {} threads exceeds {regs_per_sm} registers per SM \
                         (the launch would fail)",
                        r.registers, row.variant.block_threads
                    ));
                }
            }
        }
    }
    eprintln!("{:-<100}\n{} compilations", "", rows.len());
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
