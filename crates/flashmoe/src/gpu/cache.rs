//! The kernel cache: NVRTC output on disk (so a kernel compiles once per machine, not
//! once per process) and loaded modules in memory.
//!
//! Key: SHA-256 over the kernel source text, every embedded header, the defines, the
//! target architecture, the full NVRTC option list and the NVRTC version. A change to
//! any of them is a new key, so a stale binary can never be loaded.
//!
//! Directory: `$FLASHMOE_CACHE_DIR`, else `$XDG_CACHE_HOME/flashmoe`, else
//! `~/.cache/flashmoe`; files live in its `kernels/` subdirectory as
//! `<source stem>-<arch>-<key>.cubin` (or `.ptx`) plus the NVRTC log with the ptxas
//! resource report (`.log`). Files are written atomically (temporary file + rename), so
//! concurrent processes never read a partial file. A cache that cannot be written is
//! not an error: the kernel is compiled in memory and a warning is printed once.

use crate::error::{Error, Result};
use crate::gpu::nvrtc::{self, CompiledKernel, ImageKind};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};

/// Version of the cache layout; part of every key.
const CACHE_FORMAT: &str = "flashmoe-kernel-cache-v1";

/// The cache directory from the environment (see the module docs).
pub fn default_cache_dir() -> PathBuf {
    cache_dir_from(
        std::env::var_os("FLASHMOE_CACHE_DIR").map(PathBuf::from),
        std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

fn cache_dir_from(
    explicit: Option<PathBuf>,
    xdg: Option<PathBuf>,
    home: Option<PathBuf>,
) -> PathBuf {
    let nonempty = |p: Option<PathBuf>| p.filter(|p| !p.as_os_str().is_empty());
    if let Some(p) = nonempty(explicit) {
        return p;
    }
    if let Some(p) = nonempty(xdg) {
        return p.join("flashmoe");
    }
    if let Some(p) = nonempty(home) {
        return p.join(".cache").join("flashmoe");
    }
    std::env::temp_dir().join("flashmoe-cache")
}

/// The cache key (64 hex digits). Every field is length-prefixed, so no two different
/// inputs hash the same bytes.
pub fn cache_key(
    source_text: &str,
    headers: &[(&str, &str)],
    defines: &[(String, String)],
    arch: &str,
    options: &[String],
    nvrtc_version: &str,
) -> String {
    let mut h = Sha256::new();
    let mut field = |tag: &str, bytes: &[u8]| {
        h.update(tag.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field("format", CACHE_FORMAT.as_bytes());
    field("source", source_text.as_bytes());
    for (name, text) in headers {
        field("header-name", name.as_bytes());
        field("header", text.as_bytes());
    }
    for (k, v) in defines {
        field("define-name", k.as_bytes());
        field("define-value", v.as_bytes());
    }
    field("arch", arch.as_bytes());
    for o in options {
        field("option", o.as_bytes());
    }
    field("nvrtc", nvrtc_version.as_bytes());
    let digest = h.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Write `bytes` to `path` atomically: a temporary file in the same directory, then a
/// rename over the destination.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{nanos}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let result = (|| {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A compiled kernel image and where it came from.
#[derive(Debug, Clone)]
pub struct CachedKernel {
    pub key: String,
    pub compiled: CompiledKernel,
    /// True when read from the on-disk cache (no NVRTC compile in this process).
    pub from_disk: bool,
    /// The image file, when the cache is enabled.
    pub path: Option<PathBuf>,
}

/// NVRTC compile + on-disk cache + (with a device) loaded modules.
pub struct KernelCache {
    dir: Option<PathBuf>,
    ctx: Option<Arc<CudaContext>>,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(String, String), CudaFunction>>,
    warned: Once,
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCache")
            .field("dir", &self.dir)
            .field("has_device", &self.ctx.is_some())
            .finish()
    }
}

impl KernelCache {
    /// A cache that can compile (needs libnvrtc) but not load: for compile checks on a
    /// machine without a GPU. `dir = None` disables the on-disk cache.
    pub fn offline(dir: Option<PathBuf>) -> KernelCache {
        KernelCache {
            dir,
            ctx: None,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            warned: Once::new(),
        }
    }

    /// A cache that loads modules into `ctx`, with the on-disk cache in `dir`.
    pub fn for_context(ctx: Arc<CudaContext>, dir: Option<PathBuf>) -> KernelCache {
        KernelCache {
            ctx: Some(ctx),
            ..KernelCache::offline(dir)
        }
    }

    /// The on-disk cache directory (`<cache dir>/kernels`), if enabled.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn warn(&self, msg: String) {
        self.warned.call_once(|| {
            eprintln!("flashmoe: warning: kernel cache: {msg} (continuing without it)")
        });
    }

    fn file_stem(source_name: &str, arch: &str, key: &str) -> String {
        let stem = Path::new(source_name)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("kernel");
        let stem: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{stem}-{arch}-{key}")
    }

    fn key_for(
        nv: &nvrtc::Nvrtc,
        source_text: &str,
        defines: &[(String, String)],
        arch: &str,
    ) -> (String, Vec<String>) {
        let options = nvrtc::compile_options(arch, defines);
        let headers = crate::gpu::kernels::headers();
        let key = cache_key(
            source_text,
            &headers,
            defines,
            arch,
            &options,
            &nv.version_string(),
        );
        (key, options)
    }

    /// Compile `source_text` for `arch` with `defines`, or read the result from the
    /// on-disk cache. Needs libnvrtc (for its version, part of the key) but no GPU.
    pub fn compile(
        &self,
        source_name: &str,
        source_text: &str,
        entry: &str,
        defines: &[(String, String)],
        arch: &str,
    ) -> Result<CachedKernel> {
        let nv = nvrtc::nvrtc()?;
        let (key, options) = Self::key_for(nv, source_text, defines, arch);
        let kind = ImageKind::for_arch(arch);
        let paths = self.dir.as_ref().map(|d| {
            let stem = Self::file_stem(source_name, arch, &key);
            (
                d.join(format!("{stem}.{}", kind.extension())),
                d.join(format!("{stem}.log")),
            )
        });
        if let Some((img_path, log_path)) = &paths {
            if let (Ok(image), Ok(log)) = (std::fs::read(img_path), std::fs::read(log_path)) {
                let log = String::from_utf8_lossy(&log).into_owned();
                // Trust an entry only when its log ends with the completion marker written
                // after the image: a truncated or foreign log means recompile.
                if let (false, Some(log)) =
                    (image.is_empty(), log.strip_suffix(&complete_marker(entry)))
                {
                    let log = log.to_string();
                    if let Ok(compiled) = CompiledKernel::from_parts(
                        entry,
                        arch,
                        image,
                        log,
                        options.clone(),
                        nv.version_string(),
                        0.0,
                    ) {
                        return Ok(CachedKernel {
                            key,
                            compiled,
                            from_disk: true,
                            path: Some(img_path.clone()),
                        });
                    }
                }
            }
        }
        let compiled = nvrtc::compile_with(nv, source_name, source_text, entry, &options, arch)?;
        if let Some((img_path, log_path)) = &paths {
            let res = write_atomic(img_path, &compiled.image).and_then(|_| {
                let stored = format!("{}{}", compiled.log, complete_marker(entry));
                write_atomic(log_path, stored.as_bytes())
            });
            if let Err(e) = res {
                self.warn(format!("cannot write {}: {e}", img_path.display()));
            }
        }
        Ok(CachedKernel {
            key,
            compiled,
            from_disk: false,
            path: paths.map(|p| p.0),
        })
    }

    /// The kernel `entry` of `source_text` compiled for `arch` with `defines`, loaded
    /// into this cache's device. Compiles with NVRTC on a miss of both caches; a
    /// corrupt on-disk image is recompiled.
    pub fn load(
        &self,
        source_name: &str,
        source_text: &str,
        entry: &str,
        defines: &[(String, String)],
        arch: &str,
    ) -> Result<CudaFunction> {
        let ctx = self
            .ctx
            .as_ref()
            .ok_or_else(|| Error::NoGpu("this kernel cache was created without a device".into()))?;
        let (key, _) = Self::key_for(nvrtc::nvrtc()?, source_text, defines, arch);
        let fkey = (key.clone(), entry.to_string());
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&fkey)
        {
            return Ok(f.clone());
        }
        let module = {
            let existing = self
                .modules
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&key)
                .cloned();
            match existing {
                Some(m) => m,
                None => {
                    let cached = self.compile(source_name, source_text, entry, defines, arch)?;
                    let m = match load_image(ctx, &cached.compiled) {
                        Ok(m) => m,
                        Err(e) if cached.from_disk => {
                            // Corrupt or foreign file: drop it and compile afresh.
                            if let Some(p) = &cached.path {
                                let _ = std::fs::remove_file(p);
                            }
                            let fresh = KernelCache::offline(self.dir.clone()).compile(
                                source_name,
                                source_text,
                                entry,
                                defines,
                                arch,
                            )?;
                            load_image(ctx, &fresh.compiled).map_err(|e2| {
                                Error::cuda(
                                    format!("loading module {source_name} ({arch})"),
                                    format!("{e2} (cached image also failed: {e})"),
                                )
                            })?
                        }
                        Err(e) => return Err(e),
                    };
                    self.modules
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(key.clone(), m.clone());
                    m
                }
            }
        };
        let f = module.load_function(entry).map_err(|e| {
            Error::cuda(
                format!("cuModuleGetFunction({entry}) in {source_name} ({arch})"),
                e,
            )
        })?;
        self.functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(fkey, f.clone());
        Ok(f)
    }
}

fn load_image(ctx: &Arc<CudaContext>, compiled: &CompiledKernel) -> Result<Arc<CudaModule>> {
    let mut image = compiled.image.clone();
    if compiled.kind == ImageKind::Ptx && image.last() != Some(&0) {
        image.push(0);
    }
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(image))
        .map_err(|e| {
            Error::cuda(
                format!(
                    "cuModuleLoadData({} for {}, {:?})",
                    compiled.entry, compiled.arch, compiled.kind
                ),
                e,
            )
        })?;
    Ok(module)
}

