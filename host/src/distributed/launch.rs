//! Bringing the ranks up.
//!
//! - One machine (`serve --tensor-parallel N`): rank 0 picks free ports on
//!   127.0.0.1, writes a hostfile in MLX's format, and starts N-1 worker
//!   processes of this same binary (`mlxhost tp-worker`).
//! - Several machines (`serve --tensor-parallel N --hostfile FILE
//!   --tp-control ADDR`): every rank reads the same hostfile (MLX's
//!   format, as `mlx.launch` writes it: a JSON list, entry r being rank
//!   r's `["ip:port", ...]`); the workers are started on their machines
//!   (by hand, ssh or `mlx.launch`) with `mlxhost tp-worker`.
//!
//! Either way MLX's ring backend reads `MLX_RANK` and `MLX_HOSTFILE` from
//! the environment, and rank 0 listens for the workers' plan channels.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::channel::PlanChannel;
use super::plan::{FromWorker, ToWorker};
use super::{set_failed, DistributedError, Group};

/// How long rank 0 waits for the workers to connect and, separately, to
/// load their shards.
pub const START_TIMEOUT: Duration = Duration::from_secs(600);

/// What rank 0 needs to bring the group up.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Number of ranks (`--tensor-parallel`), at least 2.
    pub size: usize,
    /// `--hostfile`: the ranks are on several machines and start
    /// themselves; `None`: start workers here on 127.0.0.1.
    pub hostfile: Option<PathBuf>,
    /// `--tp-control`: where rank 0 listens for the workers' plan
    /// channels (default with a hostfile: rank 0's first address, port
    /// [`DEFAULT_CONTROL_PORT`]; without: a free port on 127.0.0.1).
    pub control: Option<SocketAddr>,
    /// Arguments after `mlxhost tp-worker --rank R --control ADDR` for
    /// the local workers (`--model`, `--dtype`).
    pub worker_args: Vec<OsString>,
}

/// The plan channel's port when only a hostfile is given.
pub const DEFAULT_CONTROL_PORT: u16 = 18_700;

/// The running group as rank 0 holds it.
pub struct Cluster {
    /// Rank 0's MLX group.
    pub group: Arc<Group>,
    /// The workers' plan channels.
    pub channel: PlanChannel,
    /// Set once rank 0 stops on purpose, so workers leaving is not a failure.
    stopping: Arc<AtomicBool>,
    /// The generated hostfile (one machine), removed on drop.
    _hostfile: Option<tempfile::TempPath>,
}

impl Cluster {
    /// Tells the workers to exit.
    pub fn shutdown(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        super::set_stopping();
        let _ = self.channel.send(&ToWorker::Shutdown);
    }

    /// Waits until every worker has loaded its shard.
    ///
    /// Errors: a worker exits or does not report within
    /// [`START_TIMEOUT`].
    pub fn wait_ready(&self) -> Result<(), DistributedError> {
        self.channel.wait_all(START_TIMEOUT, |_, msg| {
            Ok(matches!(msg, FromWorker::Ready { .. }))
        })
    }
}

/// Reads rank 0's plan-channel address from a hostfile: rank 0's first
/// address with port [`DEFAULT_CONTROL_PORT`].
///
/// Errors: the file cannot be read or is not MLX's hostfile format.
pub fn default_control(hostfile: &Path) -> Result<SocketAddr, DistributedError> {
    let bad = |why: String| DistributedError::Launch(format!("{}: {why}", hostfile.display()));
    let text = std::fs::read_to_string(hostfile).map_err(|e| bad(e.to_string()))?;
    let hosts: Vec<Vec<String>> = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "expected MLX's hostfile format [[\"ip:port\", ...], ...]: {e}"
        ))
    })?;
    let first = hosts
        .first()
        .and_then(|h| h.first())
        .ok_or_else(|| bad("no rank 0 address".into()))?;
    let addr: SocketAddr = first
        .parse()
        .map_err(|e| bad(format!("rank 0 address `{first}`: {e}")))?;
    Ok(SocketAddr::new(addr.ip(), DEFAULT_CONTROL_PORT))
}

