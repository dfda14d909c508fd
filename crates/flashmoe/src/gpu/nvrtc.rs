//! NVRTC: run-time compilation of the CUDA C++ kernels to CUBIN (or PTX), usable on a
//! machine without a GPU.
//!
//! flashmoe calls libnvrtc through its own small binding (not cudarc's), so it decides
//! which library is used, reports a missing library or symbol as an error instead of a
//! panic, and can read the CUBIN and the ptxas resource report.
//!
//! Where libnvrtc is looked for, in order:
//! 1. `$FLASHMOE_NVRTC_LIB`: the library file itself or the directory holding it (for
//!    the `nvidia-cuda-nvrtc` wheel: `<target>/nvidia/cu13/lib`). When set, nothing
//!    else is tried.
//! 2. The dynamic loader's search path (`LD_LIBRARY_PATH`, ld.so cache):
//!    `libnvrtc.so.13`, `libnvrtc.so.12`, `libnvrtc.so`.
//! 3. CUDA toolkit directories: `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`,
//!    `/usr/local/cuda/lib64`, `/usr/local/cuda-*/lib64`.
//! 4. The development checkout's `.nvrtc/nvidia/cu13/lib` (what
//!    `scripts/install-nvrtc.sh` installs).
//!
//! [`init_nvrtc_from`] loads from an explicit path instead (used by the tests).

use crate::error::{Error, Result};
use crate::gpu::libs;
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

type NvrtcProgram = *mut std::ffi::c_void;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type FnCreate = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type FnCompile = unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int;
type FnDestroy = unsafe extern "C" fn(*mut NvrtcProgram) -> c_int;
type FnGetSize = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int;
type FnGetBytes = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int;
type FnNumArchs = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnArchs = unsafe extern "C" fn(*mut c_int) -> c_int;

/// A loaded libnvrtc.
pub struct Nvrtc {
    /// Where it was loaded from (a path, or a bare name resolved by the dynamic loader).
    pub location: String,
    /// (major, minor), e.g. (13, 0).
    pub version: (i32, i32),
    /// Real architectures this NVRTC can compile for (compute capability × 10).
    pub supported_archs: Vec<u32>,
    error_string: FnErrorString,
    create: FnCreate,
    compile: FnCompile,
    destroy: FnDestroy,
    log_size: FnGetSize,
    log: FnGetBytes,
    cubin_size: FnGetSize,
    cubin: FnGetBytes,
    ptx_size: FnGetSize,
    ptx: FnGetBytes,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("location", &self.location)
            .field("version", &self.version)
            .field("supported_archs", &self.supported_archs)
            .finish()
    }
}

impl Nvrtc {
    /// "13.0".
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version.0, self.version.1)
    }

    fn open(lib: libloading::Library, location: String) -> std::result::Result<Nvrtc, String> {
        // SAFETY: the symbol types match the NVRTC C API (nvrtc.h); the library is kept
        // alive in the struct for as long as the function pointers are used.
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|e| format!("{location}: missing symbol {}: {e}", $name))?
                };
            }
            let version_fn: FnVersion = sym!("nvrtcVersion");
            let num_archs: FnNumArchs = sym!("nvrtcGetNumSupportedArchs");
            let archs_fn: FnArchs = sym!("nvrtcGetSupportedArchs");
            let (mut major, mut minor) = (0, 0);
            if version_fn(&mut major, &mut minor) != 0 {
                return Err(format!("{location}: nvrtcVersion failed"));
            }
            let mut n: c_int = 0;
            let mut archs = Vec::new();
            if num_archs(&mut n) == 0 && n > 0 {
                let mut buf = vec![0 as c_int; n as usize];
                if archs_fn(buf.as_mut_ptr()) == 0 {
                    archs = buf.into_iter().map(|a| a as u32).collect();
                }
            }
            Ok(Nvrtc {
                location: location.clone(),
                version: (major, minor),
                supported_archs: archs,
                error_string: sym!("nvrtcGetErrorString"),
                create: sym!("nvrtcCreateProgram"),
                compile: sym!("nvrtcCompileProgram"),
                destroy: sym!("nvrtcDestroyProgram"),
                log_size: sym!("nvrtcGetProgramLogSize"),
                log: sym!("nvrtcGetProgramLog"),
                cubin_size: sym!("nvrtcGetCUBINSize"),
                cubin: sym!("nvrtcGetCUBIN"),
                ptx_size: sym!("nvrtcGetPTXSize"),
                ptx: sym!("nvrtcGetPTX"),
                _lib: lib,
            })
        }
    }

    fn err(&self, call: &str, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let s = unsafe { (self.error_string)(code) };
        let text = if s.is_null() {
            format!("error {code}")
        } else {
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        format!("{call}: {text}")
    }
}

