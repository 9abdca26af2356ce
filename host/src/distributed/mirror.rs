//! Keeps worker ranks' KV shards in step with rank 0's caches.
//!
//! Every [`crate::cache::KvCache`] carries a [`MirrorId`]. On rank 0 of a
//! tensor-parallel server ([`activate`]), the cache operations that change
//! a cache outside a forward pass (a clone for the prompt cache, a drop, a
//! trim, a private copy before in-place decode writes) are logged here, in
//! the order they happen; the next step's plan carries the log, and each
//! worker replays it on its own shards ([`Shards`]) before running the
//! step. Forward passes themselves need no log: every rank runs the same
//! forward on the same cache ids. A cache id a worker has never seen is a
//! fresh, empty cache (which is what rank 0's `new_cache` makes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::cache::KvCache;

static ACTIVE: AtomicBool = AtomicBool::new(false);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static LOG: Mutex<Vec<CacheOp>> = Mutex::new(Vec::new());

/// A cache operation rank 0 did outside a forward pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheOp {
    /// `to` became a copy of `from` (sharing its buffers, as `Clone` does).
    Clone {
        /// The source cache.
        from: u64,
        /// The new cache.
        to: u64,
    },
    /// The cache was dropped.
    Free(u64),
    /// [`KvCache::truncate`] to this many positions.
    Truncate(u64, usize),
    /// [`KvCache::make_exclusive`].
    MakeExclusive(u64),
    /// [`KvCache::compact`].
    Compact(u64),
}

/// Starts logging cache operations (rank 0 of a tensor-parallel server,
/// before any cache exists).
pub fn activate() {
    ACTIVE.store(true, Ordering::SeqCst);
}

/// Whether operations are being logged.
pub fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Takes the operations logged since the last call, in order.
pub fn drain() -> Vec<CacheOp> {
    std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()))
}

fn log(op: CacheOp) {
    if active() {
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push(op);
    }
}

/// A cache's identity across ranks: unique in this process, logged on
/// clone and drop while [`active`].
#[derive(Debug, PartialEq, Eq)]
pub struct MirrorId(u64);

impl MirrorId {
    /// A new id (a fresh cache).
    pub fn fresh() -> Self {
        MirrorId(NEXT_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// The id's value (what plans name).
    pub fn get(&self) -> u64 {
        self.0
    }

    /// Logs `op(id)` for this cache.
    pub fn record(&self, op: impl FnOnce(u64) -> CacheOp) {
        if active() {
            log(op(self.0));
        }
    }
}

impl Clone for MirrorId {
    fn clone(&self) -> Self {
        let to = Self::fresh();
        log(CacheOp::Clone {
            from: self.0,
            to: to.0,
        });
        to
    }
}

impl Drop for MirrorId {
    fn drop(&mut self) {
        log(CacheOp::Free(self.0));
    }
}

/// A worker's KV shards, by rank 0's cache id.
#[derive(Default)]
pub struct Shards {
    caches: HashMap<u64, KvCache>,
}

impl Shards {
    /// Replays one logged operation; `fresh` makes an empty cache (the
    /// model's `new_cache`).
    ///
    /// Errors: MLX errors from copies.
    pub fn apply(&mut self, op: &CacheOp, fresh: &dyn Fn() -> KvCache) -> crate::model::Result<()> {
        match *op {
            CacheOp::Clone { from, to } => {
                let copy = match self.caches.get(&from) {
                    Some(c) => c.clone(),
                    None => fresh(),
                };
                self.caches.insert(to, copy);
            }
            CacheOp::Free(id) => {
                self.caches.remove(&id);
            }
            CacheOp::Truncate(id, len) => {
                if let Some(c) = self.caches.get_mut(&id) {
                    c.truncate(len);
                }
            }
            CacheOp::MakeExclusive(id) => {
                if let Some(c) = self.caches.get_mut(&id) {
                    c.make_exclusive()?;
                }
            }
            CacheOp::Compact(id) => {
                if let Some(c) = self.caches.get_mut(&id) {
                    c.compact()?;
                }
            }
        }
        Ok(())
    }

    /// Takes cache `id` out (`fresh()` when unknown) for a forward; put
    /// it back with [`Shards::put`].
    pub fn take(&mut self, id: u64, fresh: &dyn Fn() -> KvCache) -> KvCache {
        self.caches.remove(&id).unwrap_or_else(fresh)
    }

    /// Puts back a cache taken with [`Shards::take`].
    pub fn put(&mut self, id: u64, cache: KvCache) {
        self.caches.insert(id, cache);
    }

    /// Number of caches held.
    pub fn len(&self) -> usize {
        self.caches.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.caches.is_empty()
    }
}
