//! The caches a front end keeps behind its entry points, so that each front end (candle,
//! PyTorch, an engine) does not write its own: values made once per key and shared
//! ([`PlanCache`]: plans by (GPU, plan key) — making one compiles or loads kernels — or
//! devices by GPU), and one buffer per CUDA stream grown to the largest call that ran on it
//! ([`StreamCache`], [`WorkspaceCache`]: a workspace may only be reused in stream order,
//! so it is keyed by stream, not by device).
//!
//! Both are plain values (no globals): a front end puts them in a `static` (`OnceLock` /
//! `LazyLock`) or in its own state. Errors are the caller's type: the cache only passes on
//! what `make` / `alloc` / the closure return, and caches nothing that failed.

use crate::gpu::Workspace;
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

/// A poisoned lock is taken as is: every update below is a single insert or remove, so a
/// panic in a caller's closure never leaves a map half-changed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Values made once per key and shared as `Arc`s. `make` runs outside the lock, so other
/// keys keep being served while one compiles; two threads racing on a new key may both
/// make it, and both get the one inserted first.
#[derive(Debug)]
pub struct PlanCache<K, V> {
    map: Mutex<HashMap<K, Arc<V>>>,
}

impl<K: Eq + Hash, V> Default for PlanCache<K, V> {
    fn default() -> Self {
        PlanCache {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash, V> PlanCache<K, V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The value for `key` if one was made.
    pub fn get(&self, key: &K) -> Option<Arc<V>> {
        lock(&self.map).get(key).cloned()
    }

    /// The value for `key`, made by `make` on first use. An error is returned as is and
    /// nothing is cached (the next call tries again).
    pub fn get_or_try_make<E>(
        &self,
        key: K,
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<Arc<V>, E> {
        if let Some(v) = self.get(&key) {
            return Ok(v);
        }
        let made = Arc::new(make()?);
        // A `clear` meanwhile drops nothing we hold: the value is inserted again.
        Ok(lock(&self.map).entry(key).or_insert(made).clone())
    }

    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drop every cached value (callers' `Arc`s keep theirs alive).
    pub fn clear(&self) {
        lock(&self.map).clear();
    }
}

/// One buffer per stream (keyed by the `CUstream` handle), with the size it was made for,
/// replaced by a larger one when a call needs more. A handle is not reused by the driver
/// while a buffer made on it is alive when the buffer keeps a reference to its stream (as a
/// [`Workspace`] does).
#[derive(Debug)]
pub struct StreamCache<W> {
    map: Mutex<HashMap<usize, (usize, W)>>,
}

impl<W> Default for StreamCache<W> {
    fn default() -> Self {
        StreamCache {
            map: Mutex::new(HashMap::new()),
        }
    }
}

/// Workspaces per stream, for every attention plan (each leaves its workspace zeroed after
/// a launch, so one zeroed workspace serves every plan on a stream).
pub type WorkspaceCache = StreamCache<Workspace>;

impl<W> StreamCache<W> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Run `f` with the buffer of `stream`, first replaced by `alloc(need)` when it was made
    /// for fewer than `need` bytes (or there is none). The old buffer is dropped before the
    /// new one is made (for a stream-ordered free, work queued on it finishes first). The
    /// lock is held while `f` runs, so uses of one buffer by calls that enqueue on its
    /// stream stay in stream order.
    pub fn with<R, E>(
        &self,
        stream: usize,
        need: usize,
        alloc: impl FnOnce(usize) -> Result<W, E>,
        f: impl FnOnce(&mut W) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut all = lock(&self.map);
        if let Some((bytes, w)) = all.get_mut(&stream) {
            if *bytes >= need {
                return f(w);
            }
        }
        all.remove(&stream);
        let w = alloc(need)?;
        let (_, w) = all.entry(stream).or_insert((need, w));
        f(w)
    }

    /// The size the buffer of `stream` was made for, if it has one.
    pub fn bytes(&self, stream: usize) -> Option<usize> {
        lock(&self.map).get(&stream).map(|(b, _)| *b)
    }

    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drop every buffer.
    pub fn clear(&self) {
        lock(&self.map).clear();
    }
}

impl StreamCache<Workspace> {
    /// [`StreamCache::with`] for a zeroed [`Workspace`] of at least `need` bytes on `stream`.
    pub fn with_workspace<R, E: From<crate::Error>>(
        &self,
        stream: &Arc<CudaStream>,
        need: usize,
        f: impl FnOnce(&mut Workspace) -> Result<R, E>,
    ) -> Result<R, E> {
        self.with(
            stream.cu_stream() as usize,
            need,
            |n| Workspace::zeroed(stream, n).map_err(E::from),
            f,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    #[test]
    fn plan_cache_makes_once_per_key_and_caches_no_error() {
        let c: PlanCache<(usize, u32), String> = PlanCache::new();
        let made = AtomicUsize::new(0);
        let make = |s: &str| {
            made.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(s.to_string())
        };
        let a = c.get_or_try_make((0, 1), || make("a")).unwrap();
        let a2 = c.get_or_try_make((0, 1), || make("other")).unwrap();
        assert!(Arc::ptr_eq(&a, &a2));
        assert_eq!((a2.as_str(), made.load(Ordering::SeqCst)), ("a", 1));
        // Another GPU, same plan key: its own value.
        let b = c.get_or_try_make((1, 1), || make("b")).unwrap();
        assert_eq!((b.as_str(), c.len()), ("b", 2));
        // A failed make is returned and not cached.
        let e = c
            .get_or_try_make((0, 2), || Err::<String, _>("no kernel".to_string()))
            .unwrap_err();
        assert_eq!(e, "no kernel");
        assert!(c.get(&(0, 2)).is_none());
        assert_eq!(
            c.get_or_try_make((0, 2), || make("c")).unwrap().as_str(),
            "c"
        );
        // clear drops the cache's references only.
        c.clear();
        assert!(c.is_empty() && c.get(&(0, 1)).is_none());
        assert_eq!(a.as_str(), "a");
        let a3 = c.get_or_try_make((0, 1), || make("a")).unwrap();
        assert!(!Arc::ptr_eq(&a, &a3));
    }

    #[test]
    fn plan_cache_racing_threads_share_the_first_insert() {
        let c: PlanCache<u32, usize> = PlanCache::new();
        let go = Barrier::new(4);
        let got: Vec<Arc<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|i| {
                    let (c, go) = (&c, &go);
                    s.spawn(move || {
                        go.wait();
                        c.get_or_try_make(7, || Ok::<_, ()>(i)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(c.len(), 1);
        let kept = c.get(&7).unwrap();
        for g in &got {
            assert!(Arc::ptr_eq(g, &kept), "{g} vs {kept}");
        }
    }

    #[test]
    fn stream_cache_grows_per_stream_only_when_needed() {
        let c: StreamCache<Vec<u8>> = StreamCache::new();
        let allocs = AtomicUsize::new(0);
        let alloc = |n: usize| {
            allocs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(vec![0u8; n])
        };
        let len = |w: &mut Vec<u8>| Ok::<_, String>(w.len());
        assert_eq!(c.with(10, 64, alloc, len), Ok(64));
        // Smaller or equal needs reuse the buffer (a write survives).
        c.with(10, 16, alloc, |w| {
            w[0] = 9;
            Ok::<_, String>(())
        })
        .unwrap();
        assert_eq!(c.with(10, 64, alloc, |w| Ok::<_, String>(w[0])), Ok(9));
        assert_eq!(allocs.load(Ordering::SeqCst), 1);
        // A larger need replaces it.
        assert_eq!(c.with(10, 100, alloc, len), Ok(100));
        assert_eq!((c.bytes(10), allocs.load(Ordering::SeqCst)), (Some(100), 2));
        // Another stream has its own.
        assert_eq!(c.with(11, 8, alloc, len), Ok(8));
        assert_eq!((c.len(), c.bytes(10), c.bytes(11)), (2, Some(100), Some(8)));
        // Errors pass through; a failed alloc leaves no buffer for that stream.
        assert_eq!(
            c.with(11, 8, alloc, |_| Err::<(), _>("launch".to_string())),
            Err("launch".to_string())
        );
        assert_eq!(
            c.with(11, 1 << 20, |_| Err("out of memory".to_string()), len),
            Err("out of memory".to_string())
        );
        assert_eq!((c.bytes(11), c.bytes(10)), (None, Some(100)));
        c.clear();
        assert!(c.is_empty());
    }
}
