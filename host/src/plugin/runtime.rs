//! The wasmtime host: scanning a plugins directory, compiling (with an
//! on-disk cache), linking the `tensors` interface, and pre-instantiating
//! each plugin per world so a request's instance costs microseconds.
//!
//! No WASI is linked: a component importing anything beyond
//! `mlxhost:plugin/tensors` fails to pre-instantiate and is skipped with
//! that reason. Each instance gets a memory cap and an epoch deadline per
//! call (a ticker thread advances the epoch every [`EPOCH_TICK`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, StoreLimitsBuilder,
};

use super::bindings::v2::{
    adapter::ApiAdapterPluginPre as ApiAdapterV2Pre, reasoning_parser::ReasoningParserPluginPre,
    tool_parser::ToolCallParserPluginPre,
};
use super::bindings::v3::constraint::ConstraintPluginPre;
use super::bindings::v4::drafter::DrafterPluginPre;
use super::bindings::{
    adapter::ApiAdapterPluginPre, processor::LogitsProcessorPluginPre, sampler::SamplerPluginPre,
};
use super::constraint::{SharedConstraint, StoreMaker};
use super::manifest::{Kind, Manifest, WitVersion};
use super::tensors::PluginState;

/// Epoch granularity for call deadlines.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Limits applied to plugin instances, per kind. A call past its deadline
/// or an instance growing past its memory cap traps; that fails only the
/// request that made the call.
#[derive(Debug, Clone, Copy)]
pub struct PluginLimits {
    /// Linear memory cap per sampler/processor instance, bytes.
    pub memory_bytes: usize,
    /// Deadline per sampler call (`create`, `sample`, `accept`).
    pub sampler_deadline: Duration,
    /// Deadline per logits-processor call.
    pub processor_deadline: Duration,
    /// Deadline per API-adapter call.
    pub adapter_deadline: Duration,
    /// Linear memory cap per API-adapter instance, bytes (an adapter holds
    /// the request body and its parse).
    pub adapter_memory_bytes: usize,
    /// Linear memory cap of a constraint plugin's per-model instance,
    /// bytes: it holds the token trie and every constrained row's parser.
    pub constraint_memory_bytes: usize,
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits {
            memory_bytes: 64 << 20,
            sampler_deadline: Duration::from_millis(1000),
            processor_deadline: Duration::from_millis(1000),
            adapter_deadline: Duration::from_millis(1000),
            adapter_memory_bytes: 256 << 20,
            constraint_memory_bytes: 512 << 20,
        }
    }
}

impl PluginLimits {
    /// The most linear memory the pooling allocator reserves per instance.
    pub const MAX_MEMORY_BYTES: usize = 1 << 30;

    /// The deadline for calls into a plugin of `kind`.
    pub fn deadline(&self, kind: Kind) -> Duration {
        match kind {
            Kind::Sampler => self.sampler_deadline,
            Kind::LogitsProcessor | Kind::Constraint | Kind::Drafter => self.processor_deadline,
            Kind::ApiAdapter | Kind::ToolCallParser | Kind::ReasoningParser => {
                self.adapter_deadline
            }
        }
    }

    /// Epoch ticks for `kind`'s deadline (at least one full tick).
    pub fn deadline_ticks(&self, kind: Kind) -> u64 {
        (self.deadline(kind).as_millis() / EPOCH_TICK.as_millis()).max(1) as u64 + 1
    }
}

