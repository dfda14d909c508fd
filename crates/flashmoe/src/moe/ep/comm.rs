//! The NCCL communicator of an expert-parallel layer: cudarc's NCCL bindings, with the
//! library opened at run time (built with the crate's `nccl` feature; without it, or
//! without libnccl, every constructor returns an error that says so and world size 1
//! still runs, needing no communicator).
//!
//! cudarc opens `libnccl.so` (or `libnccl.so.<CUDA major>`) by bare name. Python's
//! NCCL wheel ships only `libnccl.so.2`: put a `libnccl.so` link to it on
//! `LD_LIBRARY_PATH` before the process starts (`flashmoe bench moe --gpus N` does this
//! for the ranks it starts; see [`find_nccl_library`]).
//!
//! Failure handling: nothing here blocks without a deadline. The communicator is
//! nonblocking (NCCL's `config.blocking = 0`): set-up and every NCCL call return at once
//! and are then polled through `ncclCommGetAsyncError`; `Communicator::wait` polls a
//! CUDA event and that error state. On an NCCL error or past the timeout the communicator
//! is aborted (`ncclCommAbort`, which also makes NCCL's kernels return) and the error names
//! what was waited for. A peer that dies or hangs therefore gives every surviving rank an
//! error within the timeout instead of a silent hang.

use crate::error::{Error, Result};
use crate::gpu::{Device, RawStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The 128-byte NCCL unique id that every rank of a communicator must share, with a hex
/// form for passing it between processes (a file, an environment variable).
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    pub fn from_hex(s: &str) -> Result<NcclId> {
        let s = s.trim();
        if s.len() != 256 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::invalid(format!(
                "an NCCL unique id is 256 hex digits, got {} characters",
                s.len()
            )));
        }
        let mut id = [0u8; 128];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(NcclId(id))
    }
}

/// A `libnccl.so*` file to expose to ranks as `libnccl.so`: `$FLASHMOE_NCCL_LIB` (the
/// file or its directory), else the NCCL of a Python install's `nvidia-nccl` wheel found
/// under the usual site-packages roots, else the toolkit's and system library directories.
pub fn find_nccl_library() -> Option<PathBuf> {
    let pick = |dir: &std::path::Path| {
        crate::gpu::libs::find_versioned(dir, "libnccl", "libnccl.so.2")
            .into_iter()
            .next()
    };
    if let Some(p) = std::env::var_os("FLASHMOE_NCCL_LIB").map(PathBuf::from) {
        return if p.is_dir() {
            pick(&p)
        } else {
            Some(p).filter(|p| p.is_file())
        };
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    for root in ["/opt/torch/.venv/lib", "/usr/local/lib", "/usr/lib"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("python3") {
                    for sp in ["site-packages", "dist-packages"] {
                        dirs.push(e.path().join(sp).join("nvidia/nccl/lib"));
                    }
                }
            }
        }
    }
    dirs.extend(crate::gpu::libs::toolkit_lib_dirs());
    dirs.iter().filter(|d| d.is_dir()).find_map(|d| pick(d))
}

/// Whether NCCL can be used here: its version (e.g. "2.27.7"), or why not.
pub fn nccl_version() -> Result<String> {
    imp::version()
}

/// How a deadline-bound poll ended without success.
enum PollEnd {
    /// The probe reported an error.
    Failed(String),
    TimedOut,
}

/// Call `probe` until it reports done (Ok(true)), an error, or `timeout` passed: spin
/// briefly, then sleep 50 µs between probes (the waits are milliseconds; the first
/// microseconds matter for the count exchange).
fn poll(
    timeout: Duration,
    mut probe: impl FnMut() -> std::result::Result<bool, String>,
) -> std::result::Result<(), PollEnd> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        match probe() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(PollEnd::Failed(e)),
        }
        if start.elapsed() > timeout {
            return Err(PollEnd::TimedOut);
        }
        spins += 1;
        if spins < 2000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// One point-to-point transfer: (peer rank, device address, bytes).