/// Load libnvrtc from `path`: the library file, or a directory containing it. The
/// `libnvrtc-builtins` library next to it is loaded first (libnvrtc opens it by name).
fn load_from_path(path: &Path) -> std::result::Result<Nvrtc, String> {
    let (dir, file) = if path.is_dir() {
        let found = libs::find_versioned(path, "libnvrtc", "libnvrtc.so.13");
        match found.into_iter().next() {
            Some(f) => (path.to_path_buf(), f),
            None => return Err(format!("no libnvrtc.so* in {}", path.display())),
        }
    } else if path.is_file() {
        (
            path.parent().map(Path::to_path_buf).unwrap_or_default(),
            path.to_path_buf(),
        )
    } else {
        return Err(format!("{} does not exist", path.display()));
    };
    for builtins in libs::find_versioned(&dir, "libnvrtc-builtins", "") {
        if libs::pin(&builtins).is_ok() {
            break;
        }
    }
    // SAFETY: loading libnvrtc runs its initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new(&file) }
        .map_err(|e| format!("cannot load {}: {e}", file.display()))?;
    Nvrtc::open(lib, file.display().to_string())
}

/// The checkout-local install made by `scripts/install-nvrtc.sh`.
pub fn dev_checkout_nvrtc_dir() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.nvrtc/nvidia/cu13/lib");
    std::fs::canonicalize(&p).unwrap_or(p)
}

fn search() -> std::result::Result<Nvrtc, String> {
    if let Some(p) = std::env::var_os("FLASHMOE_NVRTC_LIB") {
        let p = PathBuf::from(p);
        return load_from_path(&p).map_err(|e| format!("FLASHMOE_NVRTC_LIB={}: {e}", p.display()));
    }
    let mut tried = Vec::new();
    for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
        // SAFETY: as above.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            return Nvrtc::open(lib, format!("{name} (dynamic loader search path)"));
        }
        tried.push(name.to_string());
    }
    let mut dirs = libs::toolkit_lib_dirs();
    dirs.push(dev_checkout_nvrtc_dir());
    for dir in dirs {
        if !libs::find_versioned(&dir, "libnvrtc", "libnvrtc.so.13").is_empty() {
            return load_from_path(&dir);
        }
        tried.push(dir.display().to_string());
    }
    Err(format!(
        "libnvrtc (the CUDA run-time compiler) was not found; tried {}. Install it with \
         scripts/install-nvrtc.sh (pip wheel nvidia-cuda-nvrtc) and/or set \
         FLASHMOE_NVRTC_LIB to the directory holding libnvrtc.so.13",
        tried.join(", ")
    ))
}

static LOADED: Mutex<Option<&'static Nvrtc>> = Mutex::new(None);

/// The process-wide libnvrtc, located as described in the module docs.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = *g {
        return Ok(n);
    }
    let n: &'static Nvrtc = Box::leak(Box::new(search().map_err(|m| Error::cuda("NVRTC", m))?));
    *g = Some(n);
    Ok(n)
}

