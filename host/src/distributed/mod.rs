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
/// Set while rank 0 runs a step (its forward, with the collectives in it,
/// and the workers' answers).
static IN_STEP: AtomicBool = AtomicBool::new(false);

/// How long rank 0's step may go on once the group failed before rank 0
/// concludes it is blocked in a collective whose peer is gone and exits
/// (code [`STUCK_EXIT_CODE`]). A rank killed while the others wait in an
/// `all_sum` can leave them waiting on the ring's socket for good (one run
/// of the kill test in seven hung so): MLX's wait cannot be interrupted,
/// and a server whose engine thread never returns would hang every client.
/// A step that errors or ends meanwhile disarms it.
pub const STUCK_STEP_GRACE: std::time::Duration = std::time::Duration::from_secs(15);
/// Rank 0's exit status when it stops for a step blocked on a dead rank
/// (`EX_SOFTWARE`).
pub const STUCK_EXIT_CODE: i32 = 70;

/// Marks rank 0 inside a step until dropped (see [`STUCK_STEP_GRACE`]).
pub struct StepGuard(());

impl StepGuard {
    /// Enters a step.
    pub fn enter() -> StepGuard {
        IN_STEP.store(true, Ordering::SeqCst);
        StepGuard(())
    }
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        IN_STEP.store(false, Ordering::SeqCst);
    }
}

/// After the first failure: waits [`STUCK_STEP_GRACE`] for a running step
/// to come back; if it has not (and rank 0 is not stopping on purpose),
/// the step is blocked on the dead rank, so the process exits, closing
/// every client's connection, rather than hang them all.
fn watch_for_a_stuck_step(reason: String) {
    let spawned = std::thread::Builder::new()
        .name("tp-watchdog".into())
        .spawn(move || {
            let deadline = std::time::Instant::now() + STUCK_STEP_GRACE;
            while std::time::Instant::now() < deadline {
                if !IN_STEP.load(Ordering::SeqCst) || STOPPING.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if STOPPING.load(Ordering::SeqCst) || !IN_STEP.load(Ordering::SeqCst) {
                return;
            }
            tracing::error!(
                %reason,
                grace_s = STUCK_STEP_GRACE.as_secs(),
                "rank 0 is blocked in a collective with a rank that is gone; exiting"
            );
            eprintln!(
                "mlxhost: tensor parallelism failed ({reason}) and rank 0's step has been \
                 blocked on the lost rank for {} s; exiting with status {STUCK_EXIT_CODE}",
                STUCK_STEP_GRACE.as_secs()
            );
            std::process::exit(STUCK_EXIT_CODE);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the tensor-parallel watchdog");
    }
}

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
        *f = Some(reason.clone());
        drop(f);
        watch_for_a_stuck_step(reason);
    }
}

/// Why the group failed; `None` while healthy (or when not distributed).
pub fn failure() -> Option<String> {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