pub type Transfer = (usize, u64, usize);

/// One rank's membership of an NCCL communicator on one device.
pub struct Communicator {
    inner: imp::Comm,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.rank, self.world)
    }
}

impl Communicator {
    /// A fresh unique id (rank 0 makes it and hands it to the others).
    pub fn new_id() -> Result<NcclId> {
        imp::new_id()
    }

    /// Join the communicator `id` as `rank` of `world` on `dev`. Blocks until every rank
    /// joined, at most `timeout` (then an error naming the rank that gave up). The same
    /// `timeout` bounds every later NCCL call and wait. `max_ctas` caps the thread blocks
    /// (SMs) NCCL's kernels take from the GEMMs they overlap (NCCL's `maxCTAs`; None: its
    /// default).
    pub fn init(
        dev: &Device,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
        max_ctas: Option<u32>,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is outside a world of {world} ranks"
            )));
        }
        let inner = imp::init(dev, id, rank, world, timeout, max_ctas)?;
        Ok(Communicator {
            inner,
            rank,
            world,
            timeout,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Gather `count` u32 from every rank: `recv[r·count..]` receives rank r's `send`.
    ///
    /// # Safety
    /// `send` holds `count` u32 and `recv` `world · count` u32 of device memory of the
    /// communicator's device, live until the stream reaches this point.
    pub unsafe fn all_gather_u32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.inner.all_gather_u32(send, recv, count, stream)
    }

    /// Enqueue one group of point-to-point transfers on `stream`: each [`Transfer`] of
    /// `sends` goes to its peer, each of `recvs` is filled from its peer.
    /// Zero-byte entries are skipped (the peer must skip its matching one too).
    ///
    /// # Safety
    /// Every address range is device memory of the communicator's device, live until the
    /// transfers complete; receive ranges are not otherwise used meanwhile.
    pub unsafe fn send_recv(
        &self,
        sends: &[Transfer],
        recvs: &[Transfer],
        stream: RawStream,
    ) -> Result<()> {
        self.inner.send_recv(sends, recvs, stream)
    }

    /// Wait until `event` completed, polling NCCL's asynchronous error state; on an NCCL
    /// error or past the timeout, abort the communicator and return an error naming
    /// `what` (the communicator is unusable afterwards).
    pub(crate) fn wait(&mut self, event: crate::gpu::raw::RawEvent, what: &str) -> Result<()> {
        let inner = &self.inner;
        let ended = poll(self.timeout, || {
            // SAFETY: `event` is a live event of the communicator's context (caller).
            match unsafe { cudarc::driver::sys::cuEventQuery(event) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(true),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {
                    inner.async_error().map(|_| false)
                }
                e => Err(format!("cuEventQuery: {e:?}")),
            }
        });
        let label = format!("rank {} of {}", self.rank, self.world);
        match ended {
            Ok(()) => Ok(()),
            Err(end) => {
                self.inner.abort();
                Err(match end {
                    PollEnd::Failed(e) => Error::cuda(
                        format!("{label}: while waiting for {what}"),
                        format!("{e}; communicator aborted"),
                    ),
                    PollEnd::TimedOut => Error::cuda(
                        format!("{label}: waiting for {what}"),
                        format!(
                            "not complete after {:.1} s (a peer died, hung or called with a \
                             different sequence of layers); communicator aborted",
                            self.timeout.as_secs_f64()
                        ),
                    ),
                })
            }
        }
    }

    /// Abort the communicator (NCCL's kernels return, every peer's next wait fails): after
    /// an error that leaves the ranks out of step.
    pub fn abort(&self) {
        self.inner.abort()
    }

    /// Whether the communicator was aborted (after an error or a timeout).
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted()
    }
}