/// Use the libnvrtc at `path` (file or directory) for this process. Returns the loaded
/// library; if one was loaded already from the same location it is returned, from a
/// different location it is an error.
pub fn init_nvrtc_from(path: &Path) -> Result<&'static Nvrtc> {
    let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let n = load_from_path(path).map_err(|m| Error::cuda("NVRTC", m))?;
    if let Some(existing) = *g {
        if existing.location == n.location {
            return Ok(existing);
        }
        return Err(Error::cuda(
            "NVRTC",
            format!(
                "libnvrtc was already loaded from {}; cannot switch to {}",
                existing.location, n.location
            ),
        ));
    }
    let n: &'static Nvrtc = Box::leak(Box::new(n));
    *g = Some(n);
    Ok(n)
}

/// The NVRTC version as "13.0", or None when libnvrtc cannot be found.
pub fn nvrtc_version() -> Option<String> {
    nvrtc().ok().map(Nvrtc::version_string)
}

/// What NVRTC produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for one real architecture (`-arch=sm_XX`).
    Cubin,
    /// PTX (`-arch=compute_XX`), JIT-compiled by the driver when loaded.
    Ptx,
}

impl ImageKind {
    pub fn extension(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
    /// The image kind an `-arch=` value produces.
    pub fn for_arch(arch: &str) -> ImageKind {
        if arch.starts_with("compute_") {
            ImageKind::Ptx
        } else {
            ImageKind::Cubin
        }
    }
}

/// One function's resource usage from the ptxas report.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelResources {
    /// Mangled name as ptxas prints it (extern "C" entries are unmangled).
    pub name: String,
    /// Whether this is a kernel entry point (vs a non-inlined device function).
    pub is_entry: bool,
    pub registers: u32,
    pub spill_stores: u64,
    pub spill_loads: u64,
    pub stack_frame: u64,
    /// Static shared memory (`__shared__` arrays), bytes. Dynamic shared memory is not
    /// included (it is a launch parameter).
    pub shared_static: u64,
    pub barriers: u32,
    /// Constant bank 0 bytes (kernel parameters).
    pub cmem0: u64,
}

impl KernelResources {
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

impl std::fmt::Display for KernelResources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} regs, {} B spill stores, {} B spill loads, {} B stack, {} B static smem, {} barriers",
            self.registers,
            self.spill_stores,
            self.spill_loads,
            self.stack_frame,
            self.shared_static,
            self.barriers
        )
    }
}

/// Parse the ptxas `-v` report that NVRTC appends to the program log. Returns one entry
/// per function mentioned, entries and device functions alike, in order of appearance.
///
/// The report looks like:
/// ```text
/// ptxas info    : Compiling entry function 'k' for 'sm_90a'
/// ptxas info    : Function properties for k
/// ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 32 registers, used 1 barriers, 1024 bytes smem, 372 bytes cmem[0]
/// ```
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    fn number_before(part: &str, suffix: &str) -> Option<u64> {
        let part = part.trim();
        let head = part.strip_suffix(suffix)?.trim();
        head.rsplit(' ').next()?.parse().ok()
    }
    fn quoted(s: &str) -> Option<&str> {
        let start = s.find('\'')? + 1;
        let end = start + s[start..].find('\'')?;
        Some(&s[start..end])
    }
    let mut out: Vec<KernelResources> = Vec::new();
    let index_of = |out: &mut Vec<KernelResources>, name: &str| -> usize {
        if let Some(i) = out.iter().position(|r| r.name == name) {
            i
        } else {
            out.push(KernelResources {
                name: name.to_string(),
                ..Default::default()
            });
            out.len() - 1
        }
    };
    let mut current_entry: Option<usize> = None;
    let mut current_props: Option<usize> = None;
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("ptxas") else {
            continue;
        };
        // "info    : ..." or "        .     ..." (continuation of Function properties).
        let body = match rest.find(':') {
            Some(i) if rest[..i].trim() == "info" => rest[i + 1..].trim(),
            _ => rest.trim_start().trim_start_matches('.').trim(),
        };
        if let Some(r) = body.strip_prefix("Compiling entry function") {
            if let Some(name) = quoted(r) {
                let i = index_of(&mut out, name);
                out[i].is_entry = true;
                current_entry = Some(i);
            }
        } else if let Some(r) = body.strip_prefix("Function properties for") {
            let name = r.trim();
            current_props = Some(index_of(&mut out, name));
        } else if body.contains("bytes stack frame") {
            if let Some(i) = current_props.take() {
                for part in body.split(',') {
                    if let Some(v) = number_before(part, "bytes stack frame") {
                        out[i].stack_frame = v;
                    } else if let Some(v) = number_before(part, "bytes spill stores") {
                        out[i].spill_stores = v;
                    } else if let Some(v) = number_before(part, "bytes spill loads") {
                        out[i].spill_loads = v;
                    }
                }
            }
        } else if let Some(r) = body.strip_prefix("Used") {
            if let Some(i) = current_entry {
                for part in format!("Used{r}").split(',') {
                    let part = part.trim();
                    if let Some(v) = part
                        .strip_prefix("Used ")
                        .and_then(|p| p.strip_suffix(" registers"))
                    {
                        out[i].registers = v.trim().parse().unwrap_or(0);
                    } else if let Some(v) = part
                        .strip_prefix("used ")
                        .and_then(|p| p.strip_suffix(" barriers"))
                    {
                        out[i].barriers = v.trim().parse().unwrap_or(0);
                    } else if let Some(v) = number_before(part, "bytes smem") {
                        out[i].shared_static = v;
                    } else if let Some(v) = number_before(part, "bytes cmem[0]") {
                        out[i].cmem0 = v;
                    }
                }
            }
        }
    }
    out
}

