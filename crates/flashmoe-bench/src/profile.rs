//! Nsight Compute profiles (`flashmoe profile`): finding `ncu`, the command line for one
//! (config, implementation), reading its raw CSV page into per-kernel records, the
//! summary row per (config, implementation), and the report section.
//!
//! The profiled process marks exactly one call of the implementation with
//! cudaProfilerStart/Stop (ncu runs with `--profile-from-start off`), after warm-ups
//! outside the range, so every kernel ncu records belongs to that call.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Version of the `profile.json` layout.
pub const PROFILE_SCHEMA_VERSION: u32 = 1;

/// Sections collected (their metrics appear on the raw page), plus explicit metrics.
pub const NCU_SECTIONS: &[&str] = &[
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "LaunchStats",
    "Occupancy",
];
pub const NCU_METRICS: &[&str] = &["gpu__time_duration.sum", "dram__bytes.sum.per_second"];

/// Where `ncu` is: `explicit` (the --ncu flag), then `$FLASHMOE_NCU`, then `ncu` on PATH,
/// then `/usr/local/cuda/bin/ncu`.
pub fn locate_ncu(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!(
                "ncu not found at '{}' (--ncu): install Nsight Compute or pass the path of its ncu",
                p.display()
            ))
        };
    }
    if let Some(p) = std::env::var_os("FLASHMOE_NCU").map(PathBuf::from) {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "ncu not found at '{}' ($FLASHMOE_NCU): install Nsight Compute or fix the variable",
                p.display()
            ))
        };
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("ncu"))
                .find(|p| p.is_file())
        })
        .unwrap_or(None);
    on_path
        .or_else(|| Some(PathBuf::from("/usr/local/cuda/bin/ncu")).filter(|p| p.is_file()))
        .ok_or_else(|| {
            "ncu (Nsight Compute) not found: looked for --ncu, $FLASHMOE_NCU, ncu on PATH and \
             /usr/local/cuda/bin/ncu; install Nsight Compute (it comes with the CUDA toolkit) or pass --ncu PATH"
                .to_string()
        })
}

/// ncu's arguments to profile `target` (program and its arguments) into `report`
/// (ncu adds `.ncu-rep`). Clocks are left as the GPU runs them (`--clock-control none`),
/// as in `flashmoe bench`.
pub fn ncu_args(report: &Path, target: &[String]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "--target-processes",
        "all",
        "--force-overwrite",
        "--export",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(report.display().to_string());
    for s in NCU_SECTIONS {
        a.push("--section".into());
        a.push((*s).into());
    }
    a.push("--metrics".into());
    a.push(NCU_METRICS.join(","));
    a.extend(target.iter().cloned());
    a
}

/// Arguments that print a saved report's raw page as CSV in base units.
pub fn ncu_import_args(report: &Path) -> Vec<String> {
    vec![
        "--import".into(),
        report.display().to_string(),
        "--csv".into(),
        "--page".into(),
        "raw".into(),
        "--print-units".into(),
        "base".into(),
    ]
}

/// A clear error from ncu's output when it failed, naming the cause when known.
pub fn diagnose_ncu_failure(status: Option<i32>, output: &str) -> String {
    let tail: Vec<&str> = output.lines().rev().take(8).collect();
    let tail = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
    if output.contains("ERR_NVGPUCTRPERM") {
        return "ncu lacks permission to read the GPU performance counters (ERR_NVGPUCTRPERM): run as root, \
                or load the NVIDIA driver with NVreg_RestrictProfilingToAdminUsers=0 \
                (https://developer.nvidia.com/ERR_NVGPUCTRPERM)"
            .into();
    }
    if output.contains("LibraryNotLoaded") || output.contains("Failed to initialize the profiler") {
        return format!(
            "ncu could not initialise the profiler on this machine (a sandboxed GPU?): {tail}"
        );
    }
    let code = status.map_or("a signal".to_string(), |c| format!("exit code {c}"));
    format!("ncu failed ({code}): {tail}")
}