/// Errors from the plugin host.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// `--plugins DIR` does not exist or is not a directory.
    #[error("plugins directory {0} does not exist or is not a directory")]
    MissingDir(PathBuf),
    /// No loaded plugin has that name and kind.
    #[error("no {kind} plugin named `{name}` is loaded{hint}")]
    Unknown {
        /// Requested name.
        name: String,
        /// Requested kind.
        kind: Kind,
        /// What is available.
        hint: String,
    },
    /// The plugin failed (trap, deadline, memory limit, bad return, or an
    /// error it returned); the message names the plugin.
    #[error("plugin `{plugin}` failed: {cause}")]
    Failed {
        /// Plugin name.
        plugin: String,
        /// What happened.
        cause: String,
    },
    /// A constraint plugin rejected the request's grammar (invalid, or a
    /// feature it does not support): the client's fault, a 400 naming the
    /// request field the grammar came from.
    #[error("the `{plugin}` plugin rejected the grammar: {cause}")]
    Grammar {
        /// Plugin name.
        plugin: String,
        /// The request field, as the dialect spells it.
        field: String,
        /// What the plugin said.
        cause: String,
    },
    /// The plugin rejected the request's parameters (its session's `create`
    /// returned an error): the client's fault, a 400 over HTTP.
    #[error("plugin `{plugin}` rejected its parameters: {cause}")]
    Rejected {
        /// Plugin name.
        plugin: String,
        /// What the plugin said.
        cause: String,
    },
    /// The plugin ran out of its linear-memory cap while working on a
    /// client's input (an API adapter parsing a request body): the input is
    /// too large for the configured cap, a 413 over HTTP.
    #[error("plugin `{plugin}` ran out of its memory cap of {} MiB on this input", cap_bytes >> 20)]
    OutOfMemory {
        /// Plugin name.
        plugin: String,
        /// The instance's cap, bytes.
        cap_bytes: usize,
    },
    /// The wasmtime engine could not be set up.
    #[error("plugin engine: {0}")]
    Engine(String),
}

/// A plugin that loaded, with its pre-instantiated worlds. Cloning shares
/// the compiled component (a reload keeps a plugin's last good version).
#[derive(Clone)]
pub struct LoadedPlugin {
    /// Its manifest.
    pub manifest: Manifest,
    /// Its folder.
    pub dir: PathBuf,
    /// Sampler world, if declared.
    pub sampler: Option<SamplerPluginPre<PluginState>>,
    /// Logits-processor world, if declared.
    pub processor: Option<LogitsProcessorPluginPre<PluginState>>,
    /// API-adapter world, if declared (either WIT version).
    pub adapter: Option<AdapterPre>,
    /// Tool-call-parser world (0.2.0), if declared.
    pub tool_parser: Option<ToolCallParserPluginPre<PluginState>>,
    /// Reasoning-parser world (0.2.0), if declared.
    pub reasoning_parser: Option<ReasoningParserPluginPre<PluginState>>,
    /// Constraint world (0.3.0), if declared.
    pub constraint: Option<ConstraintPluginPre<PluginState>>,
    /// Drafter world (0.4.0), if declared.
    pub drafter: Option<DrafterPluginPre<PluginState>>,
    /// The adapter's routes as (method, path), asked once at load.
    pub routes: Vec<(String, String)>,
    /// Whether the compiled component came from the on-disk cache.
    pub from_cache: bool,
}

/// A pre-instantiated API adapter of either WIT version.
#[derive(Clone)]
pub enum AdapterPre {
    /// `mlxhost:plugin@0.1.0`.
    V1(ApiAdapterPluginPre<PluginState>),
    /// `mlxhost:plugin@0.2.0`.
    V2(ApiAdapterV2Pre<PluginState>),
}

/// A plugin folder that was skipped, and why.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// The folder.
    pub dir: PathBuf,
    /// The reason, for `plugins list` and the startup log.
    pub reason: String,
}

/// A plugin whose folder changed and no longer loads, still served in the
/// version that last loaded (hot reload never drops a working plugin for a
/// broken file).
#[derive(Debug, Clone)]
pub struct Kept {
    /// The plugin's name (of the version still served).
    pub name: String,
    /// Its folder.
    pub dir: PathBuf,
    /// Why the new files did not load.
    pub reason: String,
}

