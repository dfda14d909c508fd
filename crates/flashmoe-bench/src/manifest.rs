//! The environment manifest: where and with what a run was made.

use serde::{Deserialize, Serialize};
use std::process::Command;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub flashmoe_version: String,
    pub timestamp_utc: String,
    pub hostname: String,
    pub os: String,
    pub cpu_model: String,
    pub cpu_cores: usize,
    pub rustc: String,
    pub git_commit: String,
    pub git_dirty: bool,
    /// The commit the binary was built from ("-dirty" when its tracked files had
    /// changes): differs from `git_commit` when a binary runs in another checkout.
    #[serde(default)]
    pub build_commit: String,
    pub command_line: String,
    /// Environment variables that change which kernel or tile runs
    /// ([`KERNEL_OVERRIDE_VARS`]), as NAME=value; empty for the default choice.
    #[serde(default)]
    pub kernel_overrides: Vec<String>,
    #[serde(default)]
    pub gpu: Option<GpuManifest>,
    #[serde(default)]
    pub python: Option<PythonManifest>,
    /// `nvidia-smi topo -m` of a multi-GPU run (`bench moe --gpus N`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
}

/// GPU fields, filled by the GPU runner.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuManifest {
    pub name: String,
    pub compute_capability: String,
    pub sm_count: u32,
    pub memory_bytes: u64,
    pub l2_bytes: u64,
    pub max_sm_clock_mhz: u32,
    pub max_mem_clock_mhz: u32,
    pub driver_version: String,
    pub nvrtc_version: String,
    /// Clock/throttle observations made during the run (e.g. from nvidia-smi).
    #[serde(default)]
    pub clock_observations: Vec<String>,
}

/// Python baseline worker fields (versions of torch, cuDNN, Triton...).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PythonManifest {
    pub python: String,
    pub torch: String,
    pub cuda: String,
    pub cudnn: String,
    pub triton: String,
    pub gpu_name: String,
    /// Third-party baseline packages found, as "distribution version" (e.g. "flash-attn-4 4.0.0b36").
    #[serde(default)]
    pub packages: Vec<String>,
    /// Baselines left out of the run because their package is not importable, as "name: reason".
    #[serde(default)]
    pub skipped: Vec<String>,
}

fn run(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn os_name() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("PRETTY_NAME=")).map(|l| {
                l.trim_start_matches("PRETTY_NAME=")
                    .trim_matches('"')
                    .to_string()
            })
        });
    let kernel = run("uname", &["-r"]).unwrap_or_default();
    match pretty {
        Some(p) => format!("{p} (kernel {kernel})"),
        None => format!("{} (kernel {kernel})", std::env::consts::OS),
    }
}

/// The variables a result must name because they change the kernels measured.
pub const KERNEL_OVERRIDE_VARS: [&str; 3] = [
    flashmoe::attention::runner::SM90_TILE_ENV,
    flashmoe::attention::runner::BWD_KERNEL_ENV,
    flashmoe::moe::runner::GEMM_PATH_ENV,
];

impl Manifest {
    /// Collect the host part of the manifest now.
    pub fn collect() -> Manifest {
        // The checkout we run in, else the commit the binary was built from.
        let build = env!("FLASHMOE_BUILD_COMMIT");
        let (git_commit, git_dirty) = match run("git", &["rev-parse", "HEAD"]) {
            Some(c) => {
                let dirty = run("git", &["status", "--porcelain", "--untracked-files=no"])
                    .is_some_and(|s| !s.is_empty());
                (c, dirty)
            }
            None => (
                format!(
                    "{} (built from; no git checkout here)",
                    build.trim_end_matches("-dirty")
                ),
                build.ends_with("-dirty"),
            ),
        };
        Manifest {
            flashmoe_version: env!("CARGO_PKG_VERSION").to_string(),
            timestamp_utc: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            hostname: run("hostname", &[])
                .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|| "unknown".into()),
            os: os_name(),
            cpu_model: cpu_model(),
            cpu_cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            rustc: env!("FLASHMOE_RUSTC_VERSION").to_string(),
            git_commit,
            git_dirty,
            build_commit: build.to_string(),
            command_line: std::env::args().collect::<Vec<_>>().join(" "),
            kernel_overrides: KERNEL_OVERRIDE_VARS
                .iter()
                .filter_map(|v| std::env::var(v).ok().map(|x| format!("{v}={x}")))
                .collect(),
            gpu: None,
            python: None,
            topology: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_host_fields() {
        let m = Manifest::collect();
        assert!(m.cpu_cores >= 1);
        assert!(m.rustc.starts_with("rustc"), "{}", m.rustc);
        assert!(m.timestamp_utc.ends_with('Z'));
        assert!(!m.os.is_empty());
        // built inside this checkout: a 40-hex-digit commit (maybe "-dirty")
        let hex = m.build_commit.trim_end_matches("-dirty");
        assert!(
            hex == "unknown" || (hex.len() == 40 && hex.chars().all(|c| c.is_ascii_hexdigit())),
            "{}",
            m.build_commit
        );
    }

    #[test]
    fn older_manifests_without_build_commit_still_load() {
        let mut v = serde_json::to_value(Manifest::collect()).unwrap();
        v.as_object_mut().unwrap().remove("build_commit");
        let m: Manifest = serde_json::from_value(v).unwrap();
        assert!(m.build_commit.is_empty());
    }
}
