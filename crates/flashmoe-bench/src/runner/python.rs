//! Python baselines: PyTorch SDPA with each backend forced, FlexAttention, naive PyTorch,
//! the varlen baselines (PyTorch's `varlen_attn`, SDPA per sequence, the FlashAttention
//! and FlashInfer varlen calls) and the MoE baselines (per-expert loop, `torch._grouped_mm`,
//! dense GEMM chain), run by
//! `python/flashmoe_worker.py` and spoken to over versioned JSON lines (protocol in
//! `docs/baselines.md`).
//!
//! One worker process serves every baseline of a run. It generates the inputs itself with
//! the same counter-based generator (`python/flashmoe_inputs.py`) and reports their
//! checksum, which [`PythonImplementation::prepare`] compares with the checksum of the
//! inputs flashmoe generated: a baseline whose inputs differ is never run. Timing happens
//! in the worker with CUDA events, an L2 flush and a spin queued before the start event,
//! like the native runner; one [`Sampled::sample`] is one timed call.
//!
//! Failure behaviour: no `python3`, no torch or no CUDA in torch → [`baselines`] returns
//! `Err` with one line; a request that takes longer than its timeout kills the worker; a
//! worker that died or was killed is restarted at the next `prepare` (up to
//! [`WorkerOptions::max_restarts`] times); handles of the old worker then fail with a clear
//! error instead of hanging. Out-of-memory is reported as that cell's error.

use super::pipeline::generated_inputs_checksum;
use super::{Implementation, Outputs, Prepared, SuiteInputs};
use crate::config::Suite;
use crate::manifest::PythonManifest;
use crate::measure::Sampled;
use crate::results::ProblemSpec;
use anyhow::{anyhow, bail, Context};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Version of the JSON-lines protocol; the worker's hello must carry the same.
pub const PROTOCOL_VERSION: u64 = 1;

/// Attention baselines, in report order. The last four come from third-party packages
/// (`python/flashmoe_packages.py`: FlashAttention-4, FlashAttention-3, xFormers, FlashInfer)
/// and are left out of a run, with a note, where their package is not importable.
pub const ATTENTION_BASELINES: &[&str] = &[
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "sdpa-math",
    "flex",
    "torch-naive",
    "fa4",
    "fa3",
    "xformers",
    "flashinfer-prefill",
];

/// Decode baselines, in report order: SDPA cuDNN and flash on the dense cache (`enable_gqa`),
/// `flash_attn_with_kvcache` (flash-attn) and FlashInfer's batch decode when importable
/// (n/a with the import error otherwise). The worker receives the decode config's dense
/// attention problem ([`crate::decode::DecodeProblem::dense`]): the same inputs.
pub const DECODE_BASELINES: &[&str] = &[
    "sdpa-cudnn",
    "sdpa-flash",
    "fa-kvcache",
    "flashinfer-decode",
];

/// Varlen baselines, in report order, on the packed inputs (q `(total_q, Hq, D)`, k/v
/// `(total_k, Hkv, D)`, int32 cu_seqlens on the device; the worker receives the varlen
/// config itself): PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2
/// varlen inside PyTorch), SDPA with cuDNN forced called once per sequence from a Python
/// loop (what a user without a varlen kernel writes; host dispatch included), and, when
/// their package is importable (n/a with the import error otherwise), FlashAttention-4's
/// `flash_attn.cute.flash_attn_varlen_func`, FlashAttention-3's
/// `flash_attn_interface.flash_attn_varlen_func` and FlashInfer's ragged prefill.
pub const VARLEN_BASELINES: &[&str] = &[
    "torch-varlen",
    "sdpa-cudnn-loop",
    "fa4-varlen",
    "fa3-varlen",
    "flashinfer-varlen",
];

/// MLA decode baselines, in report order (the worker receives the MLA config itself: q
/// `[B, Sq, Hq, 576]`, the dense latent `[B, Sk, 576]`; o `[B, Sq, Hq, 512]`, lse
/// `[B, Sq, Hq]`): SDPA on the latent gathered into a dense cache (K = the latent, V its
/// first 512 columns, one KV head broadcast with `enable_gqa`, causal bottom-right for
/// Sq > 1), and, when importable (n/a with the import error otherwise), FlashInfer's
/// `BatchMLAPagedAttentionWrapper` and DeepSeek's FlashMLA (`flash_mla`) on the latent
/// viewed as pages of 64.
pub const MLA_BASELINES: &[&str] = &["sdpa-mla", "flashinfer-mla", "flash-mla"];

/// MoE baselines, in report order; the last three come from third-party packages (vLLM's
/// and SGLang's Triton `fused_experts`, QuACK's varlen grouped GEMM), run when importable.
pub const MOE_BASELINES: &[&str] = &[
    "moe-naive-loop",
    "moe-grouped-mm",
    "moe-dense-chain",
    "vllm-fused-moe",
    "sglang-fused-moe",
    "quack-grouped-gemm",
];

/// Gradient baselines (`bench --pass bwd|fwd+bwd`; names of the forward suites' lists,
/// `python/flashmoe_grad.py`): the backward of SDPA with the flash, cuDNN or efficient
/// backend forced over a retained forward graph (`torch.autograd.grad`; window and
/// softcap configs n/a), FlexAttention's and FlashAttention-4's (`fa4`, and `fa4-det` with
/// its deterministic backward, when importable; windows and softcap too), and the MoE layer's
/// autograd backward through `torch._grouped_mm` or the per-expert loop (configs training
/// the aux/z losses n/a). Varlen: none yet.
pub const GRAD_ATTENTION_BASELINES: &[&str] = &[
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "flex",
    "fa4",
    "fa4-det",
];
pub const GRAD_MOE_BASELINES: &[&str] = &["moe-grouped-mm", "moe-naive-loop"];

