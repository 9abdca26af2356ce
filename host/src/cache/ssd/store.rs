//! The SSD tier's directory and its in-memory index.
//!
//! ```text
//! DIR/                          created 0700 (cached prompts are user data)
//! DIR/lock                      held (exclusive `flock`) by the one server using DIR
//! DIR/v1/<key digest>/<tokens hash>-<len>.kv   entries (format v1), 0600
//! DIR/tmp/<n>.partial           files being written
//! DIR/quarantine/               files that failed verification, newest 32 kept
//! ```
//!
//! One server uses a directory at a time (a second one is refused at
//! start), so the index is the truth and the cap holds for the directory.
//! A file gets its final name only by `rename` after `fsync`, so a writer
//! killed at any point leaves at most an orphaned `.partial`, which the next
//! start removes. Every entry's header is
//! read and verified when the store opens; a file that fails is moved to
//! `quarantine/` and never read again. The byte cap covers every entry under
//! `v1/` (all models); the least recently used go first, judged by the
//! file's modification time, which a restore refreshes.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use super::format::{self, FormatError};
use crate::cache::common_prefix;

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
    /// The fewest leading tokens a restore may keep (sliding-window
    /// layers; 0: any prefix).
    pub resume_from: usize,
    /// Where a hybrid entry's recurrent states are stored: the only
    /// lengths it can be trimmed to (empty: any from `resume_from`).
    pub state_positions: Vec<u64>,
    /// File length, bytes.
    pub bytes: u64,
    /// Last write or restore (LRU order).
    pub last_used: SystemTime,
}

impl StoredEntry {
    /// The longest length at most `shared` this entry can be trimmed to
    /// (a hybrid entry: the last state position at most `shared`; 0: none).
    pub fn usable(&self, shared: usize) -> usize {
        if self.state_positions.is_empty() {
            return shared;
        }
        self.state_positions
            .iter()
            .map(|&p| p as usize)
            .filter(|&p| p <= shared)
            .max()
            .unwrap_or(0)
    }
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
    /// Held for the store's life: the directory's exclusive lock.
    _lock: File,
    /// Counters.
    pub counters: StoreCounters,
}

/// Why a store cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Another process holds the directory.
    #[error("another mlxhost server is using this directory (one server per SSD cache directory)")]
    Busy,
    /// The directory belongs to someone else or is writable by others.
    #[error("{0}")]
    Unsafe(String),
    /// I/O.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A file being written: commit it with [`Store::commit`] or drop it (the
/// temporary file is then removed).
pub struct PendingFile {
    /// Write here.
    pub file: File,
    path: PathBuf,
    committed: bool,
}

