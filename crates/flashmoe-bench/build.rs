// Records the rustc version for the environment manifest.
fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FLASHMOE_RUSTC_VERSION={version}");
    // The commit the binary was built from: the manifest's fallback where the binary runs
    // outside a git checkout (e.g. copied to a GPU machine).
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!(
        "cargo:rustc-env=FLASHMOE_BUILD_COMMIT={commit}{}",
        if dirty { "-dirty" } else { "" }
    );
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={head}");
    }
    if let Some(index) = git(&["rev-parse", "--git-path", "index"]) {
        println!("cargo:rerun-if-changed={index}");
    }
    // Edits to tracked sources change "dirty" without touching HEAD or the index: rerun
    // on them too, or a binary built from an edited tree would claim the clean commit.
    for dir in [
        "src",
        "../flashmoe/src",
        "../flashmoe/kernels",
        "../flashmoe-cli/src",
    ] {
        println!("cargo:rerun-if-changed={dir}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