/// Baselines whose timed call is a throughput ceiling, not the layer: their output is not
/// comparable with the reference (run_for_check returns an empty output for them).
pub const CEILING_ONLY: &[&str] = &["moe-dense-chain"];

/// Lines of the worker's stderr kept for error messages.
const STDERR_TAIL_LINES: usize = 40;

/// How to start the worker and how long to wait for it.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// The Python interpreter (`python3`, or the `--python` path).
    pub python: PathBuf,
    /// The worker script; `None` → [`locate_worker_script`].
    pub script: Option<PathBuf>,
    /// `Some("cpu")` runs the worker's development mode (host clock, no GPU); `None` → CUDA.
    pub device: Option<String>,
    /// Extra environment variables for the worker process.
    pub env: Vec<(String, String)>,
    /// Wait for the hello (importing torch and initialising CUDA take seconds).
    pub start_timeout: Duration,
    /// Per-request limit for run_for_check, sample, release.
    pub request_timeout: Duration,
    /// Per-request limit for prepare (input generation, probing, torch.compile).
    pub prepare_timeout: Duration,
    /// L2-flush buffer size to use; `None` keeps the worker's default (2 × L2, ≥ 100 MiB).
    pub flush_bytes: Option<u64>,
    /// Restarts allowed after crashes, hangs or kills, for the whole run.
    pub max_restarts: usize,
    /// Arguments to start `python` with instead of the worker script: another program
    /// speaking the protocol (an old build's `flashmoe serve`, see [`old_build`]).
    pub args: Option<Vec<String>>,
    /// Environment variables removed for the worker process.
    pub env_remove: Vec<String>,
}

impl WorkerOptions {
    pub fn new(python: impl Into<PathBuf>) -> Self {
        WorkerOptions {
            python: python.into(),
            script: None,
            device: None,
            env: Vec::new(),
            start_timeout: Duration::from_secs(180),
            request_timeout: Duration::from_secs(120),
            prepare_timeout: Duration::from_secs(600),
            flush_bytes: None,
            max_restarts: 8,
            args: None,
            env_remove: Vec::new(),
        }
    }
}

/// Versions the worker reports.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WorkerVersions {
    #[serde(default)]
    pub python: String,
    #[serde(default)]
    pub numpy: String,
    #[serde(default)]
    pub torch: String,
    #[serde(default)]
    pub cuda: String,
    #[serde(default)]
    pub cudnn: String,
    #[serde(default)]
    pub triton: String,
}

/// The device the worker runs on.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WorkerGpu {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub compute_capability: String,
    #[serde(default)]
    pub memory_bytes: u64,
    #[serde(default)]
    pub l2_bytes: u64,
    #[serde(default)]
    pub sm_count: u64,
}

/// The worker's first line.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Hello {
    pub protocol: u64,
    pub ok: bool,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub versions: WorkerVersions,
    #[serde(default)]
    pub gpu: Option<WorkerGpu>,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub timer: Option<String>,
    #[serde(default)]
    pub flush_bytes: Option<u64>,
    #[serde(default)]
    pub implementations: Vec<String>,
    /// Baselines whose package is not importable, with the reason.
    #[serde(default)]
    pub unavailable: std::collections::BTreeMap<String, String>,
    /// Third-party baseline packages found ("distribution version").
    #[serde(default)]
    pub packages: Vec<String>,
    #[serde(default)]
    pub pid: Option<u32>,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerError {
    /// The implementation cannot run this config ("n/a: reason").
    NotApplicable(String),
    /// The device ran out of memory; the worker freed what it could and goes on.
    OutOfMemory(String),
    /// The request failed inside the worker (Python exception); the worker goes on.
    Failed(String),
    /// No reply within the limit: the worker was killed.
    Timeout { op: String, secs: f64 },
    /// The worker is gone (crashed, exited, killed earlier).
    Died(String),
    /// The worker said something that is not the protocol: it was killed.
    Protocol(String),
}

impl fmt::Display for WorkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerError::NotApplicable(why) => write!(f, "n/a: {why}"),
            WorkerError::OutOfMemory(why) => write!(f, "out of memory in the Python worker: {why}"),
            WorkerError::Failed(why) => write!(f, "the Python worker failed: {why}"),
            WorkerError::Timeout { op, secs } => write!(
                f,
                "the Python worker did not answer '{op}' within {secs:.0} s: killed (restarted at the next config)"
            ),
            WorkerError::Died(why) => write!(f, "the Python worker is gone: {why}"),
            WorkerError::Protocol(why) => write!(f, "the Python worker broke the protocol: {why}"),
        }
    }
}

impl std::error::Error for WorkerError {}

enum LineMsg {
    Line(String),
    Eof,
    Failed(String),
}

/// A running `flashmoe_worker.py` process.
pub struct PythonWorker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<LineMsg>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    hello: Hello,
    next_id: u64,
    dead: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where the worker script is: `$FLASHMOE_WORKER`, else `python/flashmoe_worker.py` next to
/// the running binary or one of its ancestors (a `target/release/flashmoe` inside the
/// repository finds the repository's), else in the current directory, else in the source
/// tree this crate was built from, else the copy the binary carries (`runner::scripts`,
/// written into the kernel cache directory).
pub fn locate_worker_script() -> Result<PathBuf, String> {
    locate_python_script("flashmoe_worker.py", "FLASHMOE_WORKER")
}

/// Where one of the lab's Python scripts is: `$ENV_VAR`, else `python/NAME` searched as
/// [`locate_worker_script`] describes.
pub fn locate_python_script(name: &str, env_var: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{env_var}={} is not a file", p.display()))
        };
    }
    let rel = Path::new("python").join(name);
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).take(5).map(|d| d.join(&rel)));
    }
    if let Ok(cwd) = std::env::current_dir() {
        candidates.push(cwd.join(&rel));
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(&rel),
    );
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    // An installed binary: the copy it carries, written into the kernel cache directory.
    super::scripts::embedded_script(name, &flashmoe::gpu::default_cache_dir()).unwrap_or_else(
        || {
            Err(format!(
                "python/{name} not found (looked next to the binary, in the current directory and \
             in the source tree, and the binary does not carry it): set {env_var} to its path"
            ))
        },
    )
}