/// The compiler options flashmoe uses for `arch` ("sm_80", "sm_90a", "compute_90") and
/// the given preprocessor defines. Part of the cache key.
pub fn compile_options(arch: &str, defines: &[(String, String)]) -> Vec<String> {
    let mut opts = vec![
        "--std=c++17".to_string(),
        format!("-arch={arch}"),
        "-lineinfo".to_string(),
        "-default-device".to_string(),
    ];
    if ImageKind::for_arch(arch) == ImageKind::Cubin {
        // ptxas resource report (registers, spills, smem) in the program log.
        opts.push("--ptxas-options=-v".to_string());
    }
    for (k, v) in defines {
        if v.is_empty() {
            opts.push(format!("-D{k}"));
        } else {
            opts.push(format!("-D{k}={v}"));
        }
    }
    opts
}

/// The `-arch` value to compile for a device of compute capability `major.minor`, given
/// the real architectures an NVRTC supports: `sm_90a` on Hopper (its wgmma/TMA/setmaxnreg
/// features need the arch-specific target), `sm_XY` for any other supported device, and
/// PTX for the newest supported architecture below it when the device is newer than the
/// NVRTC (the driver then JIT-compiles it).
pub fn compile_arch_for(major: u32, minor: u32, supported: &[u32]) -> Result<String> {
    let cc = major * 10 + minor;
    if supported.is_empty() || supported.contains(&cc) {
        return Ok(if cc == 90 {
            "sm_90a".to_string()
        } else {
            format!("sm_{cc}")
        });
    }
    match supported.iter().copied().filter(|&a| a < cc).max() {
        Some(a) => Ok(format!("compute_{a}")),
        None => Err(Error::unsupported(
            "NVRTC",
            format!(
                "device compute capability {major}.{minor} is older than every architecture \
                 this NVRTC supports ({supported:?})"
            ),
        )),
    }
}

/// The output of one NVRTC compilation.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub entry: String,
    pub arch: String,
    pub kind: ImageKind,
    /// CUBIN bytes, or PTX text (NUL-terminated) bytes.
    pub image: Vec<u8>,
    /// The full NVRTC program log (warnings + ptxas report).
    pub log: String,
    pub options: Vec<String>,
    pub nvrtc_version: String,
    /// Resources of the entry function (None for PTX, where ptxas does not run).
    pub resources: Option<KernelResources>,
    /// Every function in the ptxas report (entries and non-inlined device functions).
    pub all_functions: Vec<KernelResources>,
    /// Wall-clock compile time in ms (0 when loaded from the on-disk cache).
    pub compile_ms: f64,
}