/// One kernel launch as ncu recorded it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelRecord {
    pub name: String,
    pub process: String,
    pub duration_us: Option<f64>,
    pub sm_throughput_pct: Option<f64>,
    /// Tensor-core pipe utilisation (the Hopper `gmma` pipe when present, else `hmma`).
    pub tensor_pipe_pct: Option<f64>,
    pub tensor_pipe_metric: Option<String>,
    pub dram_gbps: Option<f64>,
    pub dram_pct: Option<f64>,
    pub achieved_occupancy_pct: Option<f64>,
    pub registers_per_thread: Option<f64>,
    /// Static + dynamic shared memory per block, bytes.
    pub shared_mem_per_block: Option<f64>,
    pub grid_size: Option<f64>,
    pub block_size: Option<f64>,
}

/// Splits one CSV line (ncu quotes every field).
fn csv_fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// A numeric field: ncu may group digits with ',' and prints "n/a" for missing values.
fn number(s: &str) -> Option<f64> {
    let t: String = s.trim().chars().filter(|&c| c != ',').collect();
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// The raw page (`--csv --page raw --print-units base`) → one record per kernel. Lines
/// that are not CSV (ncu's `==PROF==` notes) are skipped; the row after the header that
/// holds units is skipped too.
pub fn parse_raw_csv(text: &str) -> Result<Vec<KernelRecord>, String> {
    let mut lines = text.lines().filter(|l| l.starts_with('"'));
    let header = csv_fields(
        lines
            .next()
            .ok_or("ncu printed no CSV (no kernel was profiled?)")?,
    );
    let col: BTreeMap<&str, usize> = header
        .iter()
        .enumerate()
        .map(|(i, h)| (h.as_str(), i))
        .collect();
    if !col.contains_key("Kernel Name") {
        return Err(format!(
            "ncu's CSV has no 'Kernel Name' column (header starts {:?})",
            header.iter().take(6).collect::<Vec<_>>()
        ));
    }
    // The tensor pipe: prefer the Hopper warpgroup (gmma) pipe, then the hmma pipe.
    let tensor_metric = ["gmma", "hmma"].iter().find_map(|pipe| {
        header
            .iter()
            .filter(|h| {
                h.starts_with("sm__pipe_tensor_op_")
                    && h.contains(pipe)
                    && h.ends_with("cycles_active.avg.pct_of_peak_sustained_active")
            })
            .min_by_key(|h| h.len())
            .cloned()
    });
    let mut records = Vec::new();
    for line in lines {
        let f = csv_fields(line);
        let get = |name: &str| col.get(name).and_then(|&i| f.get(i)).map(String::as_str);
        let num = |name: &str| get(name).and_then(number);
        let name = get("Kernel Name").unwrap_or("").to_string();
        if name.is_empty() || get("ID").is_some_and(|id| number(id).is_none()) {
            continue; // the units row
        }
        let smem = match (
            num("launch__shared_mem_per_block_static"),
            num("launch__shared_mem_per_block_dynamic"),
        ) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
        records.push(KernelRecord {
            name,
            process: get("Process Name").unwrap_or("").to_string(),
            duration_us: num("gpu__time_duration.sum").map(|ns| ns / 1e3),
            sm_throughput_pct: num("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
            tensor_pipe_pct: tensor_metric.as_deref().and_then(num),
            tensor_pipe_metric: tensor_metric.clone(),
            dram_gbps: num("dram__bytes.sum.per_second").map(|bps| bps / 1e9),
            dram_pct: num("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
            achieved_occupancy_pct: num("sm__warps_active.avg.pct_of_peak_sustained_active"),
            registers_per_thread: num("launch__registers_per_thread"),
            shared_mem_per_block: smem,
            grid_size: num("launch__grid_size"),
            block_size: num("launch__block_size"),
        });
    }
    Ok(records)
}

/// One (config, implementation): every kernel of the profiled call, and the main one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileRow {
    pub config_id: String,
    pub label: String,
    pub implementation: String,
    /// Sum of the kernels' durations, µs (ncu serialises kernels: no overlap).
    pub total_us: Option<f64>,
    /// TFLOP/s over `total_us` (model FLOPs of the config).
    pub tflops: Option<f64>,
    /// The longest kernel; its metrics are the row's headline.
    pub main: Option<KernelRecord>,
    pub kernels: Vec<KernelRecord>,
    /// Why there is no profile (ncu or the target failed), else `None`.
    pub error: Option<String>,
}

impl ProfileRow {
    pub fn from_kernels(
        config_id: String,
        label: String,
        implementation: String,
        flops: f64,
        kernels: Vec<KernelRecord>,
    ) -> ProfileRow {
        let total: f64 = kernels.iter().filter_map(|k| k.duration_us).sum();
        let main = kernels
            .iter()
            .max_by(|a, b| {
                a.duration_us
                    .unwrap_or(0.0)
                    .total_cmp(&b.duration_us.unwrap_or(0.0))
            })
            .cloned();
        let error = kernels
            .is_empty()
            .then(|| "ncu recorded no kernel in the profiled range".to_string());
        ProfileRow {
            config_id,
            label,
            implementation,
            total_us: (total > 0.0).then_some(total),
            tflops: (total > 0.0).then(|| flops / (total * 1e-6) / 1e12),
            main,
            kernels,
            error,
        }
    }
}

/// `profile.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileResults {
    pub schema_version: u32,
    pub suite: String,
    pub source: String,
    pub ncu: String,
    pub ncu_version: String,
    pub gpu: String,
    pub command_line: String,
    pub timestamp_utc: String,
    pub rows: Vec<ProfileRow>,
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |x| format!("{x:.digits$}"))
}