fn status_text(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match s.code() {
            Some(c) => format!("exit status {c}"),
            None => format!("{s}"),
        },
        None => "still running".into(),
    }
}

impl PythonWorker {
    /// Start the worker and read its hello. `Err` is one line saying why baselines cannot
    /// run (no interpreter, no torch, no CUDA in torch, protocol mismatch, ...).
    pub fn start(options: &WorkerOptions) -> Result<PythonWorker, String> {
        let mut cmd = Command::new(&options.python);
        let script = match &options.args {
            Some(args) => {
                cmd.args(args);
                PathBuf::from(args.join(" "))
            }
            None => {
                let script = match &options.script {
                    Some(s) => s.clone(),
                    None => locate_worker_script()?,
                };
                cmd.arg(&script);
                if let Some(dev) = &options.device {
                    cmd.arg("--device").arg(dev);
                }
                script
            }
        };
        for k in &options.env_remove {
            cmd.env_remove(k);
        }
        cmd.envs(options.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "no Python interpreter at '{}' ({e}): install python3 with torch, or pass --python PATH",
                    options.python.display()
                )
            } else {
                format!("cannot start the Python worker with '{}': {e}", options.python.display())
            }
        })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");

        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("flashmoe-worker-stdout".into())
            .spawn(move || {
                let mut r = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match r.read_line(&mut line) {
                        Ok(0) => {
                            let _ = tx.send(LineMsg::Eof);
                            return;
                        }
                        Ok(_) => {
                            if tx.send(LineMsg::Line(line)).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(LineMsg::Failed(e.to_string()));
                            return;
                        }
                    }
                }
            })
            .map_err(|e| format!("cannot start a reader thread: {e}"))?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail2 = Arc::clone(&tail);
        let echo = std::env::var_os("FLASHMOE_WORKER_LOG").is_some();
        std::thread::Builder::new()
            .name("flashmoe-worker-stderr".into())
            .spawn(move || {
                let mut r = BufReader::new(stderr);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match r.by_ref().take(64 * 1024).read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {
                            let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                            if echo {
                                eprintln!("[python worker] {line}");
                            }
                            let mut t = lock(&tail2);
                            if t.len() == STDERR_TAIL_LINES {
                                t.pop_front();
                            }
                            t.push_back(line);
                        }
                    }
                }
            })
            .map_err(|e| format!("cannot start a reader thread: {e}"))?;

        let mut worker = PythonWorker {
            child,
            stdin,
            lines: rx,
            stderr_tail: tail,
            hello: Hello::default(),
            next_id: 1,
            dead: None,
        };
        let first = match worker.lines.recv_timeout(options.start_timeout) {
            Ok(LineMsg::Line(l)) => l,
            Ok(LineMsg::Eof) | Ok(LineMsg::Failed(_)) | Err(RecvTimeoutError::Disconnected) => {
                let status = worker.wait_briefly();
                worker.dead = Some("it exited".into());
                return Err(format!(
                    "the Python worker ({} {}) exited before its hello ({}){}",
                    options.python.display(),
                    script.display(),
                    status_text(status),
                    worker.tail_suffix()
                ));
            }
            Err(RecvTimeoutError::Timeout) => {
                worker.kill();
                return Err(format!(
                    "the Python worker sent no hello within {:.0} s: killed{}",
                    options.start_timeout.as_secs_f64(),
                    worker.tail_suffix()
                ));
            }
        };
        let hello: Hello = match serde_json::from_str(first.trim()) {
            Ok(h) => h,
            Err(e) => {
                worker.kill();
                return Err(format!(
                    "the Python worker's first line is not its hello ({e}): {:?}{}",
                    truncate(first.trim(), 200),
                    worker.tail_suffix()
                ));
            }
        };
        if hello.protocol != PROTOCOL_VERSION {
            worker.kill();
            return Err(format!(
                "the Python worker speaks protocol {} but flashmoe speaks {PROTOCOL_VERSION}: use the worker from the same checkout",
                hello.protocol
            ));
        }
        if !hello.ok {
            let reason = hello.reason.clone().unwrap_or_else(|| {
                "the Python worker cannot run baselines (no reason given)".into()
            });
            worker.dead = Some(reason.clone());
            worker.wait_briefly();
            return Err(reason);
        }
        worker.hello = hello;
        if let Some(b) = options.flush_bytes {
            worker
                .configure(Some(b))
                .map_err(|e| format!("configuring the Python worker failed: {e}"))?;
        }
        Ok(worker)
    }

    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The manifest fields of this worker.
    pub fn manifest(&self) -> PythonManifest {
        let v = &self.hello.versions;
        PythonManifest {
            python: v.python.clone(),
            torch: v.torch.clone(),
            cuda: v.cuda.clone(),
            cudnn: v.cudnn.clone(),
            triton: v.triton.clone(),
            gpu_name: self
                .hello
                .gpu
                .as_ref()
                .map(|g| g.name.clone())
                .unwrap_or_default(),
            packages: self.hello.packages.clone(),
            skipped: Vec::new(),
        }
    }

    /// Whether the worker can still take requests.
    pub fn is_alive(&mut self) -> bool {
        if self.dead.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(None) => true,
            Ok(Some(s)) => {
                self.dead = Some(format!("it exited ({})", status_text(Some(s))));
                false
            }
            Err(e) => {
                self.dead = Some(format!("its status cannot be read: {e}"));
                false
            }
        }
    }

    /// The last lines the worker wrote to stderr.
    pub fn stderr_tail(&self) -> Vec<String> {
        lock(&self.stderr_tail).iter().cloned().collect()
    }

    fn tail_suffix(&self) -> String {
        // Give the reader thread a moment to collect a traceback printed just before exit.
        std::thread::sleep(Duration::from_millis(50));
        let t = self.stderr_tail();
        let interesting: Vec<&String> = t.iter().filter(|l| !l.trim().is_empty()).collect();
        match interesting.len() {
            0 => String::new(),
            n => {
                let last: Vec<&str> = interesting[n.saturating_sub(3)..]
                    .iter()
                    .map(|s| s.trim())
                    .collect();
                format!("; its stderr ends: {}", truncate(&last.join(" | "), 600))
            }
        }
    }

    fn wait_briefly(&mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + Duration::from_millis(2000);
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) => return Some(s),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = self.child.kill();
                    return self.child.wait().ok();
                }
            }
        }
    }

    /// Kill the process now (after a timeout or a protocol violation).
    pub fn kill(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.dead.is_none() {
            self.dead = Some("it was killed".into());
        }
    }

    /// Send one request and wait up to `timeout` for its reply (`fields` must be an object).
    pub fn request(
        &mut self,
        op: &str,
        fields: Value,
        timeout: Duration,
    ) -> Result<Value, WorkerError> {
        if let Some(why) = &self.dead {
            return Err(WorkerError::Died(why.clone()));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut obj = match fields {
            Value::Object(m) => m,
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(WorkerError::Protocol(format!(
                    "request fields must be an object, got {other}"
                )))
            }
        };
        obj.insert("id".into(), json!(id));
        obj.insert("op".into(), json!(op));
        let line = Value::Object(obj).to_string() + "\n";
        let written = match self.stdin.as_mut() {
            Some(w) => w.write_all(line.as_bytes()).and_then(|_| w.flush()),
            None => Err(std::io::Error::other("stdin closed")),
        };
        if let Err(e) = written {
            let status = self.wait_briefly();
            let why = format!(
                "it stopped reading requests ({e}; {}){}",
                status_text(status),
                self.tail_suffix()
            );
            self.dead = Some(why.clone());
            return Err(WorkerError::Died(why));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(LineMsg::Line(l)) => {
                    let v: Value = match serde_json::from_str(l.trim()) {
                        Ok(v) => v,
                        Err(_) => {
                            let why = format!(
                                "unexpected output {:?} while waiting for '{op}'",
                                truncate(l.trim(), 200)
                            );
                            self.kill();
                            self.dead = Some(why.clone());
                            return Err(WorkerError::Protocol(why));
                        }
                    };
                    if v.get("id").and_then(Value::as_u64) != Some(id) {
                        if v.get("id").is_none_or(Value::is_null)
                            && v.get("kind").and_then(Value::as_str) == Some("protocol")
                        {
                            let why = v
                                .get("error")
                                .and_then(Value::as_str)
                                .unwrap_or("?")
                                .to_string();
                            return Err(WorkerError::Protocol(why));
                        }
                        continue; // a reply to an earlier request: skip it
                    }
                    if v.get("ok").and_then(Value::as_bool) == Some(true) {
                        return Ok(v);
                    }
                    let why = v
                        .get("error")
                        .and_then(Value::as_str)
                        .unwrap_or("no error message")
                        .to_string();
                    return Err(match v.get("kind").and_then(Value::as_str) {
                        Some("na") => WorkerError::NotApplicable(why),
                        Some("oom") => WorkerError::OutOfMemory(why),
                        Some("protocol") => WorkerError::Protocol(why),
                        _ => WorkerError::Failed(why),
                    });
                }
                Ok(LineMsg::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    let status = self.wait_briefly();
                    let why = format!(
                        "it exited during '{op}' ({}){}",
                        status_text(status),
                        self.tail_suffix()
                    );
                    self.dead = Some(why.clone());
                    return Err(WorkerError::Died(why));
                }
                Ok(LineMsg::Failed(e)) => {
                    let status = self.wait_briefly();
                    let why = format!(
                        "its output could not be read during '{op}' ({e}; {}){}",
                        status_text(status),
                        self.tail_suffix()
                    );
                    self.dead = Some(why.clone());
                    return Err(WorkerError::Died(why));
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.kill();
                    self.dead = Some(format!("it was killed after '{op}' timed out"));
                    return Err(WorkerError::Timeout {
                        op: op.to_string(),
                        secs: timeout.as_secs_f64(),
                    });
                }
            }
        }
    }

    /// Set the L2-flush buffer size (bytes) the worker writes before each sample.
    pub fn configure(&mut self, flush_bytes: Option<u64>) -> Result<Value, WorkerError> {
        self.request(
            "configure",
            json!({ "flush_bytes": flush_bytes }),
            Duration::from_secs(60),
        )
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        if self.dead.is_none() {
            if let Some(w) = self.stdin.as_mut() {
                let _ = w
                    .write_all(format!("{{\"id\":{},\"op\":\"quit\"}}\n", self.next_id).as_bytes())
                    .and_then(|_| w.flush());
            }
        }
        self.stdin = None;
        self.wait_briefly();
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "..."
    }
}

