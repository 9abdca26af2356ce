//! The SSD cold tier: prompt-cache entries written to disk (on RAM eviction
//! and, write-behind, once requests settle), restored by `mmap` when the
//! disk holds a longer usable prefix than RAM, and kept across restarts.
//!
//! An entry is keyed by the model fingerprint (config and weights content),
//! the KV scheme (cache kind and dtype), the tokenizer hash and the
//! namespace; the digest of that key names its directory, and the header
//! repeats the key, so KV computed by another model, tokenizer or scheme is
//! never restored. File format: [`format`]; directory and index: [`store`].
//! The design follows mlx-bun's SSD tier (13.7k tokens restored in 0.24 s
//! instead of 12.1 s of prefill).

pub mod format;
pub mod restore;
pub mod store;
pub mod writer;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mlx_rs::transforms::eval;
use mlx_rs::Array;
use sha2::{Digest, Sha256};

pub use format::EntryKey;
pub use restore::KvGeometry;

use crate::cache::prompt::Reuse;
use crate::cache::KvCache;
use store::Store;
use writer::{PreparedTensor, WriteJob, Writer};

/// `--ssd-cache`, `--ssd-cache-max`, `--ssd-cache-verify`.
#[derive(Debug, Clone)]
pub struct SsdConfig {
    /// The directory (created 0700 when missing).
    pub dir: PathBuf,
    /// Byte cap over every entry in the directory.
    pub max_bytes: u64,
    /// Verify every tensor's hash before a restore uses it.
    pub verify: bool,
}

/// What the running model is: the parts of every entry's key that do not
/// depend on the request.
#[derive(Debug, Clone)]
pub struct ModelIdentity {
    /// `model::fingerprint` of the checkpoint.
    pub model: String,
    /// `TextTokenizer::fingerprint`.
    pub tokenizer: String,
    /// The KV layout.
    pub geometry: KvGeometry,
}

/// Errors opening or feeding the SSD tier.
#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    /// The directory cannot be used (I/O, another server holds it, not
    /// private).
    #[error("--ssd-cache {dir}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: store::OpenError,
    },
    /// The KV uses a dtype the format does not store.
    #[error("the KV dtype {0:?} cannot be stored in the SSD cache")]
    Dtype(mlx_rs::Dtype),
    /// MLX failed while preparing the KV for writing.
    #[error("preparing the KV for the SSD cache: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// Counters for `GET /stats` (`ssd_cache`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SsdCacheStats {
    /// The directory.
    pub dir: String,
    /// Entries for the running model (same key).
    pub entries: usize,
    /// Entries of every model in the directory.
    pub entries_all: usize,
    /// Bytes held by every entry in the directory.
    pub bytes: u64,
    /// The byte cap (`--ssd-cache-max`).
    pub max_bytes: u64,
    /// Whether tensor hashes are verified on restore (`--ssd-cache-verify`).
    pub verify: bool,
    /// Lookups served from SSD.
    pub hits: u64,
    /// Hits by the kind of cache that served them (`full`, `sliding`,
    /// `recurrent`: see `PromptCacheStats::hits_by_kind`).
    pub hits_by_kind: std::collections::BTreeMap<String, u64>,
    /// Recurrent hits that resumed from a state checkpoint short of the
    /// prefix the prompt shares with the entry.
    pub checkpoint_hits: u64,
    /// Prompt tokens restored from SSD instead of prefilled.
    pub tokens_restored: u64,
    /// Wall time of the last restore, ms (mmap, page-in, verification).
    pub last_restore_ms: f64,
    /// Entries written.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Writes that failed (the entry is skipped; the server keeps going).
    pub write_failures: u64,
    /// Writes queued or running.
    pub pending_writes: usize,
    /// Entries not written because the write queue was over its budget
    /// (2 GiB of KV waiting).
    pub dropped_writes: usize,
    /// Entries deleted to stay under the byte cap.
    pub evictions: u64,
    /// Files moved to `quarantine/` (corrupt, foreign, other version).
    pub quarantined: u64,
}

#[derive(Debug, Default)]
struct RestoreCounters {
    hits: u64,
    hits_by_kind: std::collections::BTreeMap<String, u64>,
    checkpoint_hits: u64,
    tokens_restored: u64,
    last_restore_ms: f64,
}