/// All plugins of a directory, ready to instantiate.
pub struct PluginHost {
    engine: Engine,
    /// Loaded plugins by name.
    pub plugins: BTreeMap<String, LoadedPlugin>,
    /// Folders that did not load.
    pub skipped: Vec<Skipped>,
    /// Of `plugins`, those served in their last good version because their
    /// folder's new files failed to load ([`PluginHost::reload`]).
    pub kept: Vec<Kept>,
    /// Instance limits.
    pub limits: PluginLimits,
    /// The model's vocabulary, lent to every instance (set once a model is loaded).
    vocab: std::sync::OnceLock<Arc<super::vocab::VocabView>>,
    /// Constraint plugins' per-model instances, by plugin name (built on
    /// first use; a reload starts new ones).
    constraints: std::sync::Mutex<BTreeMap<String, Arc<std::sync::Mutex<SharedConstraint>>>>,
    _ticker: Arc<EpochTicker>,
}

struct EpochTicker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl PluginHost {
    /// Scans `dir` (one folder per plugin: `plugin.toml` + component) and
    /// loads what it can; a broken plugin is skipped with its reason.
    ///
    /// Errors: [`PluginError::MissingDir`] when `dir` is missing.
    pub fn load_dir(dir: &Path, limits: PluginLimits) -> Result<Self, PluginError> {
        if !dir.is_dir() {
            return Err(PluginError::MissingDir(dir.into()));
        }
        let engine = make_engine()?;
        let ticker = start_ticker(&engine)?;
        Self::load_with(dir, limits, engine, ticker, None)
    }

    /// Loads `dir` again on this host's engine. A plugin folder that still
    /// exists but no longer loads (a half-written or corrupt component, a
    /// broken manifest) keeps the version `self` serves, listed in
    /// [`PluginHost::kept`] with the reason; a removed folder removes its
    /// plugin. Errors: [`PluginError::MissingDir`].
    pub fn reload(&self, dir: &Path) -> Result<Self, PluginError> {
        if !dir.is_dir() {
            return Err(PluginError::MissingDir(dir.into()));
        }
        Self::load_with(
            dir,
            self.limits,
            self.engine.clone(),
            self._ticker.clone(),
            Some(self),
        )
    }

