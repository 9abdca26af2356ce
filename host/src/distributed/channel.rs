//! The plan channel: one TCP connection per worker rank to rank 0, JSON
//! lines both ways ([`super::plan`]). Tensors never travel here (they go
//! through MLX's collectives); only what to compute does.
//!
//! Rank 0 learns that a worker is gone from its connection closing (a
//! reader thread per worker marks the cluster failed at once, see
//! [`super::set_failed`]) or from a step's answer not arriving within the
//! timeout, so a dead or stuck rank never hangs the server.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::plan::{FromWorker, ToWorker};
use super::DistributedError;

/// Rank 0's end: a connection to every worker.
pub struct PlanChannel {
    /// `(rank, write half)`, by rank.
    writers: Vec<(usize, TcpStream)>,
    replies: mpsc::Receiver<(usize, Option<FromWorker>)>,
}

fn io(what: &str, e: std::io::Error) -> DistributedError {
    DistributedError::Channel(format!("{what}: {e}"))
}

impl PlanChannel {
    /// Accepts `workers` connections on `listener` (each opening with
    /// [`FromWorker::Hello`]) within `timeout`.
    ///
    /// Errors: [`DistributedError::Channel`] when a worker does not
    /// connect in time or opens with anything else.
    pub fn accept(
        listener: &TcpListener,
        workers: usize,
        timeout: Duration,
    ) -> Result<Self, DistributedError> {
        let deadline = Instant::now() + timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| io("plan channel listener", e))?;
        let (tx, replies) = mpsc::channel();
        let mut writers = Vec::with_capacity(workers);
        while writers.len() < workers {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(DistributedError::Channel(format!(
                            "{} of {workers} worker ranks connected to the plan channel within {} s",
                            writers.len(),
                            timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(io("accepting a worker", e)),
            };
            stream
                .set_nonblocking(false)
                .map_err(|e| io("plan channel", e))?;
            let _ = stream.set_nodelay(true);
            stream
                .set_read_timeout(Some(deadline.saturating_duration_since(Instant::now())))
                .map_err(|e| io("plan channel", e))?;
            let mut reader = BufReader::new(stream.try_clone().map_err(|e| io("plan channel", e))?);
            let rank = match read_message::<FromWorker>(&mut reader) {
                Some(FromWorker::Hello { rank }) => rank,
                _ => {
                    return Err(DistributedError::Channel(
                        "a connection to the plan channel did not introduce itself as a worker"
                            .into(),
                    ))
                }
            };
            stream
                .set_read_timeout(None)
                .map_err(|e| io("plan channel", e))?;
            // A worker that stops reading must not block rank 0's step.
            stream
                .set_write_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| io("plan channel", e))?;
            let tx = tx.clone();
            std::thread::Builder::new()
                .name(format!("tp-rank{rank}"))
                .spawn(move || {
                    while let Some(msg) = read_message::<FromWorker>(&mut reader) {
                        if tx.send((rank, Some(msg))).is_err() {
                            return;
                        }
                    }
                    super::set_failed(format!(
                        "tensor-parallel rank {rank} closed its plan channel (the process \
                         exited or the network failed)"
                    ));
                    let _ = tx.send((rank, None));
                })
                .map_err(|e| io("starting a plan channel reader", e))?;
            writers.push((rank, stream));
        }
        writers.sort_by_key(|(r, _)| *r);
        Ok(PlanChannel { writers, replies })
    }

    /// Sends `msg` to every worker.
    ///
    /// Errors: [`DistributedError::RankFailed`] when a write fails (the
    /// cluster is marked failed).
    pub fn send(&mut self, msg: &ToWorker) -> Result<(), DistributedError> {
        let mut line = serde_json::to_vec(msg)
            .map_err(|e| DistributedError::Channel(format!("encoding a plan: {e}")))?;
        line.push(b'\n');
        for (rank, stream) in &mut self.writers {
            if let Err(e) = stream.write_all(&line) {
                let msg = format!("sending the step plan to tensor-parallel rank {rank}: {e}");
                super::set_failed(msg.clone());
                return Err(DistributedError::RankFailed(msg));
            }
        }
        Ok(())
    }

    /// Waits until every worker answered `want` (a predicate on its
    /// message) within `timeout`.
    ///
    /// Errors: [`DistributedError::RankFailed`] when a worker reports a
    /// failure, its connection closes, or the time runs out (the cluster
    /// is marked failed in every case: its ranks no longer agree on what
    /// ran).
    pub fn wait_all(
        &self,
        timeout: Duration,
        mut want: impl FnMut(usize, &FromWorker) -> Result<bool, String>,
    ) -> Result<(), DistributedError> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<usize> = self.writers.iter().map(|(r, _)| *r).collect();
        let fail = |msg: String| {
            super::set_failed(msg.clone());
            Err(DistributedError::RankFailed(msg))
        };
        while !pending.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok((rank, Some(msg))) => match want(rank, &msg) {
                    Ok(true) => pending.retain(|&r| r != rank),
                    Ok(false) => {}
                    Err(e) => return fail(e),
                },
                Ok((rank, None)) => {
                    return fail(format!(
                        "tensor-parallel rank {rank} closed its plan channel (the process exited \
                         or the network failed)"
                    ))
                }
                Err(_) => {
                    return fail(format!(
                        "tensor-parallel ranks {pending:?} did not answer within {} s",
                        timeout.as_secs_f32()
                    ))
                }
            }
        }
        Ok(())
    }
}

/// A worker's end: its connection to rank 0.
pub struct WorkerChannel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl WorkerChannel {
    /// Connects to rank 0's plan channel at `addr` as rank `rank`,
    /// retrying until `timeout` (rank 0 may still be starting).
    ///
    /// Errors: [`DistributedError::Channel`] when no connection is made
    /// in time.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        timeout: Duration,
    ) -> Result<Self, DistributedError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(io(
                        &format!("connecting to rank 0's plan channel {addr}"),
                        e,
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let _ = stream.set_nodelay(true);
        let reader = BufReader::new(stream.try_clone().map_err(|e| io("plan channel", e))?);
        let mut channel = WorkerChannel {
            reader,
            writer: stream,
        };
        channel.send(&FromWorker::Hello { rank })?;
        Ok(channel)
    }

    /// The next message; `None` when rank 0 closed the connection.
    pub fn recv(&mut self) -> Option<ToWorker> {
        read_message(&mut self.reader)
    }

    /// Sends one message to rank 0.
    ///
    /// Errors: [`DistributedError::Channel`] when the write fails.
    pub fn send(&mut self, msg: &FromWorker) -> Result<(), DistributedError> {
        let mut line = serde_json::to_vec(msg)
            .map_err(|e| DistributedError::Channel(format!("encoding an answer: {e}")))?;
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .map_err(|e| io("answering rank 0", e))
    }
}

/// Reads one JSON line; `None` at end of stream, on a read error or on a
/// line that does not parse (the peer is then treated as gone).
fn read_message<T: serde::de::DeserializeOwned>(reader: &mut impl BufRead) -> Option<T> {
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => serde_json::from_str(&line).ok(),
    }
}