/// Reads the tier's counters from any thread.
#[derive(Clone)]
pub struct SsdStatsHandle {
    store: Arc<Mutex<Store>>,
    restores: Arc<Mutex<RestoreCounters>>,
    queue: Arc<writer::QueueCounters>,
    digest: String,
    verify: bool,
}

impl SsdStatsHandle {
    /// Current counters.
    pub fn stats(&self) -> SsdCacheStats {
        let mut out = SsdCacheStats {
            verify: self.verify,
            pending_writes: self
                .queue
                .pending
                .load(std::sync::atomic::Ordering::Relaxed),
            dropped_writes: self
                .queue
                .dropped
                .load(std::sync::atomic::Ordering::Relaxed),
            ..Default::default()
        };
        if let Ok(s) = self.store.lock() {
            out.dir = s.root().display().to_string();
            out.entries = s.entries_for(&self.digest);
            out.entries_all = s.len();
            out.bytes = s.bytes();
            out.max_bytes = s.max_bytes();
            out.writes = s.counters.writes;
            out.bytes_written = s.counters.bytes_written;
            out.write_failures = s.counters.write_failures;
            out.evictions = s.counters.evictions;
            out.quarantined = s.counters.quarantined;
        }
        if let Ok(r) = self.restores.lock() {
            out.hits = r.hits;
            out.hits_by_kind = r.hits_by_kind.clone();
            out.checkpoint_hits = r.checkpoint_hits;
            out.tokens_restored = r.tokens_restored;
            out.last_restore_ms = r.last_restore_ms;
        }
        out
    }
}

