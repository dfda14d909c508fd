//! Every config file the repository ships (`configs/*.toml`, and the development-only ones
//! in `configs/dev/*.toml` that scripts/device-run.sh stages load) parses into at least one
//! config of its suite (named by the file's prefix), so a typo in a device-run config fails
//! here and not on the GPU machine.

use flashmoe_bench::config::{parse_config, Suite};

#[test]
fn shipped_configs_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut paths = Vec::new();
    for sub in [dir.clone(), dir.join("dev")] {
        for entry in std::fs::read_dir(&sub).unwrap_or_else(|e| panic!("{}: {e}", sub.display())) {
            paths.push(entry.unwrap().path());
        }
    }
    let mut seen = 0;
    for path in paths {
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let suite = if name.starts_with("moe-") {
            Suite::Moe
        } else if name.starts_with("attention-") {
            Suite::Attention
        } else {
            panic!("{name}: config files are named attention-* or moe-*");
        };
        let text = std::fs::read_to_string(&path).unwrap();
        let configs = parse_config(&text, suite).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!configs.is_empty(), "{name}: no {} config", suite.name());
        seen += 1;
    }
    assert!(
        seen >= 10,
        "found only {seen} config files in {}",
        dir.display()
    );
}
