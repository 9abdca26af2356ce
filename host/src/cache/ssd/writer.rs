//! The write-behind thread: entries handed over by the engine thread are
//! written here, so no request waits on the disk.
//!
//! Jobs queued while a write runs are coalesced: of a growing conversation
//! only the longest sequence is written (it covers its prefixes), and a job
//! already covered by a stored entry is dropped. A flush request is
//! answered once every job queued before it is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use mlx_rs::Array;

use super::format::{self, EntryKey, TensorSource};
use super::store::{self, Store};

/// One tensor handed to the writer: an evaluated MLX array and the byte
/// ranges of its buffer that make up the stored tensor.
pub struct PreparedTensor {
    /// E.g. `layers.3.keys`.
    pub name: String,
    /// `float32`, `float16` or `bfloat16`.
    pub dtype: String,
    /// Stored shape `[1, H_kv, T, D]`.
    pub shape: Vec<u64>,
    /// Holds the buffer alive (and, being a second reference, keeps MLX
    /// from writing into it in place while the write runs).
    pub array: Array,
    /// Byte ranges of the buffer, concatenated in order.
    pub runs: Vec<std::ops::Range<usize>>,
}

/// An entry to write.
pub struct WriteJob {
    /// Its key.
    pub key: EntryKey,
    /// The key's digest (directory name).
    pub digest: String,
    /// Cache kind and per-layer starts.
    pub layout: super::format::EntryLayout,
    /// The token ids the KV holds.
    pub tokens: Vec<u32>,
    /// The tensors, in file order.
    pub tensors: Vec<PreparedTensor>,
}

enum Msg {
    Write(Box<WriteJob>),
    Flush(mpsc::Sender<()>),
}

/// Most bytes of KV waiting for the writer; more submissions are dropped
/// (each pins its MLX buffers until written).
pub const QUEUE_BUDGET_BYTES: usize = 2 << 30;

/// Counters shared between the handle and the thread.
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Writes queued or running.
    pub pending: AtomicUsize,
    /// Bytes of those.
    pub pending_bytes: AtomicUsize,
    /// Submissions dropped because the queue was over its budget.
    pub dropped: AtomicUsize,
}

/// Handle on the writer thread. Dropping it lets the thread finish what is
/// queued and waits for it (so the store, and its directory lock, are
/// released when the cache is).
pub struct Writer {
    tx: Option<mpsc::Sender<Msg>>,
    counters: Arc<QueueCounters>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Bytes of tensor data the tensors will write.
pub fn tensor_bytes(tensors: &[PreparedTensor]) -> usize {
    tensors
        .iter()
        .flat_map(|t| t.runs.iter().map(|r| r.len()))
        .sum()
}

fn job_bytes(job: &WriteJob) -> usize {
    tensor_bytes(&job.tensors)
}

impl Writer {
    /// Starts the thread.
    ///
    /// Errors: the thread cannot be spawned.
    pub fn spawn(store: Arc<Mutex<Store>>) -> std::io::Result<Writer> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let counters = Arc::new(QueueCounters::default());
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("ssd-cache-writer".into())
            .spawn(move || run(rx, store, c))?;
        Ok(Writer {
            tx: Some(tx),
            counters,
            thread: Some(thread),
        })
    }

    /// Queues a write, unless the queue is over [`QUEUE_BUDGET_BYTES`]
    /// (then the entry is dropped and counted).
    pub fn submit(&self, job: WriteJob) {
        let bytes = job_bytes(&job);
        let queued = self.counters.pending_bytes.load(Ordering::Relaxed);
        if queued > 0 && queued + bytes > QUEUE_BUDGET_BYTES {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                queued,
                bytes,
                "SSD cache write queue full; entry not written"
            );
            return;
        }
        self.counters.pending.fetch_add(1, Ordering::Relaxed);
        self.counters
            .pending_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Msg::Write(Box::new(job))).is_ok());
        if !sent {
            self.counters.pending.fetch_sub(1, Ordering::Relaxed);
            self.counters
                .pending_bytes
                .fetch_sub(bytes, Ordering::Relaxed);
            tracing::warn!("the SSD cache writer has stopped; entry not written");
        }
    }

    /// Blocks until every write queued so far is done (or `timeout`
    /// passes). Returns whether it finished.
    pub fn flush(&self, timeout: std::time::Duration) -> bool {
        let (ack_tx, ack_rx) = mpsc::channel();
        let Some(tx) = &self.tx else { return false };
        if tx.send(Msg::Flush(ack_tx)).is_err() {
            return false;
        }
        ack_rx.recv_timeout(timeout).is_ok()
    }

    /// The queue's counters.
    pub fn counters(&self) -> Arc<QueueCounters> {
        self.counters.clone()
    }
}

