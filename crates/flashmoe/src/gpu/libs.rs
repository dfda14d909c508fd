//! Finding the CUDA shared libraries at run time.
//!
//! The crate builds without a CUDA toolkit (cudarc's dynamic loading, through its
//! `fallback-dynamic-loading` feature, so that a binary that also links candle, whose cudarc
//! is built with `dynamic-linking`, still builds): libcuda, libnvrtc and libcublas are
//! opened when first needed. cudarc opens them by bare name through
//! the dynamic loader and panics when none is found, so every path here checks presence
//! first and turns absence into an [`Error`] that says what is missing and how to fix it.
//!
//! A library that is not on the loader's search path can still be used: opening it once
//! by full path makes a later `dlopen("libfoo.so.13")` by bare name resolve to the
//! already-loaded object (glibc matches the request against loaded objects' sonames).
//! That is how `FLASHMOE_NVRTC_LIB` and `/usr/local/cuda/lib64` work without setting
//! `LD_LIBRARY_PATH` before the process starts.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Directories where a CUDA toolkit commonly lives, most specific first.
pub(crate) fn toolkit_lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(v) = std::env::var_os(var) {
            let base = PathBuf::from(v);
            dirs.push(base.join("lib64"));
            dirs.push(base.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    // Versioned installs, newest first.
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .map(|p| p.join("lib64"))
            .collect();
        versioned.sort();
        versioned.reverse();
        dirs.extend(versioned);
    }
    dirs.push(PathBuf::from("/usr/lib/x86_64-linux-gnu"));
    dirs.push(PathBuf::from("/usr/lib64"));
    dirs.retain(|d| d.is_dir());
    dirs
}

/// Files in `dir` whose name starts with `prefix` followed by `.so` (e.g. prefix
/// "libnvrtc" matches "libnvrtc.so.13" but not "libnvrtc-builtins.so.13.0" nor the
/// ".alt" variants), best first: the exact `preferred` name, then the longest version.
pub(crate) fn find_versioned(dir: &Path, prefix: &str, preferred: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.strip_prefix(prefix)
                        .is_some_and(|rest| rest.starts_with(".so"))
                })
            })
            .collect(),
        Err(_) => return Vec::new(),
    };
    found.sort_by_key(|p| {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        (name != preferred, std::cmp::Reverse(name.len()), name)
    });
    found
}

/// Libraries opened by full path are kept open for the life of the process.
static PINNED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Open `path` and keep it loaded, so later bare-name opens of its soname find it.
pub(crate) fn pin(path: &Path) -> std::result::Result<(), String> {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    PINNED.lock().unwrap_or_else(|e| e.into_inner()).push(lib);
    Ok(())
}

/// Whether the CUDA driver library (libcuda) can be opened. Cached.
pub(crate) fn driver_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the candidate names.
    *PRESENT.get_or_init(|| opens(&["libcuda.so.1", "libcuda.so"]))
}

/// Make sure cudarc can open libcublas: it is often in the toolkit directory, which is
/// not on the loader path. Idempotent.
pub fn ensure_cublas() -> Result<()> {
    static RESULT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the candidate names.
            if opens(&["libcublas.so.13", "libcublas.so"]) {
                return Ok(());
            }
            let dirs = toolkit_lib_dirs();
            for dir in &dirs {
                let lt = find_versioned(dir, "libcublasLt", "libcublasLt.so.13");
                let blas = find_versioned(dir, "libcublas", "libcublas.so.13");
                if let Some(b) = blas.first() {
                    if let Some(l) = lt.first() {
                        let _ = pin(l);
                    }
                    if pin(b).is_ok() && opens(&["libcublas.so.13", "libcublas.so"]) {
                        return Ok(());
                    }
                }
            }
            Err(format!(
                "libcublas not found on the library search path nor in {}; install the \
                 CUDA toolkit's cuBLAS or add its directory to LD_LIBRARY_PATH",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
        .clone()
        .map_err(|m| Error::cuda("cuBLAS", m))
}

/// Whether one of `names` opens through the dynamic loader (works whether cudarc loads
/// the libraries itself or the executable was linked against them).
fn opens(names: &[&str]) -> bool {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
    names
        .iter()
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok())
}