fn short(name: &str, n: usize) -> String {
    let base = name.split('(').next().unwrap_or(name);
    if base.chars().count() <= n {
        base.to_string()
    } else {
        format!("{}…", base.chars().take(n).collect::<String>())
    }
}

/// The report section (Markdown): one table per config, a row per implementation.
pub fn render_markdown(r: &ProfileResults) -> String {
    let mut s = String::new();
    s.push_str("## Nsight Compute profiles\n\n");
    s.push_str(&format!(
        "- **GPU**: {}\n- **ncu**: {} (`--clock-control none`, one call per implementation inside \
         cudaProfilerStart/Stop after warm-ups)\n- **Command**: `{}`\n- **Timestamp (UTC)**: {}\n\n",
        r.gpu, r.ncu_version, r.command_line, r.timestamp_utc
    ));
    s.push_str(
        "Duration is the sum over the call's kernels under ncu (serialised, L2 not flushed \
         between replay passes); the other columns are the longest kernel's. Tensor % is the \
         tensor pipe's active cycles over peak",
    );
    match r
        .rows
        .iter()
        .find_map(|x| x.main.as_ref()?.tensor_pipe_metric.clone())
    {
        Some(m) => s.push_str(&format!(" (`{m}`).\n\n")),
        None => s.push_str(".\n\n"),
    }
    let mut labels: Vec<(&str, &str)> = Vec::new();
    for row in &r.rows {
        if !labels.iter().any(|(id, _)| *id == row.config_id) {
            labels.push((&row.config_id, &row.label));
        }
    }
    for (id, label) in labels {
        s.push_str(&format!("### {label}\n\n`{id}`\n\n"));
        s.push_str("| implementation | kernels | duration µs | TFLOP/s | SM % | tensor % | DRAM GB/s | occupancy % | regs | smem KiB | grid × block | main kernel |\n");
        s.push_str("| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |\n");
        for row in r.rows.iter().filter(|x| x.config_id == id) {
            if let Some(e) = &row.error {
                s.push_str(&format!(
                    "| {} | — | — | — | — | — | — | — | — | — | — | error: {} |\n",
                    row.implementation,
                    e.replace('|', "/")
                ));
                continue;
            }
            let m = row.main.clone().unwrap_or_default();
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} × {} | `{}` |\n",
                row.implementation,
                row.kernels.len(),
                opt(row.total_us, 1),
                opt(row.tflops, 0),
                opt(m.sm_throughput_pct, 1),
                opt(m.tensor_pipe_pct, 1),
                opt(m.dram_gbps, 0),
                opt(m.achieved_occupancy_pct, 1),
                opt(m.registers_per_thread, 0),
                opt(m.shared_mem_per_block.map(|b| b / 1024.0), 1),
                opt(m.grid_size, 0),
                opt(m.block_size, 0),
                short(&m.name, 60).replace('|', "/"),
            ));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of ncu's raw page in base units: header, units row, one row per kernel.
    const RAW: &str = r#"==PROF== Connected to process 1234 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes.sum.per_second","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__block_size","launch__grid_size","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","byte/second","%","nsecond","","","register/thread","byte/block","byte/block","%","%","%","%"