#[cfg(feature = "nccl")]
mod imp {
    //! A nonblocking NCCL communicator (`config.blocking = 0`): every NCCL call returns at
    //! once, possibly with `ncclInProgress` (connection set-up with a peer, which blocks
    //! forever in blocking mode when the peer is gone), and [`Comm::settle`] polls
    //! `ncclCommGetAsyncError` until the call took effect, aborting at the deadline.
    use super::NcclId;
    use crate::error::{Error, Result};
    use crate::gpu::{Device, RawStream};
    use cudarc::nccl::{result as nr, sys as ns};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    pub(super) struct Comm {
        comm: ns::ncclComm_t,
        aborted: AtomicBool,
        timeout: Duration,
        label: String,
    }
    // SAFETY: an NCCL communicator may be used from any thread, one call at a time
    // (the owning Communicator's borrows enforce that).
    unsafe impl Send for Comm {}
    unsafe impl Sync for Comm {}

    fn loaded() -> Result<()> {
        // SAFETY: only tries to dlopen the candidate names.
        if unsafe { ns::is_culib_present() } {
            Ok(())
        } else {
            Err(Error::unsupported(
                "nccl",
                "libnccl.so was not found on the library search path: install NCCL, or put a \
                 libnccl.so link to Python's nvidia/nccl/lib/libnccl.so.2 on LD_LIBRARY_PATH \
                 (flashmoe bench moe --gpus N does this for its ranks)",
            ))
        }
    }

    fn err(what: &str, e: nr::NcclError) -> Error {
        Error::cuda(what, format!("{:?}", e.0))
    }

    fn code() -> std::result::Result<i32, Error> {
        nr::get_nccl_version().map_err(|e| err("ncclGetVersion", e))
    }

    pub(super) fn version() -> Result<String> {
        loaded()?;
        let v = code()?;
        Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
    }

    pub(super) fn new_id() -> Result<NcclId> {
        loaded()?;
        let id = nr::get_uniqueid().map_err(|e| err("ncclGetUniqueId", e))?;
        let mut out = [0u8; 128];
        for (o, c) in out.iter_mut().zip(id.internal.iter()) {
            *o = *c as u8;
        }
        Ok(NcclId(out))
    }

    /// NCCL_CONFIG_INITIALIZER with `blocking = 0` (every other field "undefined": NCCL's
    /// defaults). The version is the loaded library's; NCCL reads the fields it knows.
    fn nonblocking_config(version: i32) -> ns::ncclConfig_t {
        const UNDEF: i32 = i32::MIN;
        ns::ncclConfig_t {
            size: std::mem::size_of::<ns::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: version as u32,
            blocking: 0,
            cgaClusterSize: UNDEF,
            minCTAs: UNDEF,
            maxCTAs: UNDEF,
            netName: std::ptr::null(),
            splitShare: UNDEF,
            trafficClass: UNDEF,
            commName: std::ptr::null(),
            collnetEnable: UNDEF,
            CTAPolicy: UNDEF,
            shrinkShare: UNDEF,
            nvlsCTAs: UNDEF,
            nChannelsPerNetPeer: UNDEF,
            nvlinkCentricSched: UNDEF,
            graphUsageMode: UNDEF,
            numRmaCtx: UNDEF,
            maxP2pPeers: UNDEF,
        }
    }

    pub(super) fn init(
        dev: &Device,
        id: &NcclId,
        rank: usize,
        world: usize,
        timeout: Duration,
        max_ctas: Option<u32>,
    ) -> Result<Comm> {
        loaded()?;
        let mut raw = ns::ncclUniqueId { internal: [0; 128] };
        for (d, s) in raw.internal.iter_mut().zip(id.0.iter()) {
            *d = *s as core::ffi::c_char;
        }
        dev.context()
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent (NCCL init)", e))?;
        let mut config = nonblocking_config(code()?);
        if let Some(n) = max_ctas {
            config.maxCTAs = n as i32;
        }
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the id is a copy.
        let r = unsafe {
            ns::ncclCommInitRankConfig(&mut comm, world as i32, raw, rank as i32, &mut config)
        };
        let label = format!("rank {rank} of {world}");
        if !matches!(
            r,
            ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress
        ) {
            return Err(Error::cuda(
                format!("{label}: ncclCommInitRankConfig"),
                format!("{r:?}"),
            ));
        }
        let c = Comm {
            comm,
            aborted: AtomicBool::new(false),
            timeout,
            label,
        };
        c.settle("ncclCommInitRankConfig (every rank joining)")?;
        Ok(c)
    }