impl CompiledKernel {
    pub fn registers(&self) -> Option<u32> {
        self.resources.as_ref().map(|r| r.registers)
    }
    pub fn spill_stores(&self) -> Option<u64> {
        self.resources.as_ref().map(|r| r.spill_stores)
    }
    pub fn spill_loads(&self) -> Option<u64> {
        self.resources.as_ref().map(|r| r.spill_loads)
    }
    pub fn shared_static(&self) -> Option<u64> {
        self.resources.as_ref().map(|r| r.shared_static)
    }
    pub fn stack_frame(&self) -> Option<u64> {
        self.resources.as_ref().map(|r| r.stack_frame)
    }
    /// True when any function of the module spills (entry or device function).
    pub fn spills(&self) -> bool {
        self.all_functions.iter().any(KernelResources::spills)
    }
    /// One line: "entry sm_90a: 168 regs, 0 B spill stores, ...".
    pub fn summary(&self) -> String {
        match &self.resources {
            Some(r) => format!("{} {}: {r}", self.entry, self.arch),
            None => format!("{} {}: PTX (no ptxas report)", self.entry, self.arch),
        }
    }

    /// Fill `resources`/`all_functions` from `log`, checking that `entry` exists when a
    /// ptxas report is present.
    pub(crate) fn from_parts(
        entry: &str,
        arch: &str,
        image: Vec<u8>,
        log: String,
        options: Vec<String>,
        nvrtc_version: String,
        compile_ms: f64,
    ) -> Result<CompiledKernel> {
        let kind = ImageKind::for_arch(arch);
        let all = parse_ptxas_report(&log);
        let resources = all.iter().find(|r| r.is_entry && r.name == entry).cloned();
        // Without a ptxas report (NVRTC builds differ in what they log) the module load
        // still checks that the entry exists.
        if kind == ImageKind::Cubin && resources.is_none() && !all.is_empty() {
            let entries: Vec<&str> = all
                .iter()
                .filter(|r| r.is_entry)
                .map(|r| r.name.as_str())
                .collect();
            return Err(Error::Compile {
                kernel: entry.to_string(),
                arch: arch.to_string(),
                log: format!(
                    "entry function '{entry}' is not in the compiled module (entries: {}); \
                     is it declared extern \"C\" __global__?\n{log}",
                    if entries.is_empty() {
                        "none".to_string()
                    } else {
                        entries.join(", ")
                    }
                ),
            });
        }
        Ok(CompiledKernel {
            entry: entry.to_string(),
            arch: arch.to_string(),
            kind,
            image,
            log,
            options,
            nvrtc_version,
            resources,
            all_functions: all,
            compile_ms,
        })
    }
}

/// Compile `source` with the options of [`compile_options`] for `arch` ("sm_80",
/// "sm_90a", or "compute_XX" for PTX). Embedded `.cuh` headers are available to
/// `#include`. Needs libnvrtc but no GPU. A compilation error returns
/// [`Error::Compile`] with the full NVRTC log.
pub fn nvrtc_compile(
    source: &str,
    entry_name: &str,
    defines: &[(String, String)],
    arch: &str,
) -> Result<CompiledKernel> {
    let nv = nvrtc()?;
    let options = compile_options(arch, defines);
    compile_with(nv, entry_name, source, entry_name, &options, arch)
}

