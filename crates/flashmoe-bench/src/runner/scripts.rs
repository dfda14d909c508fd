//! The lab's Python scripts carried inside the binary, so that an installed `flashmoe`
//! (`cargo install`, no source tree beside it) still finds its baselines' worker, the
//! plug-in host and the end-to-end drivers. [`materialize`] writes them once into the
//! kernel cache directory, in a folder named by a hash of their contents (a binary with
//! other scripts gets its own folder; a folder is never rewritten in place).

use std::io::Write;
use std::path::{Path, PathBuf};

/// Every script a lab command runs, with the siblings they import (`flashmoe_worker.py`
/// imports `flashmoe_inputs`, `flashmoe_packages`, `flashmoe_grad`; the plug-in host
/// `flashmoe_inputs`; `flashmoe_e2e.py` and `flashmoe_e2e_train.py` `flashmoe_e2e_common`).
pub const EMBEDDED: &[(&str, &str)] = &[
    (
        "flashmoe_worker.py",
        include_str!("../../../../python/flashmoe_worker.py"),
    ),
    (
        "flashmoe_inputs.py",
        include_str!("../../../../python/flashmoe_inputs.py"),
    ),
    (
        "flashmoe_packages.py",
        include_str!("../../../../python/flashmoe_packages.py"),
    ),
    (
        "flashmoe_grad.py",
        include_str!("../../../../python/flashmoe_grad.py"),
    ),
    (
        "flashmoe_plugins.py",
        include_str!("../../../../python/flashmoe_plugins.py"),
    ),
    (
        "flashmoe_e2e.py",
        include_str!("../../../../python/flashmoe_e2e.py"),
    ),
    (
        "flashmoe_e2e_common.py",
        include_str!("../../../../python/flashmoe_e2e_common.py"),
    ),
    (
        "flashmoe_e2e_train.py",
        include_str!("../../../../python/flashmoe_e2e_train.py"),
    ),
];

/// FNV-1a (64-bit) of every script's name and text: the folder name.
fn contents_hash() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, text) in EMBEDDED {
        for b in name.bytes().chain([0u8]).chain(text.bytes()).chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The folder under `cache_dir` that holds this binary's scripts, written if missing or
/// incomplete (each file through a temporary name and a rename, so a concurrent run never
/// reads half a script). Returns the folder.
pub fn materialize(cache_dir: &Path) -> Result<PathBuf, String> {
    let dir = cache_dir.join(format!("python-scripts-{:016x}", contents_hash()));
    std::fs::create_dir_all(&dir).map_err(|e| {
        format!(
            "cannot create {} for the lab's Python scripts: {e}",
            dir.display()
        )
    })?;
    for (name, text) in EMBEDDED {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|b| b == text.as_bytes()) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(dir)
}

/// The embedded copy of `name`, materialised under `cache_dir`; None when `name` is not
/// one of the embedded scripts.
pub fn embedded_script(name: &str, cache_dir: &Path) -> Option<Result<PathBuf, String>> {
    EMBEDDED
        .iter()
        .any(|(n, _)| *n == name)
        .then(|| materialize(cache_dir).map(|d| d.join(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_are_written_once_and_match_the_source_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let p = embedded_script("flashmoe_worker.py", tmp.path())
            .unwrap()
            .unwrap();
        let dir = p.parent().unwrap().to_path_buf();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
        for (name, text) in EMBEDDED {
            let written = std::fs::read_to_string(dir.join(name)).unwrap();
            assert_eq!(&written, text, "{name}");
            assert_eq!(
                written,
                std::fs::read_to_string(src.join(name)).unwrap(),
                "{name}"
            );
        }
        // A second call finds them in place; a damaged file is rewritten.
        std::fs::write(dir.join("flashmoe_inputs.py"), "broken").unwrap();
        assert_eq!(materialize(tmp.path()).unwrap(), dir);
        let fixed = std::fs::read_to_string(dir.join("flashmoe_inputs.py")).unwrap();
        assert!(
            fixed.contains("def generate"),
            "flashmoe_inputs.py not restored"
        );
        assert!(embedded_script("not_a_script.py", tmp.path()).is_none());
        // Every import between the lab's scripts resolves inside the folder.
        for (name, text) in EMBEDDED {
            for line in text.lines() {
                let l = line.trim_start();
                let module = l
                    .strip_prefix("import flashmoe_")
                    .or_else(|| l.strip_prefix("from flashmoe_"))
                    .and_then(|r| r.split([' ', '.']).next());
                if let Some(m) = module {
                    let file = format!("flashmoe_{m}.py");
                    assert!(
                        EMBEDDED.iter().any(|(n, _)| *n == file),
                        "{name} imports {file}, which is not embedded"
                    );
                }
            }
        }
    }
}
