//! The response store: small opaque values that API adapters keep between
//! requests (OpenAI Responses' stored responses: `store`,
//! `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`), served to
//! them through WIT 0.2.0's `response-store` interface.
//!
//! Values are namespaced by adapter (an adapter reads only what it wrote),
//! expire `ttl` after they were written, and the least recently used go
//! first when the total exceeds `max_bytes`. With a directory (the SSD
//! cache's `responses/` folder) every value is also a file,
//! `DIR/<namespace>/<key>.bin`, written atomically (temporary file +
//! rename), so stored responses survive restarts; the directory is then the
//! truth and RAM keeps only the index. Writes run on the request's thread:
//! values are kilobytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// Why a value could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A key or namespace outside `[A-Za-z0-9_-]{1,128}` (they name files).
    #[error("store key `{0}` must be 1-128 characters of A-Z, a-z, 0-9, `_` and `-`")]
    BadKey(String),
    /// A value larger than the whole store.
    #[error("a value of {bytes} bytes exceeds the response store's cap of {cap} bytes (--response-store-max)")]
    TooLarge {
        /// The value's size, bytes.
        bytes: usize,
        /// The store's cap, bytes.
        cap: u64,
    },
    /// The disk copy could not be written.
    #[error("the response store could not write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Settings of a [`ResponseStore`].
#[derive(Debug, Clone)]
pub struct ResponseStoreConfig {
    /// How long a value lives after it is written.
    pub ttl: Duration,
    /// Cap on the total size of the values, bytes.
    pub max_bytes: u64,
    /// Where values are kept across restarts; `None` = RAM only.
    pub dir: Option<PathBuf>,
}

struct Entry {
    bytes: u64,
    written: SystemTime,
    last_used: u64,
    /// The value, when it lives in RAM (no directory).
    value: Option<Arc<Vec<u8>>>,
}

struct Inner {
    entries: HashMap<(String, String), Entry>,
    total: u64,
    clock: u64,
}

/// Counters for `/stats`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ResponseStoreStats {
    /// Values held.
    pub entries: usize,
    /// Their total size, bytes.
    pub bytes: u64,
    /// The cap, bytes.
    pub max_bytes: u64,
}

/// Adapter-owned values with a TTL and a byte cap (see the module docs).
pub struct ResponseStore {
    config: ResponseStoreConfig,
    inner: Mutex<Inner>,
}

