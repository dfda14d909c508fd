//! Reports of a benchmark run: terminal table, versioned JSON (with raw samples), CSV,
//! Markdown and a self-contained HTML page with hand-written SVG plots.
//!
//! [`write_all`] writes the four files atomically (temp file in the same directory, then
//! rename), so it can be called after every finished config: an interrupted run leaves
//! the previous complete files, never a half-written one.

mod csv_out;
pub mod format;
mod html;
mod markdown;
pub mod svg;
mod terminal;

#[doc(hidden)]
pub mod fixtures;

use crate::results::{RunResults, SCHEMA_VERSION};
use anyhow::{anyhow, bail, Context};
use std::io::Write;
use std::path::{Path, PathBuf};

pub use csv_out::{to_csv, CSV_HEADER};
pub use html::to_html;
pub use markdown::to_markdown;
pub use terminal::terminal_table;

/// File names written by [`write_all`], in order.
pub const JSON_FILE: &str = "results.json";
pub const CSV_FILE: &str = "results.csv";
pub const MARKDOWN_FILE: &str = "results.md";
pub const HTML_FILE: &str = "report.html";

/// Pretty JSON of the whole run (schema in docs/results-schema.md).
pub fn to_json(results: &RunResults) -> anyhow::Result<String> {
    serde_json::to_string_pretty(results).context("serialising results to JSON")
}

/// Write results.json, results.csv, results.md and report.html into `out_dir` (created
/// if needed) and return their paths. Each file is replaced atomically.
pub fn write_all(results: &RunResults, out_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if out_dir.exists() && !out_dir.is_dir() {
        bail!(
            "output directory '{}' exists but is not a directory",
            out_dir.display()
        );
    }
    std::fs::create_dir_all(out_dir).map_err(|e| {
        anyhow!(
            "cannot create output directory '{}': {e}",
            out_dir.display()
        )
    })?;
    let contents: [(&str, String); 4] = [
        (JSON_FILE, to_json(results)?),
        (CSV_FILE, to_csv(results)?),
        (MARKDOWN_FILE, to_markdown(results)),
        (HTML_FILE, to_html(results)),
    ];
    let mut paths = Vec::with_capacity(contents.len());
    for (name, text) in contents {
        let path = out_dir.join(name);
        write_atomic(&path, text.as_bytes())?;
        paths.push(path);
    }
    Ok(paths)
}

/// Write `bytes` to `path` through a temporary file in the same directory and a rename,
/// so readers see either the old file or the complete new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let err = |e: std::io::Error| anyhow!("cannot write '{}': {e}", path.display());
    let mut tmp = tempfile::Builder::new()
        .prefix(".flashmoe-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| {
            anyhow!(
                "cannot write '{}': cannot create a temporary file in '{}': {e}",
                path.display(),
                dir.display()
            )
        })?;
    tmp.write_all(bytes).map_err(err)?;
    tmp.flush().map_err(err)?;
    #[cfg(unix)]
    {
        // Temp files are created 0600; reports are meant to be shared like any file.
        use std::os::unix::fs::PermissionsExt;
        let _ = tmp
            .as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644));
    }
    tmp.persist(path).map_err(|e| err(e.error))?;
    Ok(())
}

/// Read a results file written by [`write_all`], checking it is a flashmoe results file
/// of the schema version this build understands.
pub fn read_json(path: &Path) -> anyhow::Result<RunResults> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow!("cannot read results file '{}': {e}", path.display()))?;
    parse_json(&text).map_err(|e| anyhow!("'{}': {e:#}", path.display()))
}

/// Parse results JSON text (see [`read_json`]).
pub fn parse_json(text: &str) -> anyhow::Result<RunResults> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| anyhow!("not a flashmoe results file: the content is not valid JSON ({e})"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| anyhow!("not a flashmoe results file: expected a JSON object"))?;
    let version = match obj.get("schema_version") {
        None => bail!("not a flashmoe results file: no 'schema_version' field"),
        Some(v) => v.as_u64().ok_or_else(|| {
            anyhow!("not a flashmoe results file: 'schema_version' is {v}, expected an integer")
        })?,
    };
    for key in ["suite", "manifest", "configs"] {
        if !obj.contains_key(key) {
            bail!("not a flashmoe results file: no '{key}' field");
        }
    }
    if version != SCHEMA_VERSION as u64 {
        let hint = if version > SCHEMA_VERSION as u64 {
            "it was written by a newer flashmoe; upgrade to read it"
        } else {
            "it was written by an older flashmoe; re-run the benchmark"
        };
        bail!(
            "unsupported results schema_version {version}: this flashmoe reads version \
             {SCHEMA_VERSION} ({hint})"
        );
    }
    drop(value);
    // Parse the text again (not the Value) so errors carry line and column.
    serde_json::from_str(text).map_err(|e| {
        anyhow!(
            "results do not match schema version {SCHEMA_VERSION}: {e} (non-finite numbers \
             are stored as null and cannot be read back into required fields)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_flashmoe_json() {
        let e = parse_json("[1,2]").unwrap_err().to_string();
        assert!(e.contains("not a flashmoe results file"), "{e}");
        let e = parse_json("{\"a\": 1}").unwrap_err().to_string();
        assert!(e.contains("schema_version"), "{e}");
        let e = parse_json("not json").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }

    #[test]
    fn rejects_other_versions() {
        let mut v = serde_json::to_value(fixtures::cpu_moe_run()).unwrap();
        v["schema_version"] = 99.into();
        let e = parse_json(&v.to_string()).unwrap_err().to_string();
        assert!(
            e.contains("schema_version 99") && e.contains("newer"),
            "{e}"
        );
    }

    #[test]
    fn atomic_write_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "two");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }
}