    fn load_with(
        dir: &Path,
        limits: PluginLimits,
        engine: Engine,
        ticker: Arc<EpochTicker>,
        previous: Option<&PluginHost>,
    ) -> Result<Self, PluginError> {
        let mut linker: Linker<PluginState> = Linker::new(&engine);
        super::bindings::sampler::SamplerPlugin::add_to_linker::<_, wasmtime::component::HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| PluginError::Engine(e.to_string()))?;
        // 0.2.0's imports (`types`, `vocab`) live under their own versioned
        // names, so both versions share one linker; the parser world
        // imports everything the other 0.2.0 worlds do.
        super::bindings::v2::tool_parser::ToolCallParserPlugin::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        super::bindings::v2::adapter::mlxhost::plugin::request::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        // The adapter services (`response-store`, `prompt`).
        super::bindings::v2::adapter::mlxhost::plugin::response_store::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        super::bindings::v2::adapter::mlxhost::plugin::prompt::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        // 0.3.0: the constraint world's `vocabulary` and the adapters'
        // `structured-output`.
        super::bindings::v3::constraint::ConstraintPlugin::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        super::bindings::v3::structured_output::mlxhost::plugin0_3_0::structured_output::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        // 0.4.0: the adapters' `speculation` (the drafter world imports
        // nothing).
        super::bindings::v4::speculation::mlxhost::plugin0_4_0::speculation::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| PluginError::Engine(e.to_string()))?;
        let cache = crate::paths::cache_dir().join("components");
        let mut plugins = BTreeMap::new();
        let mut skipped = Vec::new();
        let mut failed = Vec::new();
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|_| PluginError::MissingDir(dir.into()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("plugin.toml").is_file())
            .collect();
        entries.sort();
        for pdir in entries {
            match load_one(&engine, &linker, &pdir, &cache, limits) {
                Ok(p) => {
                    if plugins.contains_key(&p.manifest.name) {
                        skipped.push(Skipped {
                            dir: pdir,
                            reason: format!("duplicate plugin name `{}`", p.manifest.name),
                        });
                    } else {
                        plugins.insert(p.manifest.name.clone(), p);
                    }
                }
                Err(reason) => failed.push(Skipped { dir: pdir, reason }),
            }
        }
        // A folder that loaded before keeps that version (same engine, so
        // its pre-instantiation stays valid) unless its name is now taken.
        let mut kept = Vec::new();
        for f in failed {
            let last_good = previous.and_then(|prev| {
                prev.plugins
                    .values()
                    .find(|p| p.dir == f.dir && !plugins.contains_key(&p.manifest.name))
            });
            match last_good {
                Some(p) => {
                    tracing::warn!(dir = %f.dir.display(), reason = %f.reason, plugin = %p.manifest.name, "plugin changed but does not load; keeping its last good version");
                    kept.push(Kept {
                        name: p.manifest.name.clone(),
                        dir: f.dir,
                        reason: f.reason,
                    });
                    plugins.insert(p.manifest.name.clone(), p.clone());
                }
                None => {
                    tracing::warn!(dir = %f.dir.display(), reason = %f.reason, "plugin skipped");
                    skipped.push(f);
                }
            }
        }
        for s in skipped.iter().filter(|s| s.reason.starts_with("duplicate")) {
            tracing::warn!(dir = %s.dir.display(), reason = %s.reason, "plugin skipped");
        }
        Ok(PluginHost {
            engine,
            plugins,
            skipped,
            kept,
            limits,
            vocab: std::sync::OnceLock::new(),
            constraints: std::sync::Mutex::new(BTreeMap::new()),
            _ticker: ticker,
        })
    }

    /// What `/stats` shows under `plugins`: the loaded plugins' names,
    /// those served in their last good version (`kept`: name, folder, why
    /// the new files failed) and the folders that did not load (`skipped`).
    pub fn status_json(&self) -> serde_json::Value {
        serde_json::json!({
            "loaded": self.plugins.keys().collect::<Vec<_>>(),
            "kept": self.kept.iter().map(|k| serde_json::json!({
                "name": k.name, "dir": k.dir.display().to_string(), "reason": k.reason,
            })).collect::<Vec<_>>(),
            "skipped": self.skipped.iter().map(|s| serde_json::json!({
                "dir": s.dir.display().to_string(), "reason": s.reason,
            })).collect::<Vec<_>>(),
        })
    }

    /// A fresh store for one instance of a plugin of `kind`, with this
    /// host's memory cap for that kind and the model's vocabulary.
    pub fn new_store(&self, kind: Kind) -> Store<PluginState> {
        let memory = match kind {
            Kind::ApiAdapter => self.limits.adapter_memory_bytes,
            _ => self.limits.memory_bytes,
        };
        let mut store = new_store(&self.engine, memory, self.limits.deadline_ticks(kind));
        store.data_mut().vocab = self.vocab.get().cloned();
        store
    }

    /// Lends the model's vocabulary to instances created from now on (the
    /// first call wins: one model per host).
    pub fn set_vocab(&self, vocab: Arc<super::vocab::VocabView>) {
        let _ = self.vocab.set(vocab);
    }

    /// Constraint plugin `name`'s per-model instance (one per host: the
    /// host serves one model), made on first use; its engine is built by
    /// its first session (or [`SharedConstraint::warm`]).
    ///
    /// Errors: no constraint plugin of that name is loaded.
    pub fn constraint(
        &self,
        name: &str,
    ) -> Result<Arc<std::sync::Mutex<SharedConstraint>>, PluginError> {
        let p = self.get(name, Kind::Constraint)?;
        let pre = p
            .constraint
            .clone()
            .ok_or_else(|| super::session::failed(name, "no constraint world"))?;
        let mut map = self.constraints.lock().unwrap_or_else(|e| e.into_inner());
        let shared = map.entry(name.to_string()).or_insert_with(|| {
            let stores = StoreMaker {
                engine: self.engine.clone(),
                memory_bytes: self.limits.constraint_memory_bytes,
                call_ticks: self.limits.deadline_ticks(Kind::Constraint),
                vocab: self.vocab.get().cloned(),
            };
            Arc::new(std::sync::Mutex::new(SharedConstraint::new(
                name,
                pre,
                stores,
                p.manifest.defaults_json().to_string(),
            )))
        });
        Ok(shared.clone())
    }

    /// The per-call deadline of `kind` in epoch ticks.
    pub fn deadline_ticks(&self, kind: Kind) -> u64 {
        self.limits.deadline_ticks(kind)
    }

    /// The loaded plugin `name` if it implements `kind`.
    pub fn get(&self, name: &str, kind: Kind) -> Result<&LoadedPlugin, PluginError> {
        match self.plugins.get(name) {
            Some(p) if p.manifest.kinds.contains(&kind) => Ok(p),
            _ => {
                let available: Vec<&str> = self
                    .plugins
                    .values()
                    .filter(|p| p.manifest.kinds.contains(&kind))
                    .map(|p| p.manifest.name.as_str())
                    .collect();
                let hint = if available.is_empty() {
                    format!(" (none of kind {kind} loaded)")
                } else {
                    format!(" (available: {})", available.join(", "))
                };
                Err(PluginError::Unknown {
                    name: name.into(),
                    kind,
                    hint,
                })
            }
        }
    }
}

