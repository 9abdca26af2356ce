//! A folder of adapters (`--lora-dir DIR`): each subfolder holding an
//! adapter in a format [`super::read`] knows is served under the
//! subfolder's name. The folder is polled like the plugins directory: an
//! adapter whose files changed is reloaded once they have stayed the same
//! for one poll (a copy in progress is not read half-written); one whose
//! new files fail keeps its last good load; a removed one goes, unless a
//! waiting request names it (it goes once that one has started). Rows
//! hold their adapter (`Rc`) for their whole life, so a reload never
//! swaps an adapter under a running row.
//!
//! The engine thread owns the set (MLX arrays stay on it); HTTP handlers
//! see a [`LoraListing`] of names and facts, refreshed on every change.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use super::{LoraAdapter, LoraError, LoraTargets};

/// What HTTP handlers know of an adapter.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoraInfo {
    /// The name requests use (the subfolder's).
    pub name: String,
    /// `mlx` or `peft`.
    pub format: String,
    /// The largest rank among its modules.
    pub rank: i32,
    /// The projections it adapts (`self_attn.q_proj`, ...).
    pub modules: Vec<String>,
    /// Content digest (its prompt-cache namespace).
    pub fingerprint: String,
}

/// The adapters being served, shared with HTTP handlers.
pub type LoraListing = Arc<RwLock<Vec<LoraInfo>>>;

/// A subfolder's files as last seen: (newest modification, total bytes,
/// file count).
type Stamp = (SystemTime, u64, usize);

/// How often [`LoraSet::poll`] looks at the folder.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The adapters of a folder, fitted to one model.
#[derive(Default)]
pub struct LoraSet {
    dir: Option<PathBuf>,
    targets: Option<LoraTargets>,
    inner: RefCell<Inner>,
    listing: LoraListing,
}

#[derive(Default)]
struct Inner {
    adapters: BTreeMap<String, (Rc<LoraAdapter>, Stamp)>,
    /// Stamps seen at the last poll, for adapters not (re)loaded yet.
    seen: BTreeMap<String, Stamp>,
    /// Why a subfolder failed, by name, and the files that failed.
    failed: BTreeMap<String, (String, Stamp)>,
    last_poll: Option<Instant>,
}

