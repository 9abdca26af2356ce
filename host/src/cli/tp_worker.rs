//! `mlxhost tp-worker`: one worker rank of a tensor-parallel server
//! (started by `serve --tensor-parallel N` on one machine, or by hand /
//! `mlx.launch` on the other machines of a hostfile; docs/distributed.md).

use std::net::SocketAddr;
use std::path::PathBuf;

use super::ModelArgs;

/// Arguments of `mlxhost tp-worker`.
#[derive(Debug, clap::Args)]
pub struct TpWorkerArgs {
    /// This worker's rank, 1.. (default: `MLX_RANK`, as `mlx.launch` sets it).
    #[arg(long)]
    rank: Option<usize>,
    /// MLX hostfile: a JSON list, entry r being rank r's `["ip:port"]`
    /// (default: `MLX_HOSTFILE`).
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// Rank 0's plan channel (`serve --tp-control`).
    #[arg(long)]
    control: SocketAddr,
    /// The same model and `--dtype` as rank 0.
    #[command(flatten)]
    model: ModelArgs,
}

/// Joins the group, loads this rank's shard and serves rank 0's steps.
pub fn run(args: TpWorkerArgs) -> anyhow::Result<()> {
    // Set before any thread starts; MLX reads them when the group forms.
    if let Some(rank) = args.rank {
        std::env::set_var("MLX_RANK", rank.to_string());
    }
    if let Some(hostfile) = &args.hostfile {
        std::env::set_var("MLX_HOSTFILE", hostfile);
    }
    let model = args.model.clone();
    mlxhost::distributed::worker::run(args.control, move |group| {
        Ok(model.load_with(false, Some(group))?.model)
    })
}
