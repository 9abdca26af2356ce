//! A worker rank: joins the group, loads its shard, then runs every step
//! rank 0 plans until rank 0 says stop or goes away.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::channel::WorkerChannel;
use super::mirror::Shards;
use super::plan::{FromWorker, Step, ToWorker};
use super::{DistributedError, Group};

use crate::cache::KvCache;
use crate::model::{CausalLm, RowInput};

/// Runs worker rank of the group in `MLX_RANK` / `MLX_HOSTFILE`:
/// `load` builds its shard from the group. Returns when rank 0 shuts
/// down or closes the plan channel.
///
/// Errors: the group, the plan channel or the shard cannot be set up; a
/// step fails (the process should then exit, so that rank 0's pending
/// collectives fail instead of waiting).
pub fn run(
    control: SocketAddr,
    load: impl FnOnce(Arc<Group>) -> anyhow::Result<Box<dyn CausalLm>>,
) -> anyhow::Result<()> {
    let group = Arc::new(super::launch::init_ring(super::launch::START_TIMEOUT)?);
    let rank = group.rank();
    let mut channel = WorkerChannel::connect(control, rank, Duration::from_secs(120))?;
    let model = load(group)?;
    channel.send(&FromWorker::Ready {
        rank,
        weight_bytes: model.nbytes(),
    })?;
    tracing::info!(rank, "tensor-parallel worker ready");
    let mut shards = Shards::default();
    while let Some(msg) = channel.recv() {
        let step = match msg {
            ToWorker::Shutdown => break,
            ToWorker::Step(step) => step,
        };
        let seq = step.seq;
        match run_step(model.as_ref(), &mut shards, step) {
            Ok(()) => channel.send(&FromWorker::Done { seq })?,
            Err(e) => {
                let error = e.to_string();
                let _ = channel.send(&FromWorker::Failed {
                    seq,
                    error: error.clone(),
                });
                return Err(DistributedError::RankFailed(format!(
                    "rank {rank} failed step {seq}: {error}"
                ))
                .into());
            }
        }
    }
    Ok(())
}

/// Replays the step's cache operations, then runs its forward on this
/// rank's shard (the model evaluates its collectives itself).
fn run_step(model: &dyn CausalLm, shards: &mut Shards, step: Step) -> anyhow::Result<()> {
    let fresh = || model.new_cache();
    for op in &step.ops {
        shards.apply(op, &fresh)?;
    }
    let mut caches: Vec<(u64, KvCache)> = step
        .rows
        .iter()
        .map(|r| (r.cache, shards.take(r.cache, &fresh)))
        .collect();
    let mismatch = step
        .rows
        .iter()
        .zip(&caches)
        .find(|(r, (_, c))| r.offset != c.offset())
        .map(|(r, (_, c))| (r.cache, r.offset, c.offset()));
    let result = match mismatch {
        Some((id, want, have)) => Err(anyhow::anyhow!(
            "cache {id} holds {have} positions here and {want} on rank 0"
        )),
        None => {
            let mut rows: Vec<RowInput<'_>> = step
                .rows
                .iter()
                .zip(caches.iter_mut())
                .map(|(r, (_, cache))| RowInput {
                    tokens: &r.tokens,
                    cache,
                    logits_from: r.logits_from,
                    lora: None,
                })
                .collect();
            model
                .forward(&mut rows)
                .map(drop)
                .map_err(anyhow::Error::from)
        }
    };
    for (id, cache) in caches {
        shards.put(id, cache);
    }
    result
}