/// Whether `name` may name an adapter: 1-64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl LoraSet {
    /// Loads every adapter under `dir` for a model with `targets` (`None`:
    /// the architecture runs no adapters). A subfolder that fails is
    /// logged and skipped (see [`LoraSet::failures`]).
    ///
    /// Errors: `dir` is not a folder; the model takes no adapters.
    pub fn open(dir: &Path, targets: Option<LoraTargets>) -> Result<LoraSet, LoraError> {
        let Some(targets) = targets else {
            return Err(LoraError::Unsupported(
                "only Llama-family models (llama, qwen2, qwen3) run adapters".into(),
            ));
        };
        if !dir.is_dir() {
            return Err(LoraError::invalid(dir, "--lora-dir is not a folder"));
        }
        let set = LoraSet {
            dir: Some(dir.to_path_buf()),
            targets: Some(targets),
            ..Default::default()
        };
        set.scan(true, &|_| false);
        Ok(set)
    }

    /// Fits the adapter folder `dir` to a model with `targets` on its own,
    /// named `name` (for `score --lora`).
    pub fn load_one(
        name: &str,
        dir: &Path,
        targets: Option<LoraTargets>,
    ) -> Result<LoraAdapter, LoraError> {
        let targets = targets.ok_or_else(|| {
            LoraError::Unsupported(
                "only Llama-family models (llama, qwen2, qwen3) run adapters".into(),
            )
        })?;
        LoraAdapter::build(name, super::read(dir)?, &targets)
    }

    /// The adapter served as `name`.
    pub fn get(&self, name: &str) -> Option<Rc<LoraAdapter>> {
        self.inner
            .borrow()
            .adapters
            .get(name)
            .map(|(a, _)| a.clone())
    }

    /// Names served now.
    pub fn names(&self) -> Vec<String> {
        self.inner.borrow().adapters.keys().cloned().collect()
    }

    /// Subfolders that failed to load, with why.
    pub fn failures(&self) -> BTreeMap<String, String> {
        self.inner
            .borrow()
            .failed
            .iter()
            .map(|(n, (why, _))| (n.clone(), why.clone()))
            .collect()
    }

    /// Whether a folder is watched.
    pub fn watching(&self) -> bool {
        self.dir.is_some()
    }

    /// The listing HTTP handlers read.
    pub fn listing(&self) -> LoraListing {
        self.listing.clone()
    }

    /// Looks at the folder when [`POLL_INTERVAL`] has passed since the last
    /// look, and applies settled changes; `keep(name)`: a removed adapter
    /// still named by a waiting request stays for now. Returns whether the
    /// served set changed.
    pub fn poll(&self, keep: &dyn Fn(&str) -> bool) -> bool {
        if self.dir.is_none() {
            return false;
        }
        let due = self
            .inner
            .borrow()
            .last_poll
            .is_none_or(|t| t.elapsed() >= POLL_INTERVAL);
        if !due {
            return false;
        }
        self.scan(false, keep)
    }

    /// One look at the folder (`initial`: load what is there at once).
    fn scan(&self, initial: bool, keep: &dyn Fn(&str) -> bool) -> bool {
        let (Some(dir), Some(targets)) = (&self.dir, &self.targets) else {
            return false;
        };
        let mut inner = self.inner.borrow_mut();
        inner.last_poll = Some(Instant::now());
        let mut present = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let path = e.path();
                let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                    continue;
                };
                if !path.is_dir() || name.starts_with('.') {
                    continue;
                }
                if !valid_name(name) {
                    inner.failed.insert(
                        name.to_string(),
                        (
                            "an adapter's folder name must be 1-64 of A-Z a-z 0-9 . _ -".into(),
                            stamp(&path),
                        ),
                    );
                    continue;
                }
                present.insert(name.to_string(), (stamp(&path), path));
            }
        }
        let mut changed = false;
        // Removed.
        let gone: Vec<String> = inner
            .adapters
            .keys()
            .filter(|n| !present.contains_key(*n) && !keep(n))
            .cloned()
            .collect();
        for name in gone {
            inner.adapters.remove(&name);
            tracing::info!(adapter = %name, "LoRA adapter removed");
            changed = true;
        }
        inner.failed.retain(|n, _| present.contains_key(n));
        inner.seen.retain(|n, _| present.contains_key(n));
        for (name, (now, path)) in present {
            if inner.adapters.get(&name).is_some_and(|(_, s)| *s == now) {
                continue;
            }
            // Settled: the same files as at the previous look.
            let settled = initial || inner.seen.get(&name) == Some(&now);
            inner.seen.insert(name.clone(), now);
            let failed_before = inner.failed.get(&name).is_some_and(|(_, s)| *s == now);
            if !settled || failed_before {
                continue;
            }
            match super::read(&path).and_then(|raw| LoraAdapter::build(&name, raw, targets)) {
                Ok(a) => {
                    tracing::info!(
                        adapter = %name,
                        format = a.format,
                        rank = a.rank,
                        bytes = a.nbytes(),
                        "LoRA adapter loaded"
                    );
                    inner.failed.remove(&name);
                    inner.adapters.insert(name, (Rc::new(a), now));
                    changed = true;
                }
                Err(e) => {
                    let kept = inner.adapters.contains_key(&name);
                    tracing::warn!(adapter = %name, error = %e, kept, "LoRA adapter failed to load");
                    inner.failed.insert(name, (e.to_string(), now));
                }
            }
        }
        if changed || initial {
            let infos = inner
                .adapters
                .values()
                .map(|(a, _)| LoraInfo {
                    name: a.name.clone(),
                    format: a.format.to_string(),
                    rank: a.rank,
                    modules: a.modules.iter().map(|m| m.path().to_string()).collect(),
                    fingerprint: a.fingerprint.clone(),
                })
                .collect();
            if let Ok(mut l) = self.listing.write() {
                *l = infos;
            }
        }
        changed
    }
}

/// The newest modification time, total size and count of the files in
/// `dir` (not recursive).
fn stamp(dir: &Path) -> Stamp {
    let mut out = (SystemTime::UNIX_EPOCH, 0, 0);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if let Ok(m) = e.metadata() {
                if m.is_file() {
                    out.0 = out.0.max(m.modified().unwrap_or(SystemTime::UNIX_EPOCH));
                    out.1 += m.len();
                    out.2 += 1;
                }
            }
        }
    }
    out
}
