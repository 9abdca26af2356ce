//! Rank 0's model in a tensor-parallel server: its own shard behind the
//! same [`CausalLm`] interface, sending each forward's plan to the
//! workers first, so the engine, caches, scoring and warm-up need no
//! change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use mlx_rs::{Array, Dtype};

use super::launch::Cluster;
use super::plan::{FromWorker, PlanRow, Step, ToWorker};
use super::{failure, mirror, set_failed, DistributedError};
use crate::cache::{KvCache, KvShape};
use crate::model::{CausalLm, ModelConfig, ModelError, Result, RowInput};

/// How long rank 0 waits for the workers' answers once its own part of a
/// step is done (they run the same work at the same time, so an answer
/// later than this means a stuck rank).
pub const STEP_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Rank 0's shard plus the channel to the other ranks.
pub struct DistributedLm {
    inner: Box<dyn CausalLm>,
    cluster: Mutex<Cluster>,
    seq: AtomicU64,
}

impl DistributedLm {
    /// Wraps rank 0's shard (`inner`, loaded with the cluster's group).
    pub fn new(inner: Box<dyn CausalLm>, cluster: Cluster) -> Self {
        DistributedLm {
            inner,
            cluster: Mutex::new(cluster),
            seq: AtomicU64::new(0),
        }
    }

    fn run(&self, rows: &mut [RowInput<'_>], ids: Option<&Array>) -> Result<Vec<Array>> {
        if let Some(reason) = failure() {
            return Err(DistributedError::RankFailed(reason).into());
        }
        // A failure found while this step runs may leave it blocked in a
        // collective (see `STUCK_STEP_GRACE`).
        let _in_step = super::StepGuard::enter();
        if rows.iter().any(|r| r.lora.is_some()) {
            return Err(DistributedError::Shard(
                "--tensor-parallel: LoRA adapters are not sharded".into(),
            )
            .into());
        }
        // Device-side ids (decode lookahead) are read here: the workers
        // need them as numbers.
        let device_ids: Option<Vec<u32>> = match ids {
            Some(a) => {
                let a = a.as_dtype(Dtype::Uint32)?;
                a.eval()?;
                Some(a.as_slice::<u32>().to_vec())
            }
            None => None,
        };
        let plan_rows = rows
            .iter()
            .enumerate()
            .map(|(i, r)| PlanRow {
                cache: r.cache.mirror_id(),
                offset: r.cache.offset(),
                tokens: match &device_ids {
                    Some(ids) => ids.get(i).map(|&t| vec![t]).unwrap_or_default(),
                    None => r.tokens.to_vec(),
                },
                logits_from: r.logits_from,
            })
            .collect();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut cluster = self.cluster.lock().unwrap_or_else(|e| e.into_inner());
        cluster.channel.send(&ToWorker::Step(Step {
            seq,
            ops: mirror::drain(),
            rows: plan_rows,
        }))?;
        let out = match ids {
            Some(ids) => self.inner.forward_device_ids(rows, ids),
            None => self.inner.forward(rows),
        };
        match &out {
            // Rejected before any collective: the workers reject the same
            // ids the same way.
            Err(ModelError::TokenOutOfRange { .. }) | Ok(_) => {}
            Err(e) => set_failed(format!("rank 0 failed step {seq}: {e}")),
        }
        cluster
            .channel
            .wait_all(STEP_ANSWER_TIMEOUT, |rank, msg| match msg {
                FromWorker::Done { seq: s } => Ok(*s == seq),
                FromWorker::Failed { seq: s, error } => {
                    Err(format!("rank {rank} failed step {s}: {error}"))
                }
                _ => Ok(false),
            })?;
        out
    }
}

impl Drop for DistributedLm {
    fn drop(&mut self) {
        let cluster = self.cluster.get_mut().unwrap_or_else(|e| e.into_inner());
        cluster.shutdown();
    }
}

impl CausalLm for DistributedLm {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        self.run(rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        self.run(rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        self.inner.new_cache()
    }

    fn kv_shapes(&self) -> Vec<KvShape> {
        self.inner.kv_shapes()
    }

    fn dtype(&self) -> Dtype {
        self.inner.dtype()
    }

    fn fast_one_token_path(&self) -> bool {
        self.inner.fast_one_token_path()
    }

    fn parameters(&self) -> Vec<&Array> {
        self.inner.parameters()
    }
}