pub(crate) fn new_store(
    engine: &Engine,
    memory_bytes: usize,
    deadline_ticks: u64,
) -> Store<PluginState> {
    // A failed memory.grow traps (instead of returning -1 to the guest's
    // allocator, which would abort with a less clear message).
    let store_limits = StoreLimitsBuilder::new()
        .memory_size(memory_bytes)
        // Components built by componentize-py link a dozen core instances.
        .instances(64)
        .trap_on_grow_failure(true)
        .build();
    let mut store = Store::new(engine, PluginState::new(store_limits));
    store.limiter(|s| &mut s.limits);
    store.set_epoch_deadline(deadline_ticks);
    // At the deadline: time the guest spent waiting on host calls does not
    // count against it (credited once), anything else is an interrupt trap.
    store.epoch_deadline_callback(|mut ctx| {
        let credit = ctx.data_mut().take_credit_ticks();
        if credit > 0 {
            Ok(wasmtime::UpdateDeadline::Continue(credit))
        } else {
            Err(wasmtime::Trap::Interrupt.into())
        }
    });
    store
}

fn make_engine() -> Result<Engine, PluginError> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    let mut pool = PoolingAllocationConfig::default();
    pool.total_component_instances(512);
    pool.total_memories(512);
    pool.total_tables(512);
    pool.max_memory_size(PluginLimits::MAX_MEMORY_BYTES);
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    Engine::new(&config).map_err(|e| PluginError::Engine(e.to_string()))
}

/// Starts the thread that advances the epoch; without it deadlines would
/// never fire, so failing to start it is an error.
fn start_ticker(engine: &Engine) -> Result<Arc<EpochTicker>, PluginError> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (e, s) = (engine.weak(), stop.clone());
    std::thread::Builder::new()
        .name("plugin-epoch".into())
        .spawn(move || {
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(EPOCH_TICK);
                match e.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => break,
                }
            }
        })
        .map_err(|e| PluginError::Engine(format!("starting the epoch ticker: {e}")))?;
    Ok(Arc::new(EpochTicker { stop }))
}