/// Last line of every cached log: proves the entry was written completely.
fn complete_marker(entry: &str) -> String {
    format!("\n// flashmoe kernel cache: {entry} complete\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    fn key_of(
        src: &str,
        headers: &[(&str, &str)],
        d: &[(String, String)],
        arch: &str,
        nv: &str,
    ) -> String {
        let opts = nvrtc::compile_options(arch, d);
        cache_key(src, headers, d, arch, &opts, nv)
    }

    #[test]
    fn key_is_stable() {
        let d = defs(&[("FM_HEAD_DIM", "128")]);
        let a = key_of("src", &[("h.cuh", "x")], &d, "sm_90a", "13.0");
        let b = key_of("src", &[("h.cuh", "x")], &d, "sm_90a", "13.0");
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        // Pinned value: the key must not change between builds or platforms, or every
        // user recompiles after an upgrade for nothing. Update deliberately with the
        // format version.
        assert_eq!(
            key_of("", &[], &[], "sm_80", "13.0"),
            "607edd659edbc31b08535563559ab695c35c372b90ac145a4c2fcc3a4f7c5b3e"
        );
    }

    #[test]
    fn key_is_sensitive_to_every_input() {
        let d = defs(&[("FM_HEAD_DIM", "128"), ("FM_DTYPE", "bf16")]);
        let h = [("h.cuh", "x")];
        let base = key_of("src", &h, &d, "sm_90a", "13.0");
        let variants = [
            key_of("src ", &h, &d, "sm_90a", "13.0"),
            key_of("src", &[("h.cuh", "y")], &d, "sm_90a", "13.0"),
            key_of("src", &[("g.cuh", "x")], &d, "sm_90a", "13.0"),
            key_of("src", &[], &d, "sm_90a", "13.0"),
            key_of(
                "src",
                &h,
                &defs(&[("FM_HEAD_DIM", "64"), ("FM_DTYPE", "bf16")]),
                "sm_90a",
                "13.0",
            ),
            key_of(
                "src",
                &h,
                &defs(&[("FM_HEAD_DIM", "128"), ("FM_DTYPE", "f16")]),
                "sm_90a",
                "13.0",
            ),
            key_of(
                "src",
                &h,
                &defs(&[("FM_HEAD_DIM", "128")]),
                "sm_90a",
                "13.0",
            ),
            key_of("src", &h, &d, "sm_90", "13.0"),
            key_of("src", &h, &d, "sm_80", "13.0"),
            key_of("src", &h, &d, "sm_90a", "13.1"),
            cache_key(
                "src",
                &h,
                &d,
                "sm_90a",
                &["--use_fast_math".to_string()],
                "13.0",
            ),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(&base, v, "variant {i} collides");
        }
        // Field boundaries matter: moving bytes between define name and value changes it.
        let a = cache_key("s", &[], &defs(&[("AB", "C")]), "sm_80", &[], "13.0");
        let b = cache_key("s", &[], &defs(&[("A", "BC")]), "sm_80", &[], "13.0");
        assert_ne!(a, b);
    }

    #[test]
    fn cache_dir_resolution() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(
            cache_dir_from(p("/x"), p("/xdg"), p("/home/u")),
            PathBuf::from("/x")
        );
        assert_eq!(
            cache_dir_from(None, p("/xdg"), p("/home/u")),
            PathBuf::from("/xdg/flashmoe")
        );
        assert_eq!(
            cache_dir_from(p(""), p(""), p("/home/u")),
            PathBuf::from("/home/u/.cache/flashmoe")
        );
        assert!(cache_dir_from(None, None, None).ends_with("flashmoe-cache"));
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp_files() {
        let dir = std::env::temp_dir().join(format!("flashmoe-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub").join("a.cubin");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_names_are_readable_and_safe() {
        let s = KernelCache::file_stem("flash attn/fwd.cu", "sm_90a", "abc");
        assert_eq!(s, "fwd-sm_90a-abc");
        let s = KernelCache::file_stem("flash_attn_fwd.cu", "sm_80", "k");
        assert_eq!(s, "flash_attn_fwd-sm_80-k");
    }

    #[test]
    fn load_without_device_is_nogpu() {
        let c = KernelCache::offline(None);
        match c.load("x.cu", "", "x", &[], "sm_80") {
            Err(Error::NoGpu(m)) => assert!(m.contains("without a device")),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("loaded without a device"),
        }
    }
}