impl PendingFile {
    /// Makes the fully written file an entry at `path` (from
    /// [`Store::entry_path`]): `fsync`, `rename` into place, `fsync` of the
    /// directory. Runs without the store's lock (the disk can be slow);
    /// index it with [`Store::commit`] afterwards.
    ///
    /// Errors: I/O errors (the temporary file is removed).
    pub fn publish(mut self, path: &Path) -> std::io::Result<()> {
        self.file.sync_all()?;
        let dir = path
            .parent()
            .ok_or_else(|| std::io::Error::other("an entry path has a directory"))?;
        let created = !dir.exists();
        create_private_dir(dir)?;
        std::fs::rename(&self.path, path)?;
        self.committed = true;
        // The rename (and a new key directory) are durable once the
        // directories are synced.
        for d in [Some(dir), created.then(|| dir.parent()).flatten()]
            .into_iter()
            .flatten()
        {
            if let Ok(d) = File::open(d) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// Deletes files (eviction victims, covered entries); missing ones are fine.
pub fn remove_files(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// A directory, not a symlink to one.
fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Cached prompts are user data: a directory of the store must be ours and
/// not writable by others (else another user could plant entries). Our own
/// subdirectories are made 0700; the root only gets a warning when others
/// can read it (the entries live in the private subdirectories).
fn check_private(dir: &Path, ours: &File, tighten: bool) -> Result<(), OpenError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let meta = std::fs::symlink_metadata(dir)?;
        let uid = ours.metadata()?.uid();
        if !meta.is_dir() || meta.uid() != uid {
            return Err(OpenError::Unsafe(format!(
                "{} is not a directory owned by this user",
                dir.display()
            )));
        }
        let mode = meta.permissions().mode() & 0o777;
        if tighten && mode != 0o700 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        } else if !tighten && mode & 0o022 != 0 {
            return Err(OpenError::Unsafe(format!(
                "{} is writable by other users (mode {mode:o}); use a private directory",
                dir.display()
            )));
        } else if !tighten && mode & 0o044 != 0 {
            tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"), "the SSD cache directory is readable by others; its entries are kept in private subdirectories");
        }
    }
    #[cfg(not(unix))]
    let _ = (dir, ours, tighten);
    Ok(())
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Creates `dir` (and parents) private to the user.
pub(crate) fn create_private_dir(dir: &Path) -> std::io::Result<()> {
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

/// Creates `root` (private) and takes its exclusive lock (the `lock` file,
/// held while the returned file is open), then checks the directory is
/// ours and not writable by others.
///
/// Errors: as [`Store::open`].
fn lock_dir(root: &Path) -> Result<File, OpenError> {
    if root.exists() && !root.is_dir() {
        return Err(OpenError::Unsafe(format!(
            "{} is not a directory",
            root.display()
        )));
    }
    create_private_dir(root)?;
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(root.join("lock"))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(OpenError::Busy),
        Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
    }
    check_private(root, &lock, false)?;
    Ok(lock)
}

impl Store {
    /// Checks, cheaply, that [`Store::open`] would get the directory: creates
    /// it, takes and releases its lock and checks it is private, without
    /// indexing entries. `serve` calls it before binding its port and
    /// loading the model, so a refused start fails at once.
    ///
    /// Errors: as [`Store::open`].
    pub fn check_usable(root: &Path) -> Result<(), OpenError> {
        lock_dir(root).map(drop)
    }

    /// Opens (creating) the store at `root`: takes the directory's lock,
    /// removes orphaned temporary files, indexes every entry (quarantining
    /// files that fail the header check) and evicts down to `max_bytes`.
    ///
    /// Errors: [`OpenError::Busy`] when another server holds the directory;
    /// [`OpenError::Unsafe`] when it (or a subdirectory) is not ours or is
    /// writable by others; I/O errors creating or listing it.
    pub fn open(root: &Path, max_bytes: u64) -> Result<Store, OpenError> {
        let lock = lock_dir(root)?;
        for sub in [ENTRIES_DIR, TMP_DIR, QUARANTINE_DIR] {
            create_private_dir(&root.join(sub))?;
            check_private(&root.join(sub), &lock, true)?;
        }
        let mut store = Store {
            root: root.to_path_buf(),
            max_bytes,
            entries: Vec::new(),
            seq: 0,
            _lock: lock,
            counters: StoreCounters::default(),
        };
        store.remove_orphans()?;
        store.scan()?;
        let victims = store.pick_victims();
        remove_files(&victims);
        Ok(store)
    }

    /// Temporary files: every one is an orphan, since we hold the lock.
    fn remove_orphans(&self) -> std::io::Result<()> {
        for e in std::fs::read_dir(self.root.join(TMP_DIR))? {
            let path = e?.path();
            tracing::debug!(file = %path.display(), "removing an orphaned partial write");
            let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path));
        }
        Ok(())
    }

