//! What rank 0 tells the workers each step, and what they answer: JSON
//! lines over the plan channel ([`super::channel`]).

use serde::{Deserialize, Serialize};

use super::mirror::CacheOp;

/// Rank 0 -> worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// Run one forward pass on the worker's shard.
    Step(Step),
    /// Stop: the server is shutting down.
    Shutdown,
}

/// One forward pass, as rank 0 runs it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Step {
    /// Increasing step number (the answer names it).
    pub seq: u64,
    /// Cache operations since the previous step, replayed first, in order.
    pub ops: Vec<CacheOp>,
    /// The forward's rows, in rank 0's order.
    pub rows: Vec<PlanRow>,
}

/// One row of a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanRow {
    /// The row's cache ([`crate::cache::KvCache::mirror_id`]).
    pub cache: u64,
    /// The row's cache offset on rank 0 before the step: a worker whose
    /// shard disagrees fails the step instead of computing garbage.
    pub offset: usize,
    /// New token ids.
    pub tokens: Vec<u32>,
    /// Index from which rank 0 takes logits (the worker's forward must
    /// request the same positions so its graph matches).
    pub logits_from: usize,
}

/// Worker -> rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum FromWorker {
    /// First message on a new connection: which rank this is.
    Hello {
        /// Its rank.
        rank: usize,
    },
    /// The worker loaded its shard and waits for steps.
    Ready {
        /// Its rank.
        rank: usize,
        /// Its shard's parameter bytes.
        weight_bytes: usize,
    },
    /// Step `seq` ran.
    Done {
        /// The step.
        seq: u64,
    },
    /// Step `seq` failed on the worker.
    Failed {
        /// The step.
        seq: u64,
        /// Why.
        error: String,
    },
}