/// Compile with explicit options (the cache uses this so the key and the compile agree).
pub(crate) fn compile_with(
    nv: &Nvrtc,
    program_name: &str,
    source: &str,
    entry: &str,
    options: &[String],
    arch: &str,
) -> Result<CompiledKernel> {
    let cuda = |m: String| Error::cuda(format!("NVRTC compiling {entry} for {arch}"), m);
    let c_src = CString::new(source).map_err(|_| cuda("source contains a NUL byte".into()))?;
    let c_name = CString::new(program_name.replace('\0', ""))
        .map_err(|_| cuda("bad program name".into()))?;
    let headers = crate::gpu::kernels::headers();
    let c_hdr_src: Vec<CString> = headers
        .iter()
        .map(|(_, t)| CString::new(*t).unwrap_or_default())
        .collect();
    let c_hdr_names: Vec<CString> = headers
        .iter()
        .map(|(n, _)| CString::new(*n).unwrap_or_default())
        .collect();
    let hdr_src_ptrs: Vec<*const c_char> = c_hdr_src.iter().map(|c| c.as_ptr()).collect();
    let hdr_name_ptrs: Vec<*const c_char> = c_hdr_names.iter().map(|c| c.as_ptr()).collect();
    let c_opts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| cuda("option contains a NUL byte".into()))?;
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();

    let start = Instant::now();
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the calls; the
    // program is destroyed on every path below.
    unsafe {
        let rc = (nv.create)(
            &mut prog,
            c_src.as_ptr(),
            c_name.as_ptr(),
            hdr_src_ptrs.len() as c_int,
            if headers.is_empty() {
                std::ptr::null()
            } else {
                hdr_src_ptrs.as_ptr()
            },
            if headers.is_empty() {
                std::ptr::null()
            } else {
                hdr_name_ptrs.as_ptr()
            },
        );
        if rc != 0 {
            return Err(cuda(nv.err("nvrtcCreateProgram", rc)));
        }
        let result = (|| -> Result<CompiledKernel> {
            let rc = (nv.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let compile_ms = start.elapsed().as_secs_f64() * 1e3;
            let log = read_bytes(prog, nv.log_size, nv.log)
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .to_string()
                })
                .unwrap_or_else(|rc| format!("(could not read the NVRTC log: error {rc})"));
            if rc != 0 {
                return Err(Error::Compile {
                    kernel: entry.to_string(),
                    arch: arch.to_string(),
                    log: format!(
                        "{}\noptions: {}\n{log}",
                        nv.err("nvrtcCompileProgram", rc),
                        options.join(" ")
                    ),
                });
            }
            let kind = ImageKind::for_arch(arch);
            let image = match kind {
                ImageKind::Cubin => read_bytes(prog, nv.cubin_size, nv.cubin)
                    .map_err(|rc| cuda(nv.err("nvrtcGetCUBIN", rc)))?,
                ImageKind::Ptx => read_bytes(prog, nv.ptx_size, nv.ptx)
                    .map_err(|rc| cuda(nv.err("nvrtcGetPTX", rc)))?,
            };
            if image.is_empty() {
                return Err(cuda(format!("NVRTC returned an empty {kind:?} image")));
            }
            CompiledKernel::from_parts(
                entry,
                arch,
                image,
                log,
                options.to_vec(),
                nv.version_string(),
                compile_ms,
            )
        })();
        (nv.destroy)(&mut prog);
        result
    }
}

