//! Every paged-decode kernel build ([`all_decode_kernels`]) compiles with NVRTC for sm_80 and
//! sm_90a on a machine without a GPU, with no spills, no stack frame, and a register and
//! shared-memory footprint that can launch. Run with `--nocapture` for the ptxas report.

use flashmoe::attention::decode::{
    all_decode_kernels, APPEND_ENTRY, DECODE_ENTRY, DECODE_SOURCE, THREADS,
};
use flashmoe::gpu::{kernels, nvrtc_compile};
mod common;
use common::{arch_limits, nvrtc, ARCHS};

#[test]
fn every_decode_kernel_compiles_without_spills() {
    nvrtc();
    let src = kernels::source(DECODE_SOURCE).unwrap();
    // One NVRTC compile per (build, arch) holds both entries; builds compile in
    // parallel (each compile is single-threaded).
    let jobs: Vec<_> = all_decode_kernels()
        .into_iter()
        .flat_map(|k| ARCHS.map(|arch| (k.clone(), arch)))
        .collect();
    let results: Vec<_> = std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(k, arch)| sc.spawn(move || nvrtc_compile(src, DECODE_ENTRY, &k.defines(), arch)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut failures = Vec::new();
    eprintln!("arch    entry             regs spill  stack  smem(static+dyn)  defines");
    for ((k, arch), res) in jobs.iter().zip(results) {
        let tag: Vec<String> = k
            .defines()
            .iter()
            .map(|(a, b)| format!("{a}={b}"))
            .collect();
        let c = match res {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{arch} [{}]: {e}", tag.join(" ")));
                continue;
            }
        };
        let (smem_limit, regs_per_sm) = arch_limits(arch);
        for (entry, threads, dyn_smem) in [
            (DECODE_ENTRY, THREADS, k.shared_mem_bytes()),
            (APPEND_ENTRY, 128, 0),
        ] {
            let what = format!("{entry} {arch} [{}]", tag.join(" "));
            let Some(r) = c.all_functions.iter().find(|f| f.name == entry) else {
                failures.push(format!("{what}: not in the ptxas report"));
                continue;
            };
            eprintln!(
                "{arch:<7} {entry:<17} {:>4} {:>2}/{:<2} {:>5} {:>7}+{:<7} {}",
                r.registers,
                r.spill_stores,
                r.spill_loads,
                r.stack_frame,
                r.shared_static,
                dyn_smem,
                tag.join(" ")
            );
            if r.spills() || r.stack_frame != 0 {
                failures.push(format!(
                    "{what}: spills {}/{} B, stack frame {} B",
                    r.spill_stores, r.spill_loads, r.stack_frame
                ));
            }
            if r.shared_static + dyn_smem as u64 > smem_limit {
                failures.push(format!("{what}: shared memory above {smem_limit} B"));
            }
            if r.registers as u64 * threads as u64 > regs_per_sm {
                failures.push(format!("{what}: {} registers cannot launch", r.registers));
            }
        }
    }
    assert_eq!(jobs.len(), 40 * ARCHS.len()); // 20 builds, each with and without ALiBi
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