/// The worker shared by every baseline of a run, restarted after a failure.
struct Shared {
    options: WorkerOptions,
    seed: u64,
    worker: Option<PythonWorker>,
    /// Bumped at every (re)start: handles of an older worker are gone.
    incarnation: u64,
    restarts: usize,
    /// (problem id, address of the inputs, checksum) of the last inputs checked.
    checksum_cache: Option<(String, usize, String)>,
}

impl Shared {
    fn expected_checksum(&mut self, problem: &ProblemSpec, inputs: &SuiteInputs) -> String {
        let key = (problem.id(), inputs as *const SuiteInputs as usize);
        if let Some((id, addr, sum)) = &self.checksum_cache {
            if *id == key.0 && *addr == key.1 {
                return sum.clone();
            }
        }
        let sum = generated_inputs_checksum(problem, self.seed, inputs);
        self.checksum_cache = Some((key.0, key.1, sum.clone()));
        sum
    }

    /// The live worker, restarting it if it died; with its incarnation.
    fn live_worker(&mut self) -> anyhow::Result<(&mut PythonWorker, u64)> {
        let alive = self.worker.as_mut().is_some_and(|w| w.is_alive());
        if !alive {
            let why = self
                .worker
                .as_ref()
                .and_then(|w| w.dead.clone())
                .unwrap_or_else(|| "it is not running".into());
            if self.restarts >= self.options.max_restarts {
                bail!(
                    "the Python worker is gone ({why}) and was already restarted {} times: baselines skipped",
                    self.restarts
                );
            }
            self.worker = None;
            self.restarts += 1;
            let w = PythonWorker::start(&self.options)
                .map_err(|e| anyhow!("the Python worker could not be restarted: {e}"))?;
            self.worker = Some(w);
            self.incarnation += 1;
        }
        let inc = self.incarnation;
        Ok((self.worker.as_mut().expect("worker just ensured"), inc))
    }
}