unsafe fn read_bytes(
    prog: NvrtcProgram,
    size_fn: FnGetSize,
    get_fn: FnGetBytes,
) -> std::result::Result<Vec<u8>, c_int> {
    let mut size = 0usize;
    let rc = size_fn(prog, &mut size);
    if rc != 0 {
        return Err(rc);
    }
    let mut buf = vec![0u8; size];
    if size > 0 {
        let rc = get_fn(prog, buf.as_mut_ptr() as *mut c_char);
        if rc != 0 {
            return Err(rc);
        }
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'k2' for 'sm_80'\n\
ptxas info    : Function properties for k2\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]\n\
ptxas info    : Compile time = 7.589 ms\n\
ptxas info    : Function properties for _Z6helperf\n\
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n\
ptxas info    : Compiling entry function 'k' for 'sm_80'\n\
ptxas info    : Function properties for k\n\
ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 32 registers, used 1 barriers, 256 bytes cumulative stack size, 1024 bytes smem, 372 bytes cmem[0]\n\
ptxas info    : Compile time = 35.628 ms\n";

    #[test]
    fn parses_ptxas_report() {
        let r = parse_ptxas_report(REPORT);
        assert_eq!(r.len(), 3, "{r:?}");
        let k2 = r.iter().find(|x| x.name == "k2").unwrap();
        assert!(k2.is_entry);
        assert_eq!(k2.registers, 8);
        assert_eq!(k2.cmem0, 360);
        assert_eq!(k2.shared_static, 0);
        assert!(!k2.spills());
        let helper = r.iter().find(|x| x.name == "_Z6helperf").unwrap();
        assert!(!helper.is_entry);
        assert_eq!(helper.stack_frame, 16);
        assert_eq!(helper.spill_stores, 4);
        assert_eq!(helper.spill_loads, 8);
        assert!(helper.spills());
        let k = r.iter().find(|x| x.name == "k").unwrap();
        assert!(k.is_entry);
        assert_eq!(k.registers, 32);
        assert_eq!(k.barriers, 1);
        assert_eq!(k.stack_frame, 256);
        assert_eq!(k.shared_static, 1024);
        assert_eq!(k.cmem0, 372);
    }

    #[test]
    fn parses_hopper_report_without_cmem() {
        let log = "ptxas info    : Compiling entry function 'flash' for 'sm_90a'\n\
ptxas info    : Function properties for flash\n\
ptxas         .     0 bytes stack frame, 120 bytes spill stores, 96 bytes spill loads\n\
ptxas info    : Used 255 registers, used 2 barriers, 49152 bytes smem\n";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].registers, 255);
        assert_eq!(r[0].barriers, 2);
        assert_eq!(r[0].shared_static, 49152);
        assert_eq!(r[0].spill_stores, 120);
        assert_eq!(r[0].spill_loads, 96);
    }

    #[test]
    fn empty_or_foreign_log_parses_to_nothing() {
        assert!(parse_ptxas_report("").is_empty());
        assert!(parse_ptxas_report("warning: something\n").is_empty());
    }

    #[test]
    fn missing_entry_is_a_compile_error() {
        let err = CompiledKernel::from_parts(
            "nope",
            "sm_80",
            vec![1],
            REPORT.to_string(),
            vec![],
            "13.0".into(),
            0.0,
        )
        .unwrap_err();
        match err {
            Error::Compile { kernel, log, .. } => {
                assert_eq!(kernel, "nope");
                assert!(log.contains("k2") && log.contains("not in the compiled module"));
            }
            e => panic!("{e}"),
        }
        let ok = CompiledKernel::from_parts(
            "k",
            "sm_80",
            vec![1],
            REPORT.to_string(),
            vec![],
            "13.0".into(),
            0.0,
        )
        .unwrap();
        assert_eq!(ok.registers(), Some(32));
        assert!(ok.spills(), "helper spills");
        // PTX has no ptxas report and needs none.
        let ptx = CompiledKernel::from_parts(
            "x",
            "compute_90",
            vec![1],
            String::new(),
            vec![],
            "13.0".into(),
            0.0,
        )
        .unwrap();
        assert_eq!(ptx.kind, ImageKind::Ptx);
        assert_eq!(ptx.registers(), None);
    }

    #[test]
    fn options_and_arch_selection() {
        let o = compile_options(
            "sm_90a",
            &[
                ("FM_HEAD_DIM".into(), "128".into()),
                ("FM_CAUSAL".into(), String::new()),
            ],
        );
        assert_eq!(o[0], "--std=c++17");
        assert!(o.contains(&"-arch=sm_90a".to_string()));
        assert!(o.contains(&"-lineinfo".to_string()));
        assert!(o.contains(&"-default-device".to_string()));
        assert!(o.contains(&"--ptxas-options=-v".to_string()));
        assert!(o.contains(&"-DFM_HEAD_DIM=128".to_string()));
        assert!(o.contains(&"-DFM_CAUSAL".to_string()));
        assert!(!o.iter().any(|x| x.contains("fast_math")));
        let p = compile_options("compute_90", &[]);
        assert!(!p.iter().any(|x| x.contains("ptxas")));

        let sup = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(compile_arch_for(9, 0, &sup).unwrap(), "sm_90a");
        assert_eq!(compile_arch_for(8, 0, &sup).unwrap(), "sm_80");
        assert_eq!(compile_arch_for(8, 9, &sup).unwrap(), "sm_89");
        assert_eq!(compile_arch_for(13, 0, &sup).unwrap(), "compute_121");
        assert!(compile_arch_for(5, 2, &sup).is_err());
    }
}