/// The digest naming a key's directory: SHA-256 of its JSON, 32 hex digits.
pub fn key_digest(key: &EntryKey) -> String {
    let json = serde_json::to_vec(key).unwrap_or_default();
    let d = Sha256::digest(&json);
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// The SSD tier, owned by the engine thread (restores build MLX arrays
/// there); writes run on its own writer thread.
pub struct SsdCache {
    store: Arc<Mutex<Store>>,
    writer: Writer,
    restores: Arc<Mutex<RestoreCounters>>,
    identity: ModelIdentity,
    verify: bool,
    max_bytes: u64,
}

impl SsdCache {
    /// Checks that the tier's directory can be opened (see
    /// [`Store::check_usable`]) without indexing it or knowing the model.
    ///
    /// Errors: [`SsdError::Dir`] naming the directory and why.
    pub fn check_usable(config: &SsdConfig) -> Result<(), SsdError> {
        Store::check_usable(&config.dir).map_err(|source| SsdError::Dir {
            dir: config.dir.clone(),
            source,
        })
    }

    /// Opens the tier at `config.dir` for a model (see [`Store::open`]).
    ///
    /// Errors: [`SsdError::Dir`] when the directory cannot be created or
    /// read; [`SsdError::Dtype`] when the KV dtype cannot be stored.
    pub fn open(config: &SsdConfig, identity: ModelIdentity) -> Result<SsdCache, SsdError> {
        if restore::dtype_name(identity.geometry.dtype).is_none() {
            return Err(SsdError::Dtype(identity.geometry.dtype));
        }
        let dir_err = |source| SsdError::Dir {
            dir: config.dir.clone(),
            source,
        };
        let store = Arc::new(Mutex::new(
            Store::open(&config.dir, config.max_bytes).map_err(dir_err)?,
        ));
        let writer = Writer::spawn(store.clone()).map_err(|e| dir_err(store::OpenError::Io(e)))?;
        Ok(SsdCache {
            store,
            writer,
            restores: Arc::new(Mutex::new(RestoreCounters::default())),
            identity,
            verify: config.verify,
            max_bytes: config.max_bytes,
        })
    }

    /// The full key of entries in `namespace`. The KV scheme names the
    /// cache kind, dtype, MLX backend and this build, since a new build or
    /// another backend may compute slightly different KV.
    pub fn key(&self, namespace: &str) -> EntryKey {
        let dtype = restore::dtype_name(self.identity.geometry.dtype).unwrap_or("?");
        EntryKey {
            model: self.identity.model.clone(),
            kv_scheme: format!(
                "{}/{dtype}/{}/mlxhost-{}",
                self.identity.geometry.kinds_scheme(),
                crate::runtime::backend_name(),
                env!("CARGO_PKG_VERSION")
            ),
            tokenizer: self.identity.tokenizer.clone(),
            namespace: namespace.to_string(),
        }
    }

    /// A handle for `/stats` (counters of `namespace`'s key).
    pub fn stats_handle(&self, namespace: &str) -> SsdStatsHandle {
        SsdStatsHandle {
            store: self.store.clone(),
            restores: self.restores.clone(),
            queue: self.writer.counters(),
            digest: key_digest(&self.key(namespace)),
            verify: self.verify,
        }
    }

    /// How many tokens of `prompt` a restore would cover (at most
    /// `prompt.len() - 1`; 0 when nothing matches). Reads the index only.
    pub fn peek(&self, namespace: &str, prompt: &[u32]) -> usize {
        let digest = key_digest(&self.key(namespace));
        self.store
            .lock()
            .ok()
            .and_then(|s| s.best(&digest, prompt))
            .map(|(n, _)| n)
            .unwrap_or(0)
    }

    /// Restores the longest usable prefix of `prompt` from disk. A file
    /// that fails any check is quarantined and the next best is tried; the
    /// request then simply prefills more.
    pub fn restore(&self, namespace: &str, prompt: &[u32]) -> Option<Reuse> {
        let key = self.key(namespace);
        let digest = key_digest(&key);
        loop {
            let (reused, entry) = self.store.lock().ok()?.best(&digest, prompt)?;
            let started = Instant::now();
            match restore::load(&entry.path, &key, &self.identity.geometry, self.verify) {
                Ok((mut kv, tokens)) if tokens[..] == entry.tokens[..] => {
                    kv.truncate(reused);
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    if let Ok(mut s) = self.store.lock() {
                        s.touch(&entry.path);
                    }
                    if let Ok(mut r) = self.restores.lock() {
                        r.hits += 1;
                        let kind = super::prompt::kind_name(&kv);
                        *r.hits_by_kind.entry(kind.into()).or_default() += 1;
                        let shared = crate::cache::common_prefix(&tokens, prompt);
                        if kind == "recurrent"
                            && reused < shared.min(prompt.len().saturating_sub(1))
                        {
                            r.checkpoint_hits += 1;
                        }
                        r.tokens_restored += reused as u64;
                        r.last_restore_ms = ms;
                    }
                    tracing::info!(
                        tokens = reused,
                        ms = format!("{ms:.1}"),
                        "restored KV from the SSD cache"
                    );
                    return Some(Reuse {
                        kv,
                        reused,
                        source: super::prompt::ReuseSource::Ssd,
                    });
                }
                Ok(_) => self.quarantine(&entry.path, "its tokens changed since it was indexed"),
                // Evicted while we read it: not damage.
                Err(format::FormatError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                    if let Ok(mut s) = self.store.lock() {
                        s.forget(&entry.path);
                    }
                }
                // Out of memory, file descriptors, a transient read error:
                // the file may be fine; prefill this request instead.
                Err(format::FormatError::Io(e)) => {
                    tracing::warn!(file = %entry.path.display(), error = %e, "SSD cache restore failed; prefilling instead");
                    return None;
                }
                Err(e) => self.quarantine(&entry.path, &e.to_string()),
            }
        }
    }

    fn quarantine(&self, path: &std::path::Path, reason: &str) {
        if let Ok(mut s) = self.store.lock() {
            s.quarantine(path, reason);
        }
    }

    /// Hands the KV of `tokens` (exactly the positions `kv` holds) to the
    /// writer thread. Runs on the engine thread: evaluates the buffers and
    /// notes which bytes to write (a copy only for a non-contiguous buffer);
    /// the disk work happens on the writer thread.
    ///
    /// Errors: [`SsdError::Mlx`] when evaluation fails.
    pub fn submit(&self, namespace: &str, tokens: &[u32], kv: &KvCache) -> Result<(), SsdError> {
        let n = kv.offset();
        if n == 0 || n != tokens.len() {
            return Ok(());
        }
        let key = self.key(namespace);
        let digest = key_digest(&key);
        if self
            .store
            .lock()
            .map(|s| s.covers(&digest, tokens))
            .unwrap_or(false)
        {
            return Ok(());
        }
        let geometry = &self.identity.geometry;
        if kv.kinds() != geometry.kinds {
            return Ok(());
        }
        let layout = geometry.layout_of(kv);
        let names = geometry.tensor_names(&layout.state_positions);
        let mut names = names.iter();
        let buffers = kv.layer_buffers();
        let mut tensors = Vec::with_capacity(names.len());
        for (layer, buf) in buffers.iter().enumerate() {
            if geometry.kinds[layer] == crate::cache::LayerKind::Recurrent {
                // The layer's states at every stored position.
                let Some(states) = kv.states() else {
                    return Ok(());
                };
                for &p in &layout.state_positions {
                    let Some(Some(state)) =
                        states.states_at(p as usize, n).and_then(|at| at.get(layer))
                    else {
                        return Ok(());
                    };
                    for a in [&state.conv, &state.ssm] {
                        let Some(name) = names.next() else {
                            return Ok(());
                        };
                        tensors.push(prepare_whole(name, a)?);
                    }
                }
                continue;
            }
            let Some((k, v)) = buf else { return Ok(()) };
            // Slot 0 holds position `layer_start`: the valid slots come first.
            let held = n - kv.layer_start(layer);
            for a in [*k, *v] {
                let Some(name) = names.next() else {
                    return Ok(());
                };
                tensors.push(prepare(name, a, held)?);
            }
        }
        let dtype = restore::dtype_name(self.identity.geometry.dtype).unwrap_or("?");
        let state = |t: &PreparedTensor| t.name.contains(".ssm@");
        // Quantized layers' packed rows are uint32 (`cache::quant`).
        let packed = |t: &PreparedTensor| geometry.quant.is_some() && t.dtype == "uint32";
        if tensors
            .iter()
            .any(|t| t.dtype != dtype && !(state(t) && t.dtype == "float32") && !packed(t))
        {
            return Err(SsdError::Dtype(self.identity.geometry.dtype));
        }
        // An entry larger than the whole cap would only evict everything
        // (a file adds up to one alignment page per tensor and the header).
        let bytes = writer::tensor_bytes(&tensors);
        let overhead = (tensors.len() as u64 + 1) * format::ALIGN + 32 * tokens.len() as u64;
        if bytes as u64 + overhead > self.max_bytes {
            tracing::debug!(bytes, "entry larger than --ssd-cache-max; not written");
            return Ok(());
        }
        self.writer.submit(WriteJob {
            key,
            digest,
            layout,
            tokens: tokens.to_vec(),
            tensors,
        });
        Ok(())
    }

    /// Waits until every submitted entry is on disk (or `timeout` passes);
    /// returns whether it finished.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.writer.flush(timeout)
    }
}

