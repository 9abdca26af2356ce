//! The SSD tier's directory and its in-memory index.
//!
//! ```text
//! DIR/                          created 0700 (cached prompts are user data)
//! DIR/v1/<key digest>/<tokens hash>-<len>.kv   entries (format v1), 0600
//! DIR/tmp/<pid>-<n>.partial     files being written (locked by their writer)
//! DIR/quarantine/               files that failed verification, newest 32 kept
//! ```
//!
//! A file gets its final name only by `rename` after `fsync`, so a writer
//! killed at any point leaves at most an orphaned `.partial`, which the next
//! start removes (its lock died with the writer). Every entry's header is
//! read and verified when the store opens; a file that fails is moved to
//! `quarantine/` and never read again. The byte cap covers every entry under
//! `v1/` (all models); the least recently used go first, judged by the
//! file's modification time, which a restore refreshes.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use super::format::{self, FormatError};

/// Directory holding this format version's entries.
const ENTRIES_DIR: &str = "v1";
const TMP_DIR: &str = "tmp";
const QUARANTINE_DIR: &str = "quarantine";
/// Files kept in `quarantine/` for inspection; older ones are deleted.
const QUARANTINE_KEEP: usize = 32;

/// One entry file.
#[derive(Debug, Clone)]
pub struct StoredEntry {
    /// Where it is.
    pub path: PathBuf,
    /// Its key's digest (the directory name).
    pub digest: String,
    /// The token ids its KV holds.
    pub tokens: Arc<[u32]>,
    /// File length, bytes.
    pub bytes: u64,
    /// Last write or restore (LRU order).
    pub last_used: SystemTime,
}

/// Counters the store keeps (see `SsdCacheStats`).
#[derive(Debug, Clone, Default)]
pub struct StoreCounters {
    /// Entries written.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Writes that failed (I/O error, disk full); the entry is skipped.
    pub write_failures: u64,
    /// Entries deleted to stay under the byte cap.
    pub evictions: u64,
    /// Files moved to `quarantine/`.
    pub quarantined: u64,
}

/// The directory and its index.
pub struct Store {
    root: PathBuf,
    max_bytes: u64,
    entries: Vec<StoredEntry>,
    seq: u64,
    /// Counters.
    pub counters: StoreCounters,
}

/// A file being written: commit it with [`Store::commit`] or drop it (the
/// temporary file is then removed).
pub struct PendingFile {
    /// Write here.
    pub file: File,
    path: PathBuf,
    committed: bool,
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Creates `dir` (and parents) private to the user.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

/// Opens a new file private to the user.
fn create_private_file(path: &Path) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}