/// Compiles a component, using `cache/<sha256>-<wasmtime version>.cwasm`
/// when present (precompiled components load in ~0.1 ms instead of JIT).
fn compile_cached(engine: &Engine, path: &Path, cache: &Path) -> Result<(Component, bool), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // wasmtime's parse error quotes the first bytes it read; a file that is
    // not WebAssembly at all is named as such, its contents never logged.
    if !bytes.starts_with(b"\0asm") {
        return Err(format!(
            "{}: not a WebAssembly component (no `\\0asm` header)",
            path.display()
        ));
    }
    let hash = Sha256::digest(&bytes);
    let key: String = hash.iter().take(16).map(|b| format!("{b:02x}")).collect();
    // The engine's precompile hash covers the wasmtime version and config.
    let engine_key = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        h.finish()
    };
    let cached = cache.join(format!("{key}-{engine_key:016x}.cwasm"));
    if cached.is_file() {
        // SAFETY: the file was written by `Component::serialize` of this
        // wasmtime version for these exact bytes (content-addressed); a
        // stale or foreign file fails deserialization's own checks.
        if let Ok(c) = unsafe { Component::deserialize_file(engine, &cached) } {
            return Ok((c, true));
        }
    }
    let component = Component::new(engine, &bytes)
        .map_err(|e| format!("{}: not a valid component: {e:#}", path.display()))?;
    if let Ok(serialized) = component.serialize() {
        let _ = std::fs::create_dir_all(cache);
        let tmp = cache.join(format!(".{key}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, serialized).is_ok() {
            let _ = std::fs::rename(&tmp, &cached);
        }
    }
    Ok((component, false))
}

fn load_one(
    engine: &Engine,
    linker: &Linker<PluginState>,
    dir: &Path,
    cache: &Path,
    limits: PluginLimits,
) -> Result<LoadedPlugin, String> {
    let manifest = Manifest::load(dir)?;
    let path = manifest.component_path(dir)?;
    let (component, from_cache) = compile_cached(engine, &path, cache)?;
    let mut sampler = None;
    let mut processor = None;
    let mut adapter = None;
    let mut tool_parser = None;
    let mut reasoning_parser = None;
    let mut constraint = None;
    let mut drafter = None;
    let mut routes = Vec::new();
    let version = manifest.wit_version();
    for kind in &manifest.kinds {
        match kind {
            Kind::Sampler => {
                let pre = linker
                    .instantiate_pre(&component)
                    .map_err(|e| format!("does not fit the sampler-plugin world: {e:#}"))?;
                sampler = Some(
                    SamplerPluginPre::new(pre)
                        .map_err(|e| format!("does not export the sampler interface: {e:#}"))?,
                );
            }
            Kind::LogitsProcessor => {
                let pre = linker.instantiate_pre(&component).map_err(|e| {
                    format!("does not fit the logits-processor-plugin world: {e:#}")
                })?;
                processor = Some(LogitsProcessorPluginPre::new(pre).map_err(|e| {
                    format!("does not export the logits-processor interface: {e:#}")
                })?);
            }
            Kind::ApiAdapter => {
                let pre = linker
                    .instantiate_pre(&component)
                    .map_err(|e| format!("does not fit the api-adapter-plugin world: {e:#}"))?;
                let pre = match version {
                    WitVersion::V0_1 => {
                        AdapterPre::V1(ApiAdapterPluginPre::new(pre).map_err(|e| {
                            format!("does not export the 0.1.0 api-adapter interface: {e:#}")
                        })?)
                    }
                    // A 0.3.0 (0.4.0) adapter exports 0.2.0's interface (its
                    // world only adds the `structured-output` (and
                    // `speculation`) imports).
                    WitVersion::V0_2 | WitVersion::V0_3 | WitVersion::V0_4 => {
                        AdapterPre::V2(ApiAdapterV2Pre::new(pre).map_err(|e| {
                            format!("does not export the 0.2.0 api-adapter interface: {e:#}")
                        })?)
                    }
                };
                routes = adapter_routes(engine, &pre, limits)?;
                adapter = Some(pre);
            }
            Kind::ToolCallParser => {
                let pre = linker.instantiate_pre(&component).map_err(|e| {
                    format!("does not fit the tool-call-parser-plugin world: {e:#}")
                })?;
                tool_parser = Some(ToolCallParserPluginPre::new(pre).map_err(|e| {
                    format!("does not export the tool-call-parser interface: {e:#}")
                })?);
            }
            Kind::ReasoningParser => {
                let pre = linker.instantiate_pre(&component).map_err(|e| {
                    format!("does not fit the reasoning-parser-plugin world: {e:#}")
                })?;
                reasoning_parser = Some(ReasoningParserPluginPre::new(pre).map_err(|e| {
                    format!("does not export the reasoning-parser interface: {e:#}")
                })?);
            }
            Kind::Constraint => {
                let pre = linker
                    .instantiate_pre(&component)
                    .map_err(|e| format!("does not fit the constraint-plugin world: {e:#}"))?;
                constraint = Some(
                    ConstraintPluginPre::new(pre)
                        .map_err(|e| format!("does not export the constraint interface: {e:#}"))?,
                );
            }
            Kind::Drafter => {
                let pre = linker
                    .instantiate_pre(&component)
                    .map_err(|e| format!("does not fit the drafter-plugin world: {e:#}"))?;
                drafter = Some(
                    DrafterPluginPre::new(pre)
                        .map_err(|e| format!("does not export the drafter interface: {e:#}"))?,
                );
            }
        }
    }
    Ok(LoadedPlugin {
        manifest,
        dir: dir.into(),
        sampler,
        processor,
        adapter,
        tool_parser,
        reasoning_parser,
        constraint,
        drafter,
        routes,
        from_cache,
    })
}