/// What the worker process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// `python/flashmoe_worker.py`'s baselines (and `py:` plug-ins).
    Python,
    /// An old build's implementations (`flashmoe serve`), named [`OLD_PREFIX`] + its name.
    OldBuild,
    /// This build's own implementations served by a child `flashmoe serve` in a
    /// `bench --against` run, so both builds are timed in a process of the same kind.
    ThisBuild,
    /// A user's Python callable (`py:MODULE:FUNCTION`), hosted by
    /// `python/flashmoe_plugins.py`; attention problems only.
    Plugin,
}

/// Prefix of a Python plug-in's implementation name: `py:MODULE:FUNCTION`.
pub const PLUGIN_PREFIX: &str = "py:";

pub use crate::results::OLD_PREFIX;

/// One implementation served by a worker process (a Python baseline such as `sdpa-flash`,
/// or an old build's kernel), sharing the run's worker.
pub struct PythonImplementation {
    name: String,
    /// Its name in the worker.
    remote: String,
    served: Served,
    shared: Arc<Mutex<Shared>>,
}

impl PythonImplementation {
    /// Whether its timed call is a ceiling whose output is not checked (`moe-dense-chain`).
    pub fn ceiling_only(&self) -> bool {
        CEILING_ONLY.contains(&self.name.as_str())
    }
}

/// The problem as the worker receives it: a decode config goes as its dense attention.
fn worker_problem(problem: &ProblemSpec) -> ProblemSpec {
    match problem {
        ProblemSpec::Decode(p) => ProblemSpec::Attention(p.dense()),
        other => other.clone(),
    }
}

impl Implementation for PythonImplementation {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &str {
        match self.served {
            Served::Python => "python",
            Served::OldBuild => "old-build",
            Served::ThisBuild => "this-build (served)",
            Served::Plugin => "python-plugin",
        }
    }

    fn supports(&self, problem: &ProblemSpec) -> Result<(), String> {
        match (self.served, problem) {
            // The build answers "n/a: why" itself.
            (Served::OldBuild | Served::ThisBuild, _) => return Ok(()),
            (Served::Plugin, ProblemSpec::Attention(_)) => return Ok(()),
            (Served::Plugin, _) => return Err("plug-ins run attention problems only".into()),
            (Served::Python, _) => {}
        }
        let (list, kind) = match problem {
            ProblemSpec::Attention(_) => (ATTENTION_BASELINES, "attention"),
            ProblemSpec::Moe(_) => (MOE_BASELINES, "MoE"),
            ProblemSpec::Decode(_) => (DECODE_BASELINES, "decode"),
            ProblemSpec::Varlen(_) => (VARLEN_BASELINES, "varlen"),
            ProblemSpec::Mla(_) => (MLA_BASELINES, "MLA"),
            ProblemSpec::E2e(_) => return Err("end-to-end models run in `bench e2e`".into()),
            ProblemSpec::Grad(g) => match &g.layer {
                crate::grad::GradLayer::Attention(a) => {
                    if (a.has_window() || a.softcap > 0.0)
                        && !["flex", "fa4", "fa4-det"].contains(&self.name.as_str())
                    {
                        return Err("the SDPA backward baselines have no window or softcap".into());
                    }
                    (GRAD_ATTENTION_BASELINES, "attention-gradient")
                }
                crate::grad::GradLayer::Moe(_) if g.trains_losses() => {
                    return Err("the PyTorch MoE baselines compute no aux / z-loss".into())
                }
                crate::grad::GradLayer::Moe(_) if g.router != crate::grad::RouterShape::Random => {
                    return Err("a shaped router weight is the lab's, not the worker's".into())
                }
                crate::grad::GradLayer::Moe(_) => (GRAD_MOE_BASELINES, "MoE-gradient"),
                crate::grad::GradLayer::Varlen(_) => (&[][..], "varlen-gradient"),
            },
        };
        if let ProblemSpec::Decode(p) = problem {
            if !p.is_plain() {
                return Err(
                    "the dense baselines run the plain causal step (no window, softcap or \
                     ragged lengths)"
                        .into(),
                );
            }
        }
        if list.contains(&self.name.as_str()) {
            Ok(())
        } else {
            Err(format!("{} is not a {kind} baseline", self.name))
        }
    }

    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>> {
        self.supports(problem).map_err(|e| anyhow!("n/a: {e}"))?;
        let mut sh = lock(&self.shared);
        let expected = sh.expected_checksum(problem, inputs);
        let seed = sh.seed;
        let (prepare_timeout, request_timeout) =
            (sh.options.prepare_timeout, sh.options.request_timeout);
        let (worker, incarnation) = sh.live_worker()?;
        let sent = match self.served {
            Served::Python | Served::Plugin => worker_problem(problem),
            Served::OldBuild | Served::ThisBuild => problem.clone(),
        };
        let req = json!({ "impl": self.remote, "problem": sent, "seed": seed });
        let v = worker.request("prepare", req, prepare_timeout)?;
        let handle = v
            .get("handle")
            .and_then(Value::as_u64)
            .ok_or_else(|| anyhow!("the Python worker's prepare reply has no handle"))?;
        let got = v
            .get("input_checksum")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if got != expected {
            let _ = worker.request("release", json!({ "handle": handle }), request_timeout);
            bail!(
                "inputs differ: the Python worker generated inputs with checksum {got}, flashmoe's are {expected} \
                 (different generator or seed): not run"
            );
        }
        let notes = v
            .get("notes")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Box::new(PythonPrepared {
            shared: Arc::clone(&self.shared),
            name: self.name.clone(),
            problem: worker_problem(problem),
            handle,
            incarnation,
            ceiling_only: v
                .get("ceiling_only")
                .and_then(Value::as_bool)
                .unwrap_or(false)
                || self.ceiling_only(),
            compile_ms: v.get("compile_ms").and_then(Value::as_f64),
            notes,
            peak_extra: None,
            request_timeout,
        }))
    }
}