/// The first `n` positions of a KV buffer `[1, H, cap, D]` as byte runs of
/// an evaluated array: one run per head straight from the buffer when it
/// is row-contiguous, else one run of a contiguous copy.
/// A whole array (a recurrent state) as one contiguous tensor.
fn prepare_whole(name: &str, a: &Array) -> Result<PreparedTensor, SsdError> {
    let dtype = restore::dtype_name(a.dtype()).ok_or(SsdError::Dtype(a.dtype()))?;
    let copy = a.contiguous()?;
    eval([&copy])?;
    let len = copy.nbytes();
    Ok(PreparedTensor {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape: a.shape().iter().map(|&d| d as u64).collect(),
        array: copy,
        runs: std::iter::once(0..len).collect(),
    })
}

fn prepare(name: &str, buffer: &Array, n: usize) -> Result<PreparedTensor, SsdError> {
    use mlx_rs::ops::indexing::IndexOp;
    let dtype = restore::dtype_name(buffer.dtype()).ok_or(SsdError::Dtype(buffer.dtype()))?;
    let shape = buffer.shape();
    let (h, cap, d) = (shape[1] as usize, shape[2] as usize, shape[3] as usize);
    let item = buffer.item_size();
    eval([buffer])?;
    let mut contiguous = false;
    // SAFETY: reads a flag of a valid, evaluated array.
    let rc = unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut contiguous, buffer.as_ptr()) };
    let stored = vec![1, h as u64, n as u64, d as u64];
    if rc == 0 && contiguous && buffer.nbytes() == h * cap * d * item {
        let runs = (0..h)
            .map(|head| {
                let start = head * cap * d * item;
                start..start + n * d * item
            })
            .collect();
        return Ok(PreparedTensor {
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape: stored,
            array: buffer.clone(),
            runs,
        });
    }
    let copy = buffer.index((.., .., ..n as i32, ..)).contiguous()?;
    eval([&copy])?;
    let len = copy.nbytes();
    Ok(PreparedTensor {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape: stored,
        array: copy,
        runs: std::iter::once(0..len).collect(),
    })
}