/// An absolute path whose segments are literal or a whole `{name}`
/// placeholder (matching any one non-empty segment, e.g.
/// `/v1/responses/{response_id}`).
fn valid_route_path(path: &str) -> bool {
    path.starts_with('/')
        && path[1..].split('/').all(|seg| {
            let placeholder = seg.starts_with('{') && seg.ends_with('}') && seg.len() > 2;
            placeholder || !(seg.contains('{') || seg.contains('}'))
        })
}

/// Asks an adapter for its routes (a smoke call at load: an adapter that
/// traps here is skipped). Routes must be `GET`/`POST` on an absolute path.
fn adapter_routes(
    engine: &Engine,
    pre: &AdapterPre,
    limits: PluginLimits,
) -> Result<Vec<(String, String)>, String> {
    let mut store = new_store(
        engine,
        limits.adapter_memory_bytes,
        limits.deadline_ticks(Kind::ApiAdapter),
    );
    let instantiated = |e: wasmtime::Error| format!("instantiation failed: {e:#}");
    let failed = |e: wasmtime::Error| format!("`routes` failed: {e:#}");
    let routes: Vec<(String, String)> = match pre {
        AdapterPre::V1(pre) => pre
            .instantiate(&mut store)
            .map_err(instantiated)?
            .mlxhost_plugin_api_adapter()
            .call_routes(&mut store)
            .map_err(failed)?
            .into_iter()
            .map(|r| (r.method, r.path))
            .collect(),
        AdapterPre::V2(pre) => pre
            .instantiate(&mut store)
            .map_err(instantiated)?
            .mlxhost_plugin_api_adapter()
            .call_routes(&mut store)
            .map_err(failed)?
            .into_iter()
            .map(|r| (r.method, r.path))
            .collect(),
    };
    let mut out = Vec::with_capacity(routes.len());
    for (method_given, path) in routes {
        let method = method_given.to_ascii_uppercase();
        if !matches!(method.as_str(), "GET" | "POST" | "DELETE") || !valid_route_path(&path) {
            return Err(format!(
                "route `{method_given} {path}` is invalid (GET, POST or DELETE on an absolute path whose `{{name}}` segments are whole segments)"
            ));
        }
        out.push((method, path));
    }
    Ok(out)
}
