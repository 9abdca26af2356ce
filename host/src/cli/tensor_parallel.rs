//! The `--tensor-parallel`, `--hostfile` and `--tp-control` flags shared
//! by `serve` and `score`: bring the group up, load rank 0's shard.

use std::net::SocketAddr;
use std::path::PathBuf;

use mlxhost::distributed::launch::{self, Cluster, Launch};
use mlxhost::distributed::lm::DistributedLm;
use mlxhost::model::LoadedModel;

use super::ModelArgs;

/// Tensor-parallel flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TensorParallelArgs {
    /// Tensor parallelism: split the model over this many ranks (MLX's
    /// ring backend; heads and MLP columns split, see docs/distributed.md).
    /// Without `--hostfile`, this process (rank 0) starts the other ranks
    /// on this machine over 127.0.0.1.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// MLX hostfile for ranks on several machines (a JSON list, entry r
    /// being rank r's `["ip:port"]`, as `mlx.launch` writes it); this
    /// process is rank 0 and each other rank is started on its machine
    /// with `mlxhost tp-worker`.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Where rank 0 listens for the workers' plan channels (default: a
    /// free port on 127.0.0.1; with `--hostfile`, rank 0's address,
    /// port 18700).
    #[arg(long, value_name = "ADDR")]
    pub tp_control: Option<SocketAddr>,
}

impl TensorParallelArgs {
    /// Brings the group up (`None` for one rank). Call before other
    /// threads start: forming the group sets MLX's environment variables.
    ///
    /// Errors: bad flag combinations; the ranks cannot start or connect.
    pub fn start(&self, model: &ModelArgs) -> anyhow::Result<Option<Cluster>> {
        use clap::ValueEnum;
        match self.tensor_parallel {
            0 => anyhow::bail!("--tensor-parallel must be at least 1"),
            1 if self.hostfile.is_some() || self.tp_control.is_some() => {
                anyhow::bail!("--hostfile and --tp-control need --tensor-parallel 2 or more")
            }
            1 => return Ok(None),
            _ => {}
        }
        let path = model.path()?;
        let dtype = model
            .dtype
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_else(|| "auto".into());
        // Everything that shapes a rank's weights or caches: the workers'
        // caches must be what rank 0's are.
        let mut worker_args: Vec<std::ffi::OsString> = vec![
            "--model".into(),
            path.into_os_string(),
            "--dtype".into(),
            dtype.into(),
        ];
        if let Some(bits) = model.kv_bits {
            worker_args.extend([
                "--kv-bits".into(),
                bits.to_string().into(),
                "--kv-group-size".into(),
                model.kv_group_size.to_string().into(),
            ]);
        }
        let launch = Launch {
            size: self.tensor_parallel,
            hostfile: self.hostfile.clone(),
            control: self.tp_control,
            worker_args,
        };
        Ok(Some(launch::start_rank0(&launch)?))
    }
}

/// Loads the model: rank 0's shard behind [`DistributedLm`] once every
/// worker has loaded its own when `cluster` is given, else the whole model.
///
/// Errors: the model does not load or shard; a worker fails to start.
pub fn load(model: &ModelArgs, cluster: Option<Cluster>) -> anyhow::Result<LoadedModel> {
    let Some(cluster) = cluster else {
        return model.load(false);
    };
    let mut m = model.load_with(false, Some(cluster.group.clone()))?;
    cluster.wait_ready()?;
    m.model = Box::new(DistributedLm::new(m.model, cluster));
    Ok(m)
}