    impl Comm {
        pub(super) fn aborted(&self) -> bool {
            self.aborted.load(Ordering::Acquire)
        }

        /// Poll until the last call took effect: Ok when NCCL reports success, an error
        /// (communicator aborted) on an NCCL error or past the timeout.
        fn settle(&self, what: &str) -> Result<()> {
            let end = match super::poll(self.timeout, || self.state()) {
                Ok(()) => return Ok(()),
                Err(end) => end,
            };
            self.abort();
            Err(Error::cuda(
                format!("{}: {what}", self.label),
                match end {
                    super::PollEnd::Failed(e) => format!("{e}; communicator aborted"),
                    super::PollEnd::TimedOut => format!(
                        "still in progress after {:.1} s (a peer died, hung or never \
                         joined); communicator aborted",
                        self.timeout.as_secs_f64()
                    ),
                },
            ))
        }

        /// Ok(true): idle and healthy; Ok(false): a call is still in progress.
        fn state(&self) -> std::result::Result<bool, String> {
            let mut state = ns::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, valid out-pointer.
            let r = unsafe { ns::ncclCommGetAsyncError(self.comm, &mut state) };
            match (r, state) {
                (ns::ncclResult_t::ncclSuccess, ns::ncclResult_t::ncclSuccess) => Ok(true),
                (ns::ncclResult_t::ncclSuccess, ns::ncclResult_t::ncclInProgress) => Ok(false),
                (ns::ncclResult_t::ncclSuccess, s) => Err(format!("NCCL reported {s:?}")),
                (r, _) => Err(format!("ncclCommGetAsyncError: {r:?}")),
            }
        }

        /// A call's immediate result: success and in-progress go on to `settle`.
        fn issued(&self, what: &str, r: ns::ncclResult_t) -> Result<()> {
            match r {
                ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => {
                    self.settle(what)
                }
                other => {
                    self.abort();
                    Err(Error::cuda(
                        format!("{}: {what}", self.label),
                        format!("{other:?}; communicator aborted"),
                    ))
                }
            }
        }

        pub(super) unsafe fn all_gather_u32(
            &self,
            send: u64,
            recv: u64,
            count: usize,
            stream: RawStream,
        ) -> Result<()> {
            let r = ns::ncclAllGather(
                send as *const _,
                recv as *mut _,
                count,
                ns::ncclDataType_t::ncclUint32,
                self.comm,
                stream as _,
            );
            self.issued("ncclAllGather (expert counts)", r)
        }

        pub(super) unsafe fn send_recv(
            &self,
            sends: &[super::Transfer],
            recvs: &[super::Transfer],
            stream: RawStream,
        ) -> Result<()> {
            let start = ns::ncclGroupStart();
            if !matches!(start, ns::ncclResult_t::ncclSuccess) {
                return Err(Error::cuda("ncclGroupStart", format!("{start:?}")));
            }
            // Sends, then receives; the first failure stops the posting.
            let post = |&(peer, addr, bytes): &super::Transfer, send: bool| {
                let (r, what) = if send {
                    let r = ns::ncclSend(
                        addr as *const _,
                        bytes,
                        ns::ncclDataType_t::ncclUint8,
                        peer as i32,
                        self.comm,
                        stream as _,
                    );
                    (r, "ncclSend to")
                } else {
                    let r = ns::ncclRecv(
                        addr as *mut _,
                        bytes,
                        ns::ncclDataType_t::ncclUint8,
                        peer as i32,
                        self.comm,
                        stream as _,
                    );
                    (r, "ncclRecv from")
                };
                match r {
                    ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => None,
                    r => Some(format!("{what} rank {peer}: {r:?}")),
                }
            };
            let failed = sends
                .iter()
                .map(|t| (t, true))
                .chain(recvs.iter().map(|t| (t, false)))
                .filter(|(t, _)| t.2 > 0)
                .find_map(|(t, send)| post(t, send));
            // The group is always closed, also after a failed enqueue.
            let end = ns::ncclGroupEnd();
            if let Some(f) = failed {
                self.abort();
                return Err(Error::cuda(
                    format!("{}: point-to-point group", self.label),
                    f,
                ));
            }
            self.issued("ncclGroupEnd (point-to-point transfers)", end)
        }

