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
use super::store::Store;

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
    /// Cache kind (`full`).
    pub kind: String,
    /// The token ids the KV holds.
    pub tokens: Vec<u32>,
    /// The tensors, in file order.
    pub tensors: Vec<PreparedTensor>,
}

enum Msg {
    Write(Box<WriteJob>),
    Flush(mpsc::Sender<()>),
}

/// Handle on the writer thread (dropping it lets the thread finish what is
/// queued and exit).
pub struct Writer {
    tx: mpsc::Sender<Msg>,
    pending: Arc<AtomicUsize>,
}

impl Writer {
    /// Starts the thread.
    ///
    /// Errors: the thread cannot be spawned.
    pub fn spawn(store: Arc<Mutex<Store>>) -> std::io::Result<Writer> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let pending = Arc::new(AtomicUsize::new(0));
        let p = pending.clone();
        std::thread::Builder::new()
            .name("ssd-cache-writer".into())
            .spawn(move || run(rx, store, p))?;
        Ok(Writer { tx, pending })
    }

    /// Queues a write.
    pub fn submit(&self, job: WriteJob) {
        self.pending.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Msg::Write(Box::new(job))).is_err() {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!("the SSD cache writer has stopped; entry not written");
        }
    }

    /// Blocks until every write queued so far is done (or `timeout`
    /// passes). Returns whether it finished.
    pub fn flush(&self, timeout: std::time::Duration) -> bool {
        let (ack_tx, ack_rx) = mpsc::channel();
        if self.tx.send(Msg::Flush(ack_tx)).is_err() {
            return false;
        }
        ack_rx.recv_timeout(timeout).is_ok()
    }

    /// Writes queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

fn run(rx: mpsc::Receiver<Msg>, store: Arc<Mutex<Store>>, pending: Arc<AtomicUsize>) {
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
        let queued = jobs.len();
        let kept = coalesce(jobs);
        // Jobs coalesced away are done too.
        pending.fetch_sub(queued - kept.len(), Ordering::Relaxed);
        for job in kept {
            write_one(&store, job);
            pending.fetch_sub(1, Ordering::Relaxed);
        }
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

/// Drops jobs whose tokens are a prefix of another queued job's (same key):
/// the longer entry covers them.
fn coalesce(mut jobs: Vec<WriteJob>) -> Vec<WriteJob> {
    let mut keep: Vec<WriteJob> = Vec::with_capacity(jobs.len());
    // Longest first, so each job only checks against kept ones.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.tokens.len()));
    for j in jobs {
        let covered = keep
            .iter()
            .any(|k| k.digest == j.digest && k.tokens.starts_with(&j.tokens));
        if !covered {
            keep.push(j);
        }
    }
    keep
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
        &job.kind,
        &job.tokens,
        &sources,
    );
    drop(sources);
    let result = written.and_then(|bytes| {
        let Ok(mut s) = store.lock() else {
            return Err(std::io::Error::other("the SSD cache index is poisoned"));
        };
        s.commit(pending, &job.digest, job.tokens.clone(), bytes)
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
