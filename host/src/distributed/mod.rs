//! Tensor parallelism over MLX's distributed module (`mx.distributed`):
//! one model split across ranks, ring backend over TCP on CPUs and Mac
//! clusters (NCCL on NVIDIA where libmlx has it).
//!
//! Rank 0 is the server: HTTP, adapters, scheduler, plugins and caches.
//! Each step it sends the step's plan (rows, token ids, cache operations)
//! to the worker ranks over the plan channel, then every rank runs the
//! same forward on its shard; the row-parallel products are summed with
//! MLX's `all_sum`, and only rank 0 computes logits.
//!
//! - [`group`]: the MLX group and its collectives (FFI);
//! - [`shard`]: which slice of each weight a rank keeps;
//! - [`mirror`]: cache identities and the cache operations workers replay;
//! - [`plan`] / [`channel`]: the per-step messages and their transport;
//! - [`launch`]: starting worker ranks (one machine) or joining a
//!   hostfile's (several);
//! - [`lm`]: rank 0's model, which sends each step's plan;
//! - [`worker`]: a worker rank's loop.
//!
//! See docs/distributed.md.

pub mod channel;
pub mod group;
pub mod launch;
pub mod lm;
pub mod mirror;
pub mod plan;
pub mod shard;
pub mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub use group::Group;

/// Why tensor parallelism failed.
#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    /// MLX's distributed backend is missing or the group did not form.
    #[error("distributed backend `{backend}`: {reason}")]
    Backend {
        /// The backend asked for.
        backend: String,
        /// Why.
        reason: String,
    },
    /// The weights cannot be split as asked.
    #[error("{0}")]
    Shard(String),
    /// The plan channel failed to set up.
    #[error("tensor-parallel plan channel: {0}")]
    Channel(String),
    /// A rank is gone or failed a step: the group no longer serves.
    #[error("tensor parallelism failed: {0}")]
    RankFailed(String),
    /// Starting worker ranks failed.
    #[error("starting tensor-parallel ranks: {0}")]
    Launch(String),
}

static FAILURE: Mutex<Option<String>> = Mutex::new(None);
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Rank 0 is stopping on purpose: workers leaving from now on is not a
/// failure.
pub fn set_stopping() {
    STOPPING.store(true, Ordering::SeqCst);
}

/// Marks the group failed (the first reason is kept): every later step
/// fails at once and `/health` reports it. Ignored once [`set_stopping`]
/// was called.
pub fn set_failed(reason: String) {
    if STOPPING.load(Ordering::SeqCst) {
        return;
    }
    let mut f = FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    if f.is_none() {
        tracing::error!(%reason, "tensor-parallel group failed");
        *f = Some(reason);
    }
}

/// Why the group failed; `None` while healthy (or when not distributed).
pub fn failure() -> Option<String> {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
