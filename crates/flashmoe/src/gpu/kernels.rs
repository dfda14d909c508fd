//! CUDA C++ sources embedded in the binary (every `*.cu` and `*.cuh` under
//! `crates/flashmoe/kernels/` and its family folders, gathered by `build.rs` and known by
//! file name; `kernels/reference/`, the lab's fp32 references, only with the `lab` feature).
//!
//! Kernels are compiled at run time by NVRTC, which has no default include path: a
//! kernel may `#include "name.cuh"` for any header embedded here (they are handed to
//! NVRTC as in-memory headers), but not CUDA toolkit headers.

use crate::error::{Error, Result};

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// A tiny self-contained kernel used to prove the NVRTC → module → launch path works
/// (`y[i] = a * x[i] + y[i]`), independent of the real kernels.
pub const SELFTEST_SOURCE: &str = r#"
extern "C" __global__ void flashmoe_selftest_axpy(float* __restrict__ y,
                                                  const float* __restrict__ x,
                                                  float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = a * x[i] + y[i];
    }
}
"#;
/// Entry point of [`SELFTEST_SOURCE`].
pub const SELFTEST_ENTRY: &str = "flashmoe_selftest_axpy";

/// The embedded source `name` (e.g. "flash_attn_fwd.cu").
pub fn source(name: &str) -> Result<&'static str> {
    EMBEDDED
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
        .ok_or_else(|| {
            let known: Vec<&str> = EMBEDDED.iter().map(|(n, _)| *n).collect();
            Error::unsupported(
                "kernels",
                format!(
                    "kernel source '{name}' is not embedded in this build (known: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            )
        })
}

/// Names of all embedded sources (`.cu` and `.cuh`).
pub fn names() -> Vec<&'static str> {
    EMBEDDED.iter().map(|(n, _)| *n).collect()
}

/// Embedded headers (`.cuh`), passed to NVRTC so kernels can `#include` them.
pub fn headers() -> Vec<(&'static str, &'static str)> {
    EMBEDDED
        .iter()
        .filter(|(n, _)| n.ends_with(".cuh"))
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_source_is_a_clear_error() {
        let err = source("no_such_kernel.cu").unwrap_err().to_string();
        assert!(err.contains("no_such_kernel.cu"), "{err}");
    }

    #[test]
    fn table_is_sorted_and_headers_are_cuh() {
        let n = names();
        let mut sorted = n.clone();
        sorted.sort();
        assert_eq!(n, sorted);
        for (name, _) in headers() {
            assert!(name.ends_with(".cuh"));
        }
        for name in n {
            assert!(source(name).is_ok(), "{name}");
        }
    }

    #[test]
    fn every_include_is_an_embedded_header() {
        // NVRTC sees only the embedded headers: an #include of anything else (a header
        // added to a kernel but not under kernels/, a typo) would fail at run time only.
        let hdrs: Vec<&str> = headers().iter().map(|(n, _)| *n).collect();
        for (name, text) in EMBEDDED {
            for line in text.lines() {
                if let Some(rest) = line.trim_start().strip_prefix("#include") {
                    // `#include "name"  // comment`: the name between the quotes.
                    let inc = rest.split('"').nth(1).unwrap_or(rest.trim());
                    assert!(hdrs.contains(&inc), "{name} includes {inc}, not embedded");
                }
            }
        }
        // The sm_90a attention kernel's role headers are among them.
        for h in [
            "fm90_config.cuh",
            "fm90_scheduler.cuh",
            "fm90_producer.cuh",
            "fm90_mainloop.cuh",
        ] {
            assert!(hdrs.contains(&h), "{h}");
        }
    }
}