        pub(super) fn async_error(&self) -> std::result::Result<(), String> {
            self.state().map(|_| ())
        }

        pub(super) fn abort(&self) {
            if !self.aborted.swap(true, Ordering::AcqRel) {
                // SAFETY: live communicator; aborted once.
                let _ = unsafe { ns::ncclCommAbort(self.comm) };
            }
        }
    }

    impl Drop for Comm {
        fn drop(&mut self) {
            if !self.aborted() {
                // SAFETY: live communicator, destroyed once; the owner's work finished
                // (every call waited on its last event) or was aborted.
                let _ = unsafe { ns::ncclCommDestroy(self.comm) };
            }
        }
    }
}

#[cfg(not(feature = "nccl"))]
mod imp {
    use super::NcclId;
    use crate::error::{Error, Result};
    use crate::gpu::{Device, RawStream};
    use std::time::Duration;

    pub(super) struct Comm {}

    fn missing() -> Error {
        Error::unsupported(
            "nccl",
            "this build of flashmoe has no NCCL support (build the flashmoe crate with the \
             `nccl` feature)",
        )
    }
    pub(super) fn version() -> Result<String> {
        Err(missing())
    }
    pub(super) fn new_id() -> Result<NcclId> {
        Err(missing())
    }
    pub(super) fn init(
        _: &Device,
        _: &NcclId,
        _: usize,
        _: usize,
        _: Duration,
        _: Option<u32>,
    ) -> Result<Comm> {
        Err(missing())
    }
    impl Comm {
        pub(super) unsafe fn all_gather_u32(
            &self,
            _: u64,
            _: u64,
            _: usize,
            _: RawStream,
        ) -> Result<()> {
            Err(missing())
        }
        pub(super) unsafe fn send_recv(
            &self,
            _: &[super::Transfer],
            _: &[super::Transfer],
            _: RawStream,
        ) -> Result<()> {
            Err(missing())
        }
        pub(super) fn async_error(&self) -> std::result::Result<(), String> {
            Ok(())
        }
        pub(super) fn abort(&self) {}
        pub(super) fn aborted(&self) -> bool {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_hex_round_trip_and_errors() {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 % 256) as u8;
        }
        let id = NcclId(b);
        assert_eq!(NcclId::from_hex(&id.to_hex()).unwrap(), id);
        assert!(NcclId::from_hex("abc")
            .unwrap_err()
            .to_string()
            .contains("256 hex digits"));
        assert!(NcclId::from_hex(&"zz".repeat(128)).is_err());
    }

    /// Absent NCCL (CI has none) is an error that says what to install, never a panic;
    /// where NCCL is present its version is reported.
    #[test]
    fn nccl_absence_is_a_clean_error() {
        match nccl_version() {
            Ok(v) => assert!(v.split('.').count() == 3, "{v}"),
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("libnccl.so") || m.contains("nccl` feature"),
                    "{m}"
                );
                let id = Communicator::new_id().unwrap_err().to_string();
                assert!(
                    id.contains("libnccl.so") || id.contains("nccl` feature"),
                    "{id}"
                );
            }
        }
    }
}