/// A baseline prepared in the worker for one config.
pub struct PythonPrepared {
    shared: Arc<Mutex<Shared>>,
    name: String,
    problem: ProblemSpec,
    handle: u64,
    incarnation: u64,
    ceiling_only: bool,
    compile_ms: Option<f64>,
    notes: Vec<String>,
    peak_extra: Option<u64>,
    request_timeout: Duration,
}

impl PythonPrepared {
    /// What the worker noted about this baseline (layout copies, LSE availability, compile
    /// time...), for the report.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }
    /// torch.compile time of the config (flex), excluded from the samples.
    pub fn compile_ms(&self) -> Option<f64> {
        self.compile_ms
    }
    pub fn ceiling_only(&self) -> bool {
        self.ceiling_only
    }

    fn call(&self, op: &str, fields: Value) -> anyhow::Result<Value> {
        let mut sh = lock(&self.shared);
        if sh.incarnation != self.incarnation {
            bail!(
                "the Python worker was restarted after a failure: prepared '{}' is gone",
                self.name
            );
        }
        let w = sh
            .worker
            .as_mut()
            .ok_or_else(|| anyhow!("the Python worker is not running"))?;
        Ok(w.request(op, fields, self.request_timeout)?)
    }
}

fn file_field(files: &Value, name: &str) -> Option<PathBuf> {
    files.get(name)?.get("path")?.as_str().map(PathBuf::from)
}

fn read_le<T>(
    path: &Path,
    expected: usize,
    what: &str,
    conv: fn([u8; 4]) -> T,
) -> anyhow::Result<Vec<T>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading {what} from {}", path.display()))?;
    if bytes.len() != expected * 4 {
        bail!(
            "the Python worker wrote {} values of {what}, expected {expected}",
            bytes.len() / 4
        );
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| conv([c[0], c[1], c[2], c[3]]))
        .collect())
}

impl Sampled for PythonPrepared {
    fn sample(&mut self) -> anyhow::Result<f64> {
        let v = self.call("sample", json!({ "handle": self.handle, "n": 1 }))?;
        v.get("ms")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_f64)
            .ok_or_else(|| anyhow!("the Python worker's sample reply has no time"))
    }
}