"0","1234","python3.12","host","kernel_cutlass_flash_fwd_sm90(Params)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","123,456,789,012.5","4.1","1,520,384","384","132","168","229,376","0","88.2","0","71.3","18.7"
"1","1234","python3.12","host","flash_fwd_combine(Params)","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","2,000,000,000,000","60.0","12,000","256","64","40","n/a","1,024","0","0","10.5","50.0"
"#;

    #[test]
    fn raw_csv_parses_into_kernel_records() {
        let k = parse_raw_csv(RAW).unwrap();
        assert_eq!(k.len(), 2);
        let a = &k[0];
        assert_eq!(a.name, "kernel_cutlass_flash_fwd_sm90(Params)");
        assert_eq!(a.process, "python3.12");
        assert!((a.duration_us.unwrap() - 1520.384).abs() < 1e-9);
        assert!((a.dram_gbps.unwrap() - 123.4567890125).abs() < 1e-9);
        assert_eq!(a.tensor_pipe_pct, Some(88.2));
        assert!(a.tensor_pipe_metric.as_deref().unwrap().contains("gmma"));
        assert_eq!(a.sm_throughput_pct, Some(71.3));
        assert_eq!(a.achieved_occupancy_pct, Some(18.7));
        assert_eq!(a.registers_per_thread, Some(168.0));
        assert_eq!(a.shared_mem_per_block, Some(229_376.0));
        assert_eq!((a.grid_size, a.block_size), (Some(132.0), Some(384.0)));
        // "n/a" dynamic smem + 1 KiB static.
        assert_eq!(k[1].shared_mem_per_block, Some(1024.0));
    }

    #[test]
    fn row_sums_kernels_and_picks_the_longest() {
        let k = parse_raw_csv(RAW).unwrap();
        let row = ProfileRow::from_kernels("id".into(), "label".into(), "fa4".into(), 1e12, k);
        assert!((row.total_us.unwrap() - 1532.384).abs() < 1e-9);
        assert!((row.tflops.unwrap() - 1e12 / 1532.384e-6 / 1e12).abs() < 1e-9);
        assert!(row
            .main
            .as_ref()
            .unwrap()
            .name
            .starts_with("kernel_cutlass"));
        assert!(row.error.is_none());
        let md = render_markdown(&ProfileResults {
            rows: vec![row],
            ..Default::default()
        });
        assert!(md.contains("| fa4 | 2 | 1532.4 |"), "{md}");
        assert!(md.contains("| 88.2 |"), "{md}");
        let empty = ProfileRow::from_kernels("id".into(), "l".into(), "x".into(), 1.0, vec![]);
        assert!(empty.error.unwrap().contains("no kernel"));
    }

    #[test]
    fn malformed_csv_is_an_error_not_a_panic() {
        assert!(parse_raw_csv("==PROF== nothing profiled\n").is_err());
        assert!(parse_raw_csv("\"a\",\"b\"\n\"1\",\"2\"\n")
            .unwrap_err()
            .contains("Kernel Name"));
    }

    #[test]
    fn missing_ncu_and_permission_errors_are_clear() {
        let e = locate_ncu(Some(Path::new("/nonexistent/ncu"))).unwrap_err();
        assert!(e.contains("ncu not found at '/nonexistent/ncu'"), "{e}");
        let e = diagnose_ncu_failure(
            Some(1),
            "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters",
        );
        assert!(
            e.contains("lacks permission") && e.contains("NVreg_RestrictProfilingToAdminUsers"),
            "{e}"
        );
        let e = diagnose_ncu_failure(Some(3), "==ERROR== something else\nlast line");
        assert!(e.contains("exit code 3") && e.contains("last line"), "{e}");
    }

    #[test]
    fn ncu_command_line() {
        let a = ncu_args(Path::new("/tmp/r"), &["prog".into(), "x".into()]);
        let s = a.join(" ");
        assert!(
            s.starts_with("--clock-control none --profile-from-start off"),
            "{s}"
        );
        assert!(
            s.contains("--export /tmp/r") && s.ends_with("prog x"),
            "{s}"
        );
        assert!(s.contains("--section LaunchStats") && s.contains("gpu__time_duration.sum"));
    }
}