    fn scan(&mut self) -> std::io::Result<()> {
        let entries_dir = self.root.join(ENTRIES_DIR);
        for key_dir in std::fs::read_dir(&entries_dir)? {
            let key_dir = key_dir?.path();
            if !is_real_dir(&key_dir) {
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
            let listing = match std::fs::read_dir(&key_dir) {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(dir = %key_dir.display(), error = %e, "SSD cache directory unreadable; skipped");
                    continue;
                }
            };
            for f in listing.flatten() {
                let path = f.path();
                match read_entry(&path, &digest) {
                    Ok(entry) => self.entries.push(entry),
                    Err(FormatError::Io(e)) => {
                        tracing::warn!(file = %path.display(), error = %e, "SSD cache file unreadable; skipped");
                    }
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
            .map(|e| (e.usable(common_prefix(&e.tokens, prompt).min(limit)), e))
            .filter(|(n, e)| *n > 0 && *n >= e.resume_from)
            .max_by_key(|(n, e)| (*n, e.last_used))
            .map(|(n, e)| (n, e.clone()))
    }

    /// Whether an entry under `digest` already holds `tokens` (or a longer
    /// sequence starting with them that can be trimmed back to them).
    pub fn covers(&self, digest: &str, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| {
            e.digest == digest
                && e.tokens.starts_with(tokens)
                && format::resumes_at(e.resume_from as u64, &e.state_positions, tokens.len())
        })
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

    /// A new temporary file.
    ///
    /// Errors: the file cannot be created.
    pub fn begin_write(&mut self) -> std::io::Result<PendingFile> {
        self.seq += 1;
        let path = self
            .root
            .join(TMP_DIR)
            .join(format!("{}.partial", self.seq));
        let _ = std::fs::remove_file(&path);
        let file = create_private_file(&path)?;
        Ok(PendingFile {
            file,
            path,
            committed: false,
        })
    }

    /// Where an entry of `digest` holding `tokens` lives.
    pub fn entry_path(&self, digest: &str, tokens: &[u32]) -> PathBuf {
        self.root
            .join(ENTRIES_DIR)
            .join(digest)
            .join(entry_file_name(tokens))
    }

    /// Indexes a file already in place (see [`PendingFile::publish`]) and
    /// returns the files to delete outside the lock: entries it covers
    /// (same key, tokens a prefix of these) and the least recently used
    /// beyond the cap.
    pub fn commit(
        &mut self,
        path: PathBuf,
        digest: &str,
        tokens: Vec<u32>,
        layout: &format::EntryLayout,
        bytes: u64,
    ) -> Vec<PathBuf> {
        let tokens: Arc<[u32]> = tokens.into();
        let mut victims: Vec<PathBuf> = self
            .entries
            .iter()
            .filter(|e| {
                e.digest == digest
                    && tokens.starts_with(&e.tokens)
                    && e.path != path
                    // Covered only if the new entry can be trimmed back to it.
                    && layout.resumes_at(e.tokens.len())
            })
            .map(|e| e.path.clone())
            .collect();
        self.entries
            .retain(|e| e.path != path && !victims.contains(&e.path));
        self.entries.push(StoredEntry {
            path,
            digest: digest.to_string(),
            tokens,
            resume_from: layout.resume_from as usize,
            state_positions: layout.state_positions.clone(),
            bytes,
            last_used: SystemTime::now(),
        });
        self.counters.writes += 1;
        self.counters.bytes_written += bytes;
        victims.extend(self.pick_victims());
        victims
    }

    /// Drops the least recently used entries from the index until the cap
    /// holds; returns their files (delete them outside the lock).
    fn pick_victims(&mut self) -> Vec<PathBuf> {
        let mut victims = Vec::new();
        while self.bytes() > self.max_bytes {
            let Some(e) = crate::cache::take_least_recent(&mut self.entries, |e| e.last_used)
            else {
                break;
            };
            victims.push(e.path);
            self.counters.evictions += 1;
        }
        victims
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
        let moved = std::fs::rename(path, &target).is_ok()
            // Never leave it where it would be read again.
            || std::fs::remove_file(path)
                .or_else(|_| std::fs::remove_dir_all(path))
                .is_ok();
        if moved {
            self.counters.quarantined += 1;
        }
        self.trim_quarantine();
    }

    fn trim_quarantine(&self) {
        let Ok(rd) = std::fs::read_dir(self.root.join(QUARANTINE_DIR)) else {
            return;
        };
        // Names start with the quarantine time in ms (mtime survives the
        // rename, so it would be the file's age, not its quarantine's).
        let mut files: Vec<(u128, PathBuf)> = rd
            .filter_map(|e| e.ok())
            .map(|e| {
                let stamp = e
                    .file_name()
                    .to_string_lossy()
                    .split('-')
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                (stamp, e.path())
            })
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
    // Checked before opening: opening a FIFO would block.
    if !std::fs::symlink_metadata(path)?.is_file() {
        return Err(FormatError::Corrupt("not a regular file".into()));
    }
    let file = File::open(path)?;
    let meta = file.metadata()?;
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
        resume_from: header.resume_from as usize,
        state_positions: header.state_positions,
        bytes: meta.len(),
        last_used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    })
}