/// Brings the group up as rank 0: starts the local workers (no
/// hostfile), forms MLX's ring, and accepts every worker's plan channel.
/// Call before any other thread starts (it sets `MLX_RANK` and
/// `MLX_HOSTFILE` in this process's environment).
///
/// Errors: [`DistributedError`] when a port, a worker process, the ring
/// or a plan channel cannot be set up.
pub fn start_rank0(launch: &Launch) -> Result<Cluster, DistributedError> {
    let err = |what: &str, e: std::io::Error| DistributedError::Launch(format!("{what}: {e}"));
    let (hostfile, temp, control) = match &launch.hostfile {
        Some(path) => {
            let control = match launch.control {
                Some(c) => c,
                None => default_control(path)?,
            };
            (path.clone(), None, control)
        }
        None => {
            let control = launch
                .control
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
            let temp = local_hostfile(launch.size)?;
            (temp.to_path_buf(), Some(temp), control)
        }
    };
    let listener =
        TcpListener::bind(control).map_err(|e| err(&format!("--tp-control {control}"), e))?;
    let control = listener.local_addr().map_err(|e| err("--tp-control", e))?;
    // Set before other threads exist (the caller's contract); MLX reads
    // them during `Group::init` below.
    std::env::set_var("MLX_RANK", "0");
    std::env::set_var("MLX_HOSTFILE", &hostfile);
    // From now on every cache operation is logged for the workers.
    super::mirror::activate();
    let stopping = Arc::new(AtomicBool::new(false));
    if launch.hostfile.is_none() {
        for rank in 1..launch.size {
            let child = spawn_worker(rank, &hostfile, control, &launch.worker_args)?;
            watch(rank, child, stopping.clone());
        }
    }
    tracing::info!(size = launch.size, hostfile = %hostfile.display(), %control, "forming the tensor-parallel group (ring backend)");
    let group = init_ring(START_TIMEOUT)?;
    if group.size() != launch.size || group.rank() != 0 {
        return Err(DistributedError::Launch(format!(
            "the ring has {} ranks with this one as rank {}; --tensor-parallel {} needs rank 0 of {}",
            group.size(),
            group.rank(),
            launch.size,
            launch.size
        )));
    }
    let channel = PlanChannel::accept(&listener, launch.size - 1, START_TIMEOUT)?;
    Ok(Cluster {
        group: Arc::new(group),
        channel,
        stopping,
        _hostfile: temp,
    })
}

/// Forms MLX's ring, giving up after `timeout` or as soon as a local
/// worker exits ([`super::failure`]): MLX's own init waits for every peer
/// without a limit, so it runs on a thread of its own that is left behind
/// when this returns an error (the process is about to exit then).
///
/// Errors: [`DistributedError::Launch`] on a timeout or a worker's exit;
/// the backend's own errors.
pub fn init_ring(timeout: Duration) -> Result<Group, DistributedError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tp-ring-init".into())
        .spawn(move || {
            let _ = tx.send(Group::init("ring"));
        })
        .map_err(|e| DistributedError::Launch(format!("starting the ring: {e}")))?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(group) => return group,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(DistributedError::Launch(
                    "the ring's init thread stopped".into(),
                ))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Some(reason) = super::failure() {
                    return Err(DistributedError::Launch(format!(
                        "the ring did not form: {reason}"
                    )));
                }
                if std::time::Instant::now() > deadline {
                    return Err(DistributedError::Launch(format!(
                        "the ring did not form within {} s: is every rank of the hostfile running?",
                        timeout.as_secs()
                    )));
                }
            }
        }
    }
}

/// A hostfile for `size` ranks on 127.0.0.1, each on a port that was free
/// a moment ago.
fn local_hostfile(size: usize) -> Result<tempfile::TempPath, DistributedError> {
    let err = |e: std::io::Error| DistributedError::Launch(format!("writing a hostfile: {e}"));
    // Hold every probe socket until all ports are chosen, so no two ranks
    // get the same one.
    let probes = (0..size)
        .map(|_| TcpListener::bind(("127.0.0.1", 0)))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(err)?;
    let hosts: Vec<Vec<String>> = probes
        .iter()
        .map(|p| p.local_addr().map(|a| vec![a.to_string()]))
        .collect::<std::io::Result<_>>()
        .map_err(err)?;
    drop(probes);
    let mut file = tempfile::Builder::new()
        .prefix("mlxhost-tp-")
        .suffix(".json")
        .tempfile()
        .map_err(err)?;
    serde_json::to_writer(&mut file, &hosts)
        .map_err(|e| DistributedError::Launch(format!("writing a hostfile: {e}")))?;
    Ok(file.into_temp_path())
}

fn spawn_worker(
    rank: usize,
    hostfile: &Path,
    control: SocketAddr,
    args: &[OsString],
) -> Result<Child, DistributedError> {
    let exe = std::env::current_exe()
        .map_err(|e| DistributedError::Launch(format!("finding this binary: {e}")))?;
    let mut cmd = Command::new(exe);
    die_with_parent(&mut cmd);
    cmd.arg("tp-worker")
        .arg("--rank")
        .arg(rank.to_string())
        .arg("--control")
        .arg(control.to_string())
        .arg("--hostfile")
        .arg(hostfile)
        .args(args)
        .spawn()
        .map_err(|e| DistributedError::Launch(format!("starting rank {rank}: {e}")))
}

/// A local worker dies with rank 0 (Linux's parent-death signal), also
/// when rank 0 is killed before the plan channel exists to tell it. The
/// signal follows the spawning *thread*: [`start_rank0`] runs on the main
/// thread, which lives as long as the process.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls `prctl`, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// Marks the group failed when worker `rank` exits while rank 0 serves.
fn watch(rank: usize, mut child: Child, stopping: Arc<AtomicBool>) {
    let pid = child.id();
    let spawned = std::thread::Builder::new()
        .name(format!("tp-watch{rank}"))
        .spawn(move || {
            let status = child.wait();
            if !stopping.load(Ordering::SeqCst) {
                let how = match status {
                    Ok(s) => s.to_string(),
                    Err(e) => e.to_string(),
                };
                set_failed(format!(
                    "tensor-parallel rank {rank} (pid {pid}) exited: {how}"
                ));
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(rank, error = %e, "cannot watch a worker rank; its exit is seen through its plan channel only");
    }
}