/// The file name of an entry holding `tokens`.
fn entry_file_name(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    format!(
        "{:016x}-{}.kv",
        xxhash_rust::xxh3::xxh3_64(&bytes),
        tokens.len()
    )
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Store {
    /// Opens (creating) the store at `root`: removes orphaned temporary
    /// files, indexes every entry (quarantining files that fail the header
    /// check) and evicts down to `max_bytes`.
    ///
    /// Errors: the directories cannot be created or listed.
    pub fn open(root: &Path, max_bytes: u64) -> std::io::Result<Store> {
        create_private_dir(root)?;
        for sub in [ENTRIES_DIR, TMP_DIR, QUARANTINE_DIR] {
            create_private_dir(&root.join(sub))?;
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(root)?.permissions().mode();
            if mode & 0o077 != 0 {
                tracing::warn!(dir = %root.display(), mode = format!("{:o}", mode & 0o777), "the SSD cache directory is readable by others; its entries are kept in private subdirectories");
            }
        }
        let mut store = Store {
            root: root.to_path_buf(),
            max_bytes,
            entries: Vec::new(),
            seq: 0,
            counters: StoreCounters::default(),
        };
        store.remove_orphans()?;
        store.scan()?;
        store.evict_to_cap();
        Ok(store)
    }

    /// Temporary files whose writer is gone (its lock is free).
    fn remove_orphans(&self) -> std::io::Result<()> {
        for e in std::fs::read_dir(self.root.join(TMP_DIR))? {
            let path = e?.path();
            let Ok(f) = OpenOptions::new().write(true).open(&path) else {
                continue;
            };
            if f.try_lock().is_ok() {
                tracing::debug!(file = %path.display(), "removing an orphaned partial write");
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(())
    }

    fn scan(&mut self) -> std::io::Result<()> {
        let entries_dir = self.root.join(ENTRIES_DIR);
        for key_dir in std::fs::read_dir(&entries_dir)? {
            let key_dir = key_dir?.path();
            if !key_dir.is_dir() {
                self.quarantine(&key_dir, "not an entry directory");
                continue;
            }
            let Some(digest) = key_dir
                .file_name()
                .and_then(|n| n.to_str())
                .map(String::from)
            else {
                continue;
            };
            for f in std::fs::read_dir(&key_dir)? {
                let path = f?.path();
                match read_entry(&path, &digest) {
                    Ok(entry) => self.entries.push(entry),
                    Err(e) => self.quarantine(&path, &e.to_string()),
                }
            }
        }
        Ok(())
    }

    /// The entry under `digest` sharing the longest prefix with `prompt`,
    /// at most `prompt.len() - 1` tokens (one is always prefilled), and
    /// that length.
    pub fn best(&self, digest: &str, prompt: &[u32]) -> Option<(usize, StoredEntry)> {
        let limit = prompt.len().checked_sub(1)?;
        self.entries
            .iter()
            .filter(|e| e.digest == digest)
            .map(|e| (common_prefix(&e.tokens, prompt).min(limit), e))
            .filter(|(n, _)| *n > 0)
            .max_by_key(|(n, e)| (*n, e.last_used))
            .map(|(n, e)| (n, e.clone()))
    }

    /// Whether an entry under `digest` already holds `tokens` (or a longer
    /// sequence starting with them).
    pub fn covers(&self, digest: &str, tokens: &[u32]) -> bool {
        self.entries
            .iter()
            .any(|e| e.digest == digest && e.tokens.starts_with(tokens))
    }

    /// Marks `path` used now (LRU), in the index and on disk.
    pub fn touch(&mut self, path: &Path) {
        let now = SystemTime::now();
        if let Some(e) = self.entries.iter_mut().find(|e| e.path == path) {
            e.last_used = now;
        }
        if let Ok(f) = File::options().write(true).open(path) {
            let _ = f.set_modified(now);
        }
    }

    /// A new temporary file, locked so a concurrent start does not take
    /// it for an orphan.
    ///
    /// Errors: the file cannot be created or locked.
    pub fn begin_write(&mut self) -> std::io::Result<PendingFile> {
        self.seq += 1;
        let path =
            self.root
                .join(TMP_DIR)
                .join(format!("{}-{}.partial", std::process::id(), self.seq));
        let file = create_private_file(&path)?;
        let pending = PendingFile {
            file,
            path,
            committed: false,
        };
        pending.file.lock()?;
        Ok(pending)
    }

    /// Makes a fully written file an entry: `fsync`, `rename` into place,
    /// `fsync` of the directory; then drops entries it covers (same key,
    /// tokens a prefix of these) and evicts down to the cap.
    ///
    /// Errors: I/O errors (the temporary file is removed).
    pub fn commit(
        &mut self,
        mut pending: PendingFile,
        digest: &str,
        tokens: Vec<u32>,
        bytes: u64,
    ) -> std::io::Result<()> {
        pending.file.sync_all()?;
        let dir = self.root.join(ENTRIES_DIR).join(digest);
        create_private_dir(&dir)?;
        let path = dir.join(entry_file_name(&tokens));
        std::fs::rename(&pending.path, &path)?;
        pending.committed = true;
        // The rename is durable once the directory is synced.
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        let tokens: Arc<[u32]> = tokens.into();
        let covered: Vec<PathBuf> = self
            .entries
            .iter()
            .filter(|e| e.digest == digest && tokens.starts_with(&e.tokens) && e.path != path)
            .map(|e| e.path.clone())
            .collect();
        for p in covered {
            let _ = std::fs::remove_file(&p);
            self.entries.retain(|e| e.path != p);
        }
        self.entries.retain(|e| e.path != path);
        self.entries.push(StoredEntry {
            path,
            digest: digest.to_string(),
            tokens,
            bytes,
            last_used: SystemTime::now(),
        });
        self.counters.writes += 1;
        self.counters.bytes_written += bytes;
        self.evict_to_cap();
        Ok(())
    }

    fn evict_to_cap(&mut self) {
        while self.bytes() > self.max_bytes {
            let Some((oldest, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
            else {
                break;
            };
            let e = self.entries.remove(oldest);
            let _ = std::fs::remove_file(&e.path);
            self.counters.evictions += 1;
        }
    }

    /// Drops `path` from the index (the file is already gone).
    pub fn forget(&mut self, path: &Path) {
        self.entries.retain(|e| e.path != path);
    }

    /// Moves `path` to `quarantine/` (and out of the index), logging why.
    pub fn quarantine(&mut self, path: &Path, reason: &str) {
        tracing::warn!(file = %path.display(), reason, "SSD cache file quarantined");
        self.entries.retain(|e| e.path != path);
        let qdir = self.root.join(QUARANTINE_DIR);
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let parent = path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = qdir.join(format!("{stamp}-{parent}-{name}"));
        if std::fs::rename(path, &target).is_err() {
            // Never leave it where it would be read again.
            let _ = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir_all(path));
        }
        self.counters.quarantined += 1;
        self.trim_quarantine();
    }

    fn trim_quarantine(&self) {
        let Ok(rd) = std::fs::read_dir(self.root.join(QUARANTINE_DIR)) else {
            return;
        };
        let mut files: Vec<(SystemTime, PathBuf)> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        if files.len() <= QUARANTINE_KEEP {
            return;
        }
        files.sort();
        for (_, p) in &files[..files.len() - QUARANTINE_KEEP] {
            let _ = std::fs::remove_file(p).or_else(|_| std::fs::remove_dir_all(p));
        }
    }

    /// Bytes held by entries (every key).
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Entries under `digest`.
    pub fn entries_for(&self, digest: &str) -> usize {
        self.entries.iter().filter(|e| e.digest == digest).count()
    }

    /// Entries of every key.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the store holds no entry at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The byte cap.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every indexed entry (tests, tools).
    pub fn entries(&self) -> &[StoredEntry] {
        &self.entries
    }
}

/// Indexes one file: its header must verify and its key must hash to the
/// directory it is in.
fn read_entry(path: &Path, digest: &str) -> Result<StoredEntry, FormatError> {
    let file = File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(FormatError::Corrupt("not a regular file".into()));
    }
    let header = format::read_header(&file)?;
    if super::key_digest(&header.key) != digest {
        return Err(FormatError::Corrupt(
            "its key does not match its directory".into(),
        ));
    }
    Ok(StoredEntry {
        path: path.to_path_buf(),
        digest: digest.to_string(),
        tokens: header.tokens.into(),
        bytes: meta.len(),
        last_used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    })
}
