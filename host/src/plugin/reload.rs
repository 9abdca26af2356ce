//! Hot reload: the plugins directory is polled, and when what is in it has
//! changed (and stayed unchanged for one more poll, so a half-copied file is
//! never loaded) the whole directory is loaded again into a new
//! [`PluginHost`] that replaces the current one for new requests. Requests
//! in flight keep the snapshot they started with (an `Arc`), so nothing is
//! dropped; the old host is freed when the last of them finishes.
//! Unchanged components come from the compiled-component cache, so a reload
//! costs milliseconds.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use super::runtime::{PluginError, PluginHost, PluginLimits};

/// What a plugins directory looks like to the poller: every file of every
/// plugin folder, with its size and modification time.
type Stamp = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// The current plugins of a directory, replaced atomically on change.
pub struct LivePlugins {
    dir: PathBuf,
    current: RwLock<Arc<PluginHost>>,
    loaded_stamp: Mutex<Stamp>,
    last_seen: Mutex<Stamp>,
    vocab: std::sync::OnceLock<Arc<super::vocab::VocabView>>,
}

fn stamp(dir: &Path) -> Stamp {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for folder in entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()) {
        let Ok(files) = std::fs::read_dir(&folder) else {
            continue;
        };
        for f in files.flatten() {
            if let Ok(meta) = f.metadata() {
                if meta.is_file() {
                    out.push((f.path(), meta.len(), meta.modified().ok()));
                }
            }
        }
    }
    out.sort();
    out
}

impl LivePlugins {
    /// Loads `dir` (see [`PluginHost::load_dir`] for errors).
    pub fn load(dir: &Path, limits: PluginLimits) -> Result<Arc<Self>, PluginError> {
        let before = stamp(dir);
        let host = PluginHost::load_dir(dir, limits)?;
        Ok(Arc::new(LivePlugins {
            dir: dir.into(),
            current: RwLock::new(Arc::new(host)),
            loaded_stamp: Mutex::new(before.clone()),
            last_seen: Mutex::new(before),
            vocab: std::sync::OnceLock::new(),
        }))
    }

    /// Lends the model's vocabulary to the current plugins and every reload.
    pub fn set_vocab(&self, vocab: Arc<super::vocab::VocabView>) {
        let _ = self.vocab.set(vocab.clone());
        self.current().set_vocab(vocab);
    }

    /// The plugins new requests use.
    pub fn current(&self) -> Arc<PluginHost> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// One poll: reloads when the directory changed since the last load and
    /// has not changed since the previous poll. Returns the new host when it
    /// reloaded. A directory that vanished keeps the current plugins.
    pub fn poll(&self) -> Option<Arc<PluginHost>> {
        let now = stamp(&self.dir);
        let mut last = self.last_seen.lock().unwrap_or_else(|p| p.into_inner());
        let settled = *last == now;
        *last = now.clone();
        drop(last);
        let mut loaded = self.loaded_stamp.lock().unwrap_or_else(|p| p.into_inner());
        if !settled || *loaded == now {
            return None;
        }
        match self.current().reload(&self.dir) {
            Ok(host) => {
                if let Some(v) = self.vocab.get() {
                    host.set_vocab(v.clone());
                }
                let host = Arc::new(host);
                *loaded = now;
                let names: Vec<&str> = host.plugins.keys().map(String::as_str).collect();
                tracing::info!(plugins = ?names, skipped = host.skipped.len(), kept = host.kept.len(), "plugins reloaded");
                match self.current.write() {
                    Ok(mut g) => *g = host.clone(),
                    Err(poisoned) => *poisoned.into_inner() = host.clone(),
                }
                // `set_vocab` may have run between the check above and the
                // swap; lending twice is a no-op.
                if let Some(v) = self.vocab.get() {
                    host.set_vocab(v.clone());
                }
                Some(host)
            }
            Err(e) => {
                tracing::warn!(error = %e, "plugins directory changed but could not be loaded; keeping the current plugins");
                *loaded = now;
                None
            }
        }
    }

    /// Polls every `every` on a background thread for as long as `self`
    /// lives elsewhere.
    pub fn watch(self: &Arc<Self>, every: Duration) -> std::io::Result<()> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("plugin-reload".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                match weak.upgrade() {
                    Some(live) => {
                        live.poll();
                    }
                    None => break,
                }
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reload_waits_for_the_directory_to_settle_and_skips_unchanged_polls() {
        let d = tempfile::tempdir().unwrap();
        let live = LivePlugins::load(d.path(), PluginLimits::default()).unwrap();
        assert!(live.poll().is_none(), "nothing changed");
        let p = d.path().join("x");
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("plugin.toml"), "name = \"x\"").unwrap();
        assert!(
            live.poll().is_none(),
            "changed since the last poll: not settled yet"
        );
        let reloaded = live.poll().expect("settled: reloads");
        assert_eq!(
            reloaded.skipped.len(),
            1,
            "the broken manifest is reported as skipped"
        );
        assert!(Arc::ptr_eq(&reloaded, &live.current()));
        assert!(live.poll().is_none(), "no change since the reload");
    }
}