impl Prepared for PythonPrepared {
    fn notes(&self) -> Vec<String> {
        let mut notes = PythonPrepared::notes(self).to_vec();
        if let Some(ms) = self.compile_ms() {
            notes.push(format!("compile {ms:.0} ms (excluded from timing)"));
        }
        notes
    }
    fn ceiling_only(&self) -> bool {
        PythonPrepared::ceiling_only(self)
    }
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        let dir = tempfile::Builder::new()
            .prefix("flashmoe-python-")
            .tempdir()
            .context("creating a temporary directory for the Python worker's outputs")?;
        let v = self.call(
            "run_for_check",
            json!({ "handle": self.handle, "dir": dir.path().to_string_lossy() }),
        )?;
        self.peak_extra = v.get("peak_extra_bytes").and_then(Value::as_u64);
        if let Some(n) = v.get("notes").and_then(Value::as_array) {
            self.notes = n
                .iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect();
        }
        let files = v.get("files").cloned().unwrap_or(Value::Null);
        let missing = |n: &str| anyhow!("the Python worker wrote no '{n}' output");
        let f32_of = |b: [u8; 4]| f32::from_le_bytes(b);
        let out = match &self.problem {
            ProblemSpec::Attention(p) => {
                let o = read_le(
                    &file_field(&files, "o").ok_or_else(|| missing("o"))?,
                    p.q_elems(),
                    "O",
                    f32_of,
                )?;
                // No LSE (the public SDPA API returns none): an empty vector; the gate then
                // checks O only.
                let lse = match file_field(&files, "lse") {
                    Some(path) => read_le(&path, p.lse_elems(), "LSE", f32_of)?,
                    None => Vec::new(),
                };
                Outputs::Attention { o, lse }
            }
            ProblemSpec::Decode(_) => bail!("a decode config reached the worker undensified"),
            ProblemSpec::E2e(_) => bail!("an end-to-end model reached the kernel worker"),
            // One file per gradient, named as `GradProblem::tensors`.
            ProblemSpec::Grad(p) => Outputs::Gradients(
                p.tensors()
                    .iter()
                    .map(|t| {
                        let path = file_field(&files, t.name).ok_or_else(|| missing(t.name))?;
                        Ok(crate::grad::GradTensor {
                            name: t.name.to_string(),
                            values: read_le(&path, t.len, t.name, f32_of)?,
                        })
                    })
                    .collect::<anyhow::Result<_>>()?,
            ),
            ProblemSpec::Mla(p) => {
                let o = read_le(
                    &file_field(&files, "o").ok_or_else(|| missing("o"))?,
                    p.o_elems(),
                    "O",
                    f32_of,
                )?;
                let lse = match file_field(&files, "lse") {
                    Some(path) => read_le(&path, p.lse_elems(), "LSE", f32_of)?,
                    None => Vec::new(),
                };
                Outputs::Attention { o, lse }
            }
            // The packed layout: o (total_q, Hq, D), lse (Hq, total_q).
            ProblemSpec::Varlen(p) => {
                let (tq, hq) = (p.total_q(), p.heads_q);
                let o = read_le(
                    &file_field(&files, "o").ok_or_else(|| missing("o"))?,
                    tq * hq * p.head_dim,
                    "O",
                    f32_of,
                )?;
                let lse = match file_field(&files, "lse") {
                    Some(path) => read_le(&path, hq * tq, "LSE", f32_of)?,
                    None => Vec::new(),
                };
                Outputs::Attention { o, lse }
            }
            ProblemSpec::Moe(p) => {
                if self.ceiling_only {
                    // Timing-only ceiling: its output is not the layer's (see CEILING_ONLY).
                    Outputs::Moe {
                        out: Vec::new(),
                        topk_ids: None,
                        losses: None,
                    }
                } else {
                    let out = read_le(
                        &file_field(&files, "out").ok_or_else(|| missing("out"))?,
                        p.tokens * p.hidden,
                        "the MoE output",
                        f32_of,
                    )?;
                    let ids = read_le(
                        &file_field(&files, "topk_ids").ok_or_else(|| missing("topk_ids"))?,
                        p.tokens * p.top_k,
                        "top-k ids",
                        u32::from_le_bytes,
                    )?;
                    // The Python baselines do not compute the auxiliary losses; an old build
                    // does and returns them.
                    let losses = v
                        .get("losses")
                        .and_then(Value::as_array)
                        .and_then(|l| Some((l.first()?.as_f64()?, l.get(1)?.as_f64()?)));
                    Outputs::Moe {
                        out,
                        topk_ids: Some(ids),
                        losses,
                    }
                }
            }
        };
        drop(dir);
        Ok(out)
    }

    fn peak_extra_bytes(&self) -> Option<u64> {
        self.peak_extra
    }
}

impl Drop for PythonPrepared {
    fn drop(&mut self) {
        let mut sh = lock(&self.shared);
        if sh.incarnation == self.incarnation {
            if let Some(w) = sh.worker.as_mut() {
                if w.dead.is_none() {
                    let _ = w.request(
                        "release",
                        json!({ "handle": self.handle }),
                        self.request_timeout,
                    );
                }
            }
        }
    }
}

/// Start the worker and return one implementation per baseline of `suite`, with the
/// worker's versions for the manifest. `Err` is one line saying why no baseline can run
/// (e.g. "torch not installed for /usr/bin/python3 (No module named 'torch')").
///
/// `seed` must be the seed the run generates its inputs with
/// (`MeasureSettings::seed`): the worker generates the same inputs from it, and each
/// `prepare` checks that the checksums agree.
pub fn baselines(
    suite: Suite,
    python: &Path,
    seed: u64,
) -> Result<(Vec<Box<dyn Implementation>>, PythonManifest), String> {
    baselines_with(suite, WorkerOptions::new(python), seed)
}

/// [`baselines`] with explicit worker options (script path, timeouts, flush size...).
pub fn baselines_with(
    suite: Suite,
    options: WorkerOptions,
    seed: u64,
) -> Result<(Vec<Box<dyn Implementation>>, PythonManifest), String> {
    let worker = PythonWorker::start(&options)?;
    let mut manifest = worker.manifest();
    let all = match suite {
        Suite::Attention => ATTENTION_BASELINES,
        Suite::Moe => MOE_BASELINES,
        Suite::Decode => DECODE_BASELINES,
        Suite::Varlen => VARLEN_BASELINES,
        Suite::Mla => MLA_BASELINES,
    };
    // A baseline whose package is missing is left out of the run, with the reason.
    let unavailable = &worker.hello().unavailable;
    let mut names = Vec::new();
    for n in all {
        match unavailable.get(*n) {
            Some(why) => manifest.skipped.push(format!("{n}: {why}")),
            None => names.push(*n),
        }
    }
    let shared = Arc::new(Mutex::new(Shared {
        options,
        seed,
        worker: Some(worker),
        incarnation: 0,
        restarts: 0,
        checksum_cache: None,
    }));
    let impls = names
        .iter()
        .map(|n| {
            Box::new(PythonImplementation {
                name: (*n).to_string(),
                remote: (*n).to_string(),
                served: Served::Python,
                shared: Arc::clone(&shared),
            }) as Box<dyn Implementation>
        })
        .collect();
    Ok((impls, manifest))
}

