// Embeds every CUDA source under `kernels/` and its family folders (*.cu, *.cuh) into the
// library, so the binary carries its kernels and NVRTC compiles them at run time. The
// table is generated from whatever files exist, so adding a kernel needs no Rust change.
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("kernels");
    println!("cargo:rerun-if-changed=build.rs");
    if dir.is_dir() {
        println!("cargo:rerun-if-changed={}", dir.display());
    } else {
        // A missing path would make cargo rerun this script (and rebuild the crate) on
        // every build; watch the crate directory instead, so creating kernels/ is seen.
        println!("cargo:rerun-if-changed={manifest}");
    }

    // One folder per kernel family (kernels/<family>/..., kernels/common/ for the shared
    // headers); sources are known by their file name alone, so names are unique.
    // kernels/reference/ holds the lab's fp32 references: embedded with the `lab` feature only.
    let lab = std::env::var_os("CARGO_FEATURE_LAB").is_some();
    let mut files: Vec<(String, String)> = Vec::new();
    collect(&dir, lab, &mut files);
    files.sort();
    for w in files.windows(2) {
        if w[0].0 == w[1].0 {
            panic!(
                "two kernel sources named {} ({} and {}): names under kernels/ must be unique",
                w[0].0, w[0].1, w[1].1
            );
        }
    }

    let mut out = String::new();
    out.push_str("/// (file name, contents) of every embedded kernel source, sorted by name.\n");
    out.push_str("pub(crate) static EMBEDDED: &[(&str, &str)] = &[\n");
    for (name, path) in &files {
        writeln!(out, "    ({name:?}, include_str!({path:?})),").unwrap();
    }
    out.push_str("];\n");
    let out_dir = std::env::var("OUT_DIR").expect("OUT_DIR");
    std::fs::write(Path::new(&out_dir).join("kernel_sources.rs"), out)
        .expect("write kernel_sources.rs");
}

/// Every `.cu` / `.cuh` file under `dir`, recursively, as (file name, path) — `reference/`
/// only when `lab`; each folder is watched so that an added or removed file reruns this
/// script.
fn collect(dir: &Path, lab: bool, files: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            if !lab && path.file_name().is_some_and(|n| n == "reference") {
                continue;
            }
            println!("cargo:rerun-if-changed={}", path.display());
            collect(&path, lab, files);
            continue;
        }
        let name = match path.file_name().and_then(|n| n.to_str()) {
            Some(n) => n.to_string(),
            None => continue,
        };
        if !(name.ends_with(".cu") || name.ends_with(".cuh")) || !path.is_file() {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        files.push((name, path.display().to_string()));
    }
}