fn valid_name(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ResponseStore {
    /// A store; with a directory, the values already there (from an earlier
    /// run) are indexed: expired ones and files of other names are removed.
    ///
    /// Errors: the directory cannot be created or read.
    pub fn open(config: ResponseStoreConfig) -> std::io::Result<Self> {
        let store = ResponseStore {
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                total: 0,
                clock: 0,
            }),
            config,
        };
        if let Some(dir) = store.config.dir.clone() {
            // Private to the user, as the KV cache's folders are: stored
            // conversations are as sensitive as the prompts.
            super::ssd::store::create_private_dir(&dir)?;
            store.index_dir(&dir)?;
        }
        Ok(store)
    }

    fn index_dir(&self, dir: &Path) -> std::io::Result<()> {
        let now = SystemTime::now();
        let mut found = Vec::new();
        for ns in std::fs::read_dir(dir)?.flatten() {
            let ns_path = ns.path();
            let Some(namespace) = ns_path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !ns_path.is_dir() || !valid_name(namespace) {
                continue;
            }
            for f in std::fs::read_dir(&ns_path)?.flatten() {
                let path = f.path();
                let key = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".bin"))
                    .filter(|k| valid_name(k))
                    .map(str::to_string);
                let meta = f.metadata();
                match (key, meta) {
                    (Some(key), Ok(m)) if m.is_file() => {
                        let written = m.modified().unwrap_or(now);
                        if self.expired(written, now) {
                            let _ = std::fs::remove_file(&path);
                        } else {
                            found.push((namespace.to_string(), key, m.len(), written));
                        }
                    }
                    // Leftover temporary files of an interrupted write
                    // (an hour old: not one being written right now).
                    (_, Ok(m)) if m.is_file() => {
                        let age = m.modified().ok().and_then(|t| now.duration_since(t).ok());
                        if age.is_some_and(|a| a > Duration::from_secs(3600)) {
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                    _ => {}
                }
            }
        }
        // Oldest first, so that eviction order follows write order.
        found.sort_by_key(|f| f.3);
        let mut inner = self.lock();
        for (namespace, key, bytes, written) in found {
            inner.clock += 1;
            let last_used = inner.clock;
            inner.total += bytes;
            inner.entries.insert(
                (namespace, key),
                Entry {
                    bytes,
                    written,
                    last_used,
                    value: None,
                },
            );
        }
        self.evict(&mut inner);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves a consistent map (every
        // mutation is a single insert/remove), so a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn expired(&self, written: SystemTime, now: SystemTime) -> bool {
        now.duration_since(written).unwrap_or_default() > self.config.ttl
    }

    fn path(&self, namespace: &str, key: &str) -> Option<PathBuf> {
        self.config
            .dir
            .as_ref()
            .map(|d| d.join(namespace).join(format!("{key}.bin")))
    }

    fn remove(&self, inner: &mut Inner, id: &(String, String)) -> bool {
        let Some(e) = inner.entries.remove(id) else {
            return false;
        };
        inner.total -= e.bytes;
        if let Some(path) = self.path(&id.0, &id.1) {
            let _ = std::fs::remove_file(path);
        }
        true
    }

    /// Drops expired values, then the least recently used beyond the cap.
    fn evict(&self, inner: &mut Inner) {
        let now = SystemTime::now();
        let stale: Vec<(String, String)> = inner
            .entries
            .iter()
            .filter(|(_, e)| self.expired(e.written, now))
            .map(|(k, _)| k.clone())
            .collect();
        for id in stale {
            self.remove(inner, &id);
        }
        while inner.total > self.config.max_bytes {
            let Some(oldest) = inner
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.remove(inner, &oldest);
        }
    }

    /// Stores `value` under (`namespace`, `key`), replacing an earlier one.
    ///
    /// Errors: [`StoreError::BadKey`], [`StoreError::TooLarge`] (over the
    /// whole cap), [`StoreError::Io`] (the file could not be written; the
    /// earlier value, if any, is kept).
    pub fn put(&self, namespace: &str, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        for name in [namespace, key] {
            if !valid_name(name) {
                return Err(StoreError::BadKey(name.to_string()));
            }
        }
        if value.len() as u64 > self.config.max_bytes {
            return Err(StoreError::TooLarge {
                bytes: value.len(),
                cap: self.config.max_bytes,
            });
        }
        let bytes = value.len() as u64;
        let in_ram = match self.path(namespace, key) {
            Some(path) => {
                write_atomically(&path, &value).map_err(|source| StoreError::Io {
                    path: path.clone(),
                    source,
                })?;
                None
            }
            None => Some(Arc::new(value)),
        };
        let mut inner = self.lock();
        let id = (namespace.to_string(), key.to_string());
        if let Some(old) = inner.entries.remove(&id) {
            inner.total -= old.bytes;
        }
        inner.clock += 1;
        let last_used = inner.clock;
        inner.total += bytes;
        inner.entries.insert(
            id,
            Entry {
                bytes,
                written: SystemTime::now(),
                last_used,
                value: in_ram,
            },
        );
        self.evict(&mut inner);
        Ok(())
    }

    /// The value under (`namespace`, `key`); `None` when absent, expired,
    /// or its file is gone or unreadable (then it is dropped).
    pub fn get(&self, namespace: &str, key: &str) -> Option<Vec<u8>> {
        let id = (namespace.to_string(), key.to_string());
        let mut inner = self.lock();
        let now = SystemTime::now();
        let expired = self.expired(inner.entries.get(&id)?.written, now);
        if expired {
            self.remove(&mut inner, &id);
            return None;
        }
        inner.clock += 1;
        let clock = inner.clock;
        let entry = inner.entries.get_mut(&id)?;
        entry.last_used = clock;
        if let Some(v) = &entry.value {
            return Some(v.as_ref().clone());
        }
        let path = self.path(namespace, key)?;
        match std::fs::read(&path) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "stored response unreadable; dropped");
                self.remove(&mut inner, &id);
                None
            }
        }
    }

    /// Removes (`namespace`, `key`); whether it was there (and not expired).
    pub fn delete(&self, namespace: &str, key: &str) -> bool {
        let id = (namespace.to_string(), key.to_string());
        let mut inner = self.lock();
        let live = inner
            .entries
            .get(&id)
            .is_some_and(|e| !self.expired(e.written, SystemTime::now()));
        self.remove(&mut inner, &id) && live
    }

    /// Entries, bytes and the cap.
    pub fn stats(&self) -> ResponseStoreStats {
        let inner = self.lock();
        ResponseStoreStats {
            entries: inner.entries.len(),
            bytes: inner.total,
            max_bytes: self.config.max_bytes,
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder
/// and a rename, so a reader (or a crash) never sees half a value.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a stored value's path has no folder"))?;
    super::ssd::store::create_private_dir(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram(max_bytes: u64, ttl: Duration) -> ResponseStore {
        ResponseStore::open(ResponseStoreConfig {
            ttl,
            max_bytes,
            dir: None,
        })
        .unwrap()
    }

    #[test]
    fn put_get_delete_per_namespace() {
        let s = ram(1 << 20, Duration::from_secs(60));
        s.put("responses", "resp_1", b"one".to_vec()).unwrap();
        assert_eq!(s.get("responses", "resp_1").unwrap(), b"one");
        // Another adapter does not see it.
        assert!(s.get("other", "resp_1").is_none());
        s.put("responses", "resp_1", b"uno".to_vec()).unwrap();
        assert_eq!(s.get("responses", "resp_1").unwrap(), b"uno");
        assert_eq!(s.stats().bytes, 3);
        assert!(s.delete("responses", "resp_1"));
        assert!(!s.delete("responses", "resp_1"));
        assert!(s.get("responses", "resp_1").is_none());
        assert_eq!(s.stats().bytes, 0);
    }

    #[test]
    fn keys_that_are_not_file_names_are_refused() {
        let s = ram(1 << 20, Duration::from_secs(60));
        for key in ["", "../x", "a/b", "a.b", &"k".repeat(129)] {
            assert!(matches!(
                s.put("ns", key, vec![1]),
                Err(StoreError::BadKey(_))
            ));
        }
        assert!(matches!(
            s.put("n s", "k", vec![1]),
            Err(StoreError::BadKey(_))
        ));
    }

    #[test]
    fn least_recently_used_go_first_beyond_the_cap() {
        let s = ram(10, Duration::from_secs(60));
        s.put("ns", "a", vec![0; 4]).unwrap();
        s.put("ns", "b", vec![0; 4]).unwrap();
        assert!(s.get("ns", "a").is_some()); // a is now more recent than b
        s.put("ns", "c", vec![0; 4]).unwrap();
        assert!(s.get("ns", "a").is_some());
        assert!(s.get("ns", "b").is_none());
        assert!(s.get("ns", "c").is_some());
        assert!(s.stats().bytes <= 10);
        assert!(matches!(
            s.put("ns", "big", vec![0; 11]),
            Err(StoreError::TooLarge { bytes: 11, cap: 10 })
        ));
    }

    #[test]
    fn values_expire_after_the_ttl() {
        let s = ram(1 << 20, Duration::from_millis(0));
        s.put("ns", "a", vec![1]).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(s.get("ns", "a").is_none());
        assert!(!s.delete("ns", "a"));
    }

    #[test]
    fn a_directory_keeps_values_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let config = ResponseStoreConfig {
            ttl: Duration::from_secs(60),
            max_bytes: 1 << 20,
            dir: Some(dir.path().to_path_buf()),
        };
        {
            let s = ResponseStore::open(config.clone()).unwrap();
            s.put("responses", "resp_a", b"kept".to_vec()).unwrap();
            s.put("responses", "resp_b", b"gone".to_vec()).unwrap();
            assert!(s.delete("responses", "resp_b"));
        }
        // Another file there (a write in progress) is neither a value nor removed.
        std::fs::write(dir.path().join("responses").join(".tmpXYZ"), b"x").unwrap();
        let s = ResponseStore::open(config).unwrap();
        assert_eq!(s.get("responses", "resp_a").unwrap(), b"kept");
        assert!(s.get("responses", "resp_b").is_none());
        assert_eq!(s.stats().entries, 1);
        assert!(dir.path().join("responses").join(".tmpXYZ").exists());
    }

    #[cfg(unix)]
    #[test]
    fn its_folders_are_private_to_the_user() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("responses-root");
        let s = ResponseStore::open(ResponseStoreConfig {
            ttl: Duration::from_secs(60),
            max_bytes: 1 << 20,
            dir: Some(root.clone()),
        })
        .unwrap();
        s.put("responses", "resp_a", b"x".to_vec()).unwrap();
        for d in [root.clone(), root.join("responses")] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
    }
}