/// Start the plug-in host (`python/flashmoe_plugins.py`, next to the worker script) with
/// `python` and return one implementation per `py:MODULE:FUNCTION` spec. `cuda` hosts them
/// on the GPU (torch tensors, CUDA events after an L2 flush of `flush_bytes`), otherwise on
/// the CPU (numpy arrays, host clock; numpy is all it needs). `Err` is one line.
pub fn plugins(
    specs: &[String],
    python: &Path,
    cuda: bool,
    flush_bytes: Option<u64>,
    seed: u64,
) -> Result<Vec<Box<dyn Implementation>>, String> {
    for s in specs {
        let parts: Vec<&str> = s.splitn(3, ':').collect();
        if parts.len() != 3 || parts[0] != "py" || parts[1].is_empty() || parts[2].is_empty() {
            return Err(format!(
                "'{s}' is not a plug-in: expected py:MODULE:FUNCTION"
            ));
        }
    }
    let script = match std::env::var_os("FLASHMOE_PLUGIN_HOST") {
        Some(p) => PathBuf::from(p),
        None => locate_worker_script()?.with_file_name("flashmoe_plugins.py"),
    };
    if !script.is_file() {
        return Err(format!(
            "the plug-in host {} is missing (set FLASHMOE_PLUGIN_HOST)",
            script.display()
        ));
    }
    let mut options = WorkerOptions::new(python);
    options.args = Some(vec![
        script.to_string_lossy().into_owned(),
        "--device".into(),
        if cuda { "cuda" } else { "cpu" }.into(),
    ]);
    options.flush_bytes = flush_bytes;
    let worker = PythonWorker::start(&options)
        .map_err(|e| format!("the Python plug-in host could not start: {e}"))?;
    let shared = Arc::new(Mutex::new(Shared {
        options,
        seed,
        worker: Some(worker),
        incarnation: 0,
        restarts: 0,
        checksum_cache: None,
    }));
    Ok(specs
        .iter()
        .map(|n| {
            Box::new(PythonImplementation {
                name: n.clone(),
                remote: n.clone(),
                served: Served::Plugin,
                shared: Arc::clone(&shared),
            }) as Box<dyn Implementation>
        })
        .collect())
}

/// Start `binary serve --suite SUITE` (an old build of flashmoe, `bench --against`) and
/// return its implementations, each named [`OLD_PREFIX`] + its name, timed in the old
/// process by its own timer. `cpu` serves the CPU implementations. The test-only slowdown
/// knob is not passed on: it applies to the new build only. `Err` is one line.
pub fn old_build(
    binary: &Path,
    suite: Suite,
    cpu: bool,
    seed: u64,
) -> Result<Vec<Box<dyn Implementation>>, String> {
    served_build(binary, suite, cpu, seed, Served::OldBuild)
}

/// This build's implementations served by a child `serve` process of the running binary,
/// under their own names: in a `bench --against` run both builds are then timed the same
/// way, each in a child process (timing one build in the driving process and the other in
/// a child measured the child up to 16% slower in A/A runs on a loaded 2-core machine).
pub fn this_build_served(
    suite: Suite,
    cpu: bool,
    seed: u64,
) -> Result<Vec<Box<dyn Implementation>>, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find the running flashmoe binary: {e}"))?;
    served_build(&exe, suite, cpu, seed, Served::ThisBuild)
}

fn served_build(
    binary: &Path,
    suite: Suite,
    cpu: bool,
    seed: u64,
    served: Served,
) -> Result<Vec<Box<dyn Implementation>>, String> {
    let mut options = WorkerOptions::new(binary);
    let mut args = vec!["serve".to_string(), "--suite".into(), suite.name().into()];
    if cpu {
        args.push("--cpu".into());
    }
    options.args = Some(args);
    if served == Served::OldBuild {
        options.env_remove = vec![crate::measure::TEST_SLOWDOWN_ENV.to_string()];
    }
    options.start_timeout = Duration::from_secs(120);
    let worker = PythonWorker::start(&options).map_err(|e| {
        format!(
            "the old build {} could not serve ({e}); --against needs a flashmoe binary that has \
             the hidden `serve` command (built from the commit that added it or later)",
            binary.display()
        )
    })?;
    let names = worker.hello().implementations.clone();
    let shared = Arc::new(Mutex::new(Shared {
        options,
        seed,
        worker: Some(worker),
        incarnation: 0,
        restarts: 0,
        checksum_cache: None,
    }));
    Ok(names
        .into_iter()
        .map(|n| {
            Box::new(PythonImplementation {
                name: match served {
                    Served::OldBuild => format!("{OLD_PREFIX}{n}"),
                    _ => n.clone(),
                },
                remote: n,
                served,
                shared: Arc::clone(&shared),
            }) as Box<dyn Implementation>
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_lists_match_the_worker() {
        let src = include_str!("../../../../python/flashmoe_worker.py");
        for n in ATTENTION_BASELINES
            .iter()
            .chain(MOE_BASELINES)
            .chain(DECODE_BASELINES)
            .chain(VARLEN_BASELINES)
        {
            assert!(
                src.contains(&format!("\"{n}\"")),
                "{n} missing from the worker"
            );
        }
        assert!(src.contains(&format!("PROTOCOL_VERSION = {PROTOCOL_VERSION}")));
        // The package baselines (worker lists them; flashmoe_packages.py knows their module).
        let pk = include_str!("../../../../python/flashmoe_packages.py");
        for n in ["fa4", "fa3", "xformers", "flashinfer-prefill"]
            .iter()
            .chain(&["vllm-fused-moe", "sglang-fused-moe", "quack-grouped-gemm"])
            .chain(&["fa4-varlen", "fa3-varlen", "flashinfer-varlen"])
        {
            assert!(
                ATTENTION_BASELINES.contains(n)
                    || MOE_BASELINES.contains(n)
                    || VARLEN_BASELINES.contains(n),
                "{n}"
            );
            assert!(
                pk.contains(&format!("\"{n}\": (")),
                "{n} missing from flashmoe_packages.py"
            );
        }
    }

    #[test]
    fn errors_read_as_one_line() {
        let e = WorkerError::Timeout {
            op: "sample".into(),
            secs: 2.0,
        };
        assert!(e.to_string().contains("'sample' within 2 s"), "{e}");
        assert_eq!(WorkerError::NotApplicable("x".into()).to_string(), "n/a: x");
        assert!(!WorkerError::Died("a".into()).to_string().contains('\n'));
    }
}