fn run(rx: mpsc::Receiver<Msg>, store: Arc<Mutex<Store>>, counters: Arc<QueueCounters>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let mut jobs = Vec::new();
        let mut acks = Vec::new();
        for m in batch {
            match m {
                Msg::Write(j) => jobs.push(*j),
                Msg::Flush(ack) => acks.push(ack),
            }
        }
        let done = |job: &WriteJob| {
            counters.pending.fetch_sub(1, Ordering::Relaxed);
            counters
                .pending_bytes
                .fetch_sub(job_bytes(job), Ordering::Relaxed);
        };
        let (kept, dropped) = coalesce(jobs);
        // Jobs coalesced away are done too.
        dropped.iter().for_each(done);
        for job in kept {
            let bytes = job_bytes(&job);
            write_one(&store, job);
            counters.pending.fetch_sub(1, Ordering::Relaxed);
            counters.pending_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

/// Drops jobs whose tokens are a prefix of another queued job's (same key):
/// the longer entry covers them.
/// Returns (jobs to write, jobs dropped).
fn coalesce(mut jobs: Vec<WriteJob>) -> (Vec<WriteJob>, Vec<WriteJob>) {
    let mut keep: Vec<WriteJob> = Vec::with_capacity(jobs.len());
    let mut dropped = Vec::new();
    // Longest first, so each job only checks against kept ones.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.tokens.len()));
    for j in jobs {
        let covered = keep.iter().any(|k| {
            k.digest == j.digest
                && k.tokens.starts_with(&j.tokens)
                && k.layout.resumes_at(j.tokens.len())
        });
        if covered {
            dropped.push(j);
        } else {
            keep.push(j);
        }
    }
    (keep, dropped)
}

/// The buffer of an evaluated array as bytes.
///
/// # Safety
/// `a` must be evaluated (its data is then immutable while `a` lives,
/// since this reference keeps MLX from donating the buffer).
unsafe fn buffer_bytes(a: &Array) -> &[u8] {
    // SAFETY: per the contract, the array is evaluated, so its data pointer
    // is valid for `nbytes` bytes for as long as `a` is alive.
    unsafe {
        let ptr = mlx_sys::mlx_array_data_uint8(a.as_ptr());
        if ptr.is_null() {
            return &[];
        }
        std::slice::from_raw_parts(ptr, a.nbytes())
    }
}

fn write_one(store: &Mutex<Store>, job: WriteJob) {
    let pending = {
        let Ok(mut s) = store.lock() else { return };
        if s.covers(&job.digest, &job.tokens) {
            return;
        }
        s.begin_write()
    };
    let mut pending = match pending {
        Ok(p) => p,
        Err(e) => {
            fail(store, &job, &e);
            return;
        }
    };
    let mut sources = Vec::with_capacity(job.tensors.len());
    for t in &job.tensors {
        // SAFETY: the engine thread evaluated every array before handing it
        // over, and `t.array` lives until the end of this function.
        let buf = unsafe { buffer_bytes(&t.array) };
        let mut runs = Vec::with_capacity(t.runs.len());
        for r in &t.runs {
            match buf.get(r.clone()) {
                Some(b) => runs.push(b),
                None => {
                    fail(
                        store,
                        &job,
                        &std::io::Error::other(format!(
                            "tensor {} is smaller than its layout",
                            t.name
                        )),
                    );
                    return;
                }
            }
        }
        sources.push(TensorSource {
            name: t.name.clone(),
            dtype: t.dtype.clone(),
            shape: t.shape.clone(),
            runs,
        });
    }
    let written = format::write_entry(
        &mut pending.file,
        &job.key,
        &job.layout,
        &job.tokens,
        &sources,
    );
    drop(sources);
    // The disk work (fsync, rename, unlinks) runs without the index lock,
    // which the engine thread takes on every lookup.
    let result = written.and_then(|bytes| {
        let path = store
            .lock()
            .map_err(|_| std::io::Error::other("the SSD cache index is poisoned"))?
            .entry_path(&job.digest, &job.tokens);
        pending.publish(&path)?;
        let victims = store
            .lock()
            .map_err(|_| std::io::Error::other("the SSD cache index is poisoned"))?
            .commit(path, &job.digest, job.tokens.clone(), &job.layout, bytes);
        store::remove_files(&victims);
        Ok(())
    });
    match result {
        Ok(()) => tracing::debug!(tokens = job.tokens.len(), "SSD cache entry written"),
        Err(e) => fail(store, &job, &e),
    }
}

fn fail(store: &Mutex<Store>, job: &WriteJob, e: &std::io::Error) {
    tracing::warn!(tokens = job.tokens.len(), error = %e, "SSD cache write failed; the entry is skipped");
    if let Ok(mut s) = store.lock() {
        s.counters.write_failures += 1;
    }
}
