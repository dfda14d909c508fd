//! The library's error type: every failure names what went wrong and why.

/// Errors returned by flashmoe. Messages are written for the user and name the
/// offending value (shape, dtype, head dim, device, path).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A problem description that cannot be computed (zero size, bad ratio, ...).
    #[error("invalid problem: {0}")]
    InvalidProblem(String),
    /// A valid problem that this backend does not implement (head dim, dtype, arch).
    #[error("unsupported by {backend}: {reason}")]
    Unsupported { backend: String, reason: String },
    /// A buffer whose length does not match the problem.
    #[error("buffer size mismatch for {name}: expected {expected} elements, got {actual}")]
    BufferSize {
        name: String,
        expected: usize,
        actual: usize,
    },
    /// No usable GPU (no driver, no device, or the CUDA library failed to load).
    #[error("no GPU available: {0}")]
    NoGpu(String),
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA error in {context}: {message}")]
    Cuda { context: String, message: String },
    /// A kernel failed to compile; the log is included.
    #[error("kernel {kernel} failed to compile for {arch}:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidProblem(msg.into())
    }
    pub fn unsupported(backend: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Unsupported {
            backend: backend.into(),
            reason: reason.into(),
        }
    }
    pub fn cuda(context: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Error::Cuda {
            context: context.into(),
            message: message.to_string(),
        }
    }
}
