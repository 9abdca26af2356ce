//! Constraint plugins (WIT 0.3.0 `constraint-plugin`): one instance per
//! plugin per model holds the plugin's `engine` (its token trie, built once
//! from the `vocabulary` table) and every running row's `session`, so the
//! per-model state is shared, never rebuilt per request.
//!
//! Isolation is kept by replay: the host remembers each session's grammar
//! and the tokens it accepted. A trap (panic, deadline, memory cap) drops
//! the instance and fails only the row whose call trapped; the next call of
//! any other row builds a fresh instance and replays its session (`create`,
//! then `accept` per token) before going on. A plugin error (a grammar it
//! rejects, a token that does not fit) is a value, not a trap: it fails
//! that row and leaves the instance as it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use wasmtime::component::ResourceAny;
use wasmtime::Store;

use super::bindings::v3::constraint::mlxhost::plugin0_3_0::{types, vocabulary};
use super::bindings::v3::constraint::{ConstraintPlugin, ConstraintPluginPre};
use super::session::{failed, trap_cause};
use super::tensors::PluginState;
use super::PluginError;

pub use types::Grammar;

/// The deadline of `engine.create` (the trie over the whole vocabulary:
/// once per model, seconds in a guest for Qwen's 152k tokens).
pub const ENGINE_BUILD_DEADLINE: Duration = Duration::from_secs(120);

/// What a request asks a constraint plugin for.
#[derive(Debug, Clone)]
pub struct ConstraintRequest {
    /// The constraint plugin.
    pub plugin: String,
    /// The grammar.
    pub grammar: Grammar,
    /// The request field it came from (named in the 400 when the plugin
    /// rejects it), as the dialect spells it.
    pub field: String,
}

/// Makes the stores of a constraint instance (a fresh one after a trap).
pub(crate) struct StoreMaker {
    pub(crate) engine: wasmtime::Engine,
    pub(crate) memory_bytes: usize,
    pub(crate) call_ticks: u64,
    pub(crate) vocab: Option<Arc<super::VocabView>>,
}

impl StoreMaker {
    fn make(&self) -> Store<PluginState> {
        let mut store = super::runtime::new_store(&self.engine, self.memory_bytes, self.call_ticks);
        store.data_mut().vocab = self.vocab.clone();
        store
    }
}

/// The live instance: its store, bindings and engine resource.
struct Live {
    store: Store<PluginState>,
    bindings: ConstraintPlugin,
    engine: ResourceAny,
    generation: u64,
}

/// What the host keeps of one row's session, to replay it.
struct SessionLog {
    grammar: Grammar,
    extra: String,
    accepted: Vec<u32>,
    /// The session in the live instance of that generation.
    handle: Option<(u64, ResourceAny)>,
}

/// One constraint plugin's per-model instance and its sessions.
pub struct SharedConstraint {
    name: String,
    pre: ConstraintPluginPre<PluginState>,
    stores: StoreMaker,
    /// The manifest's `[defaults]` as JSON, for `engine.create`.
    defaults: String,
    live: Option<Live>,
    generation: u64,
    sessions: HashMap<u64, SessionLog>,
    next_id: u64,
}

impl SharedConstraint {
    pub(crate) fn new(
        name: &str,
        pre: ConstraintPluginPre<PluginState>,
        stores: StoreMaker,
        defaults: String,
    ) -> Self {
        SharedConstraint {
            name: name.into(),
            pre,
            stores,
            defaults,
            live: None,
            generation: 0,
            sessions: HashMap::new(),
            next_id: 0,
        }
    }

    /// Builds the instance and its engine now (else the first constrained
    /// request does). Errors: the plugin failed to build it.
    pub fn warm(&mut self) -> Result<(), PluginError> {
        self.live().map(|_| ())
    }

    /// The live instance, built when there is none.
    fn live(&mut self) -> Result<&mut Live, PluginError> {
        if self.live.is_none() {
            let mut store = self.stores.make();
            let tick = super::runtime::EPOCH_TICK.as_millis().max(1);
            store.set_epoch_deadline((ENGINE_BUILD_DEADLINE.as_millis() / tick) as u64);
            let bindings = self
                .pre
                .instantiate(&mut store)
                .map_err(|e| failed(&self.name, trap_cause(&e)))?;
            let engine = bindings
                .mlxhost_plugin0_3_0_constraint()
                .engine()
                .call_create(&mut store, &self.defaults)
                .map_err(|e| failed(&self.name, trap_cause(&e)))?
                .map_err(|e| failed(&self.name, format!("building its engine: {}", e.message)))?;
            self.generation += 1;
            if self.generation > 1 {
                tracing::warn!(
                    plugin = %self.name,
                    sessions = self.sessions.len(),
                    "constraint plugin instance rebuilt after a trap; its other sessions are replayed"
                );
            }
            self.live = Some(Live {
                store,
                bindings,
                engine,
                generation: self.generation,
            });
        }
        let ticks = self.stores.call_ticks;
        let live = self
            .live
            .as_mut()
            .ok_or_else(|| failed(&self.name, "no live instance"))?;
        // Epoch deadlines count from when they are set: every call gets its
        // own (the engine build's long one must not carry over).
        live.store.set_epoch_deadline(ticks);
        Ok(live)
    }

    /// A trap: the instance is dropped (every session is replayed into the
    /// next one); the error names the plugin.
    fn trapped(&mut self, e: &wasmtime::Error) -> PluginError {
        self.live = None;
        failed(&self.name, trap_cause(e))
    }

    /// Session `id`'s handle in the live instance, creating (and replaying)
    /// it there when it has none. `Ok(Err(message))`: the plugin rejected
    /// the grammar or a replayed token.
    fn handle(&mut self, id: u64) -> Result<Result<ResourceAny, String>, PluginError> {
        let name = self.name.clone();
        let live = self.live()?;
        let generation = live.generation;
        let Some(log) = self.sessions.get(&id) else {
            return Err(failed(&name, "session is closed"));
        };
        if let Some((g, h)) = log.handle {
            if g == generation {
                return Ok(Ok(h));
            }
        }
        let (grammar, extra, accepted) =
            (log.grammar.clone(), log.extra.clone(), log.accepted.clone());
        let ticks = self.stores.call_ticks;
        let live = self.live()?;
        let replayed = replay(live, &grammar, &extra, &accepted, ticks);
        let h = match replayed {
            Ok(Ok(h)) => h,
            Ok(Err(message)) => return Ok(Err(message)),
            Err(e) => return Err(self.trapped(&e)),
        };
        if let Some(log) = self.sessions.get_mut(&id) {
            log.handle = Some((generation, h));
        }
        Ok(Ok(h))
    }

    fn close(&mut self, id: u64) {
        let Some(log) = self.sessions.remove(&id) else {
            return;
        };
        if let (Some((g, h)), Some(live)) = (log.handle, self.live.as_mut()) {
            if g == live.generation {
                let _ = h.resource_drop(&mut live.store);
            }
        }
    }
}

/// Creates a session in `live` and feeds it `accepted`. `Ok(Err)`: the
/// plugin rejected the grammar or a token; `Err`: a trap.
fn replay(
    live: &mut Live,
    grammar: &Grammar,
    extra: &str,
    accepted: &[u32],
    call_ticks: u64,
) -> wasmtime::Result<Result<ResourceAny, String>> {
    let api = live.bindings.mlxhost_plugin0_3_0_constraint();
    let h = match api
        .session()
        .call_create(&mut live.store, live.engine, grammar, extra)?
    {
        Ok(h) => h,
        Err(e) => return Ok(Err(e.message)),
    };
    for &t in accepted {
        live.store.set_epoch_deadline(call_ticks);
        if let Err(e) = api.session().call_accept(&mut live.store, h, t)? {
            return Ok(Err(format!("replaying its tokens: {}", e.message)));
        }
    }
    Ok(Ok(h))
}

/// Locks a shared instance; a poisoned lock (a panic while held) is still
/// usable: the instance's state is the plugin's, and a trap drops it.
fn lock(shared: &Mutex<SharedConstraint>) -> MutexGuard<'_, SharedConstraint> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// One row's session in a shared constraint instance.
pub struct ConstraintSession {
    shared: Arc<Mutex<SharedConstraint>>,
    id: u64,
    name: String,
    /// The batch step's cap on each call's deadline, in epoch ticks, while
    /// the row shares a step (`--plugin-step-ms`); `None`: the plugin's own.
    cap_ticks: std::cell::Cell<Option<u64>>,
}

/// Why a session could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// The plugin rejected the grammar (the client's fault): its message.
    Rejected(String),
    /// The plugin failed (trap, engine build).
    Failed(PluginError),
}

impl ConstraintSession {
    /// Compiles `grammar` in the shared instance. `extra` is the plugin's
    /// parameters (JSON object text).
    pub fn open(
        shared: Arc<Mutex<SharedConstraint>>,
        grammar: Grammar,
        extra: String,
    ) -> Result<Self, OpenError> {
        let (id, name) = {
            let mut s = lock(&shared);
            s.next_id += 1;
            let id = s.next_id;
            s.sessions.insert(
                id,
                SessionLog {
                    grammar,
                    extra,
                    accepted: Vec::new(),
                    handle: None,
                },
            );
            (id, s.name.clone())
        };
        // Dropping the session on failure closes its log.
        let session = ConstraintSession {
            shared,
            id,
            name,
            cap_ticks: std::cell::Cell::new(None),
        };
        let opened = lock(&session.shared).handle(id);
        match opened {
            Ok(Ok(_)) => Ok(session),
            Ok(Err(message)) => Err(OpenError::Rejected(message)),
            Err(e) => Err(OpenError::Failed(e)),
        }
    }

    /// The plugin's name.
    pub fn plugin(&self) -> &str {
        &self.name
    }

    /// Caps each call's deadline at `cap` while the row shares a batch step
    /// (`None`: the plugin's own deadline), as [`super::TokenChain::set_step_cap`].
    pub fn set_step_cap(&self, cap: Option<std::time::Duration>) {
        let tick = super::runtime::EPOCH_TICK.as_millis().max(1);
        self.cap_ticks
            .set(cap.map(|c| (c.as_millis() / tick).max(1) as u64 + 1));
    }

    /// The live instance, with this call's deadline (the step cap when it
    /// is shorter than the plugin's own).
    fn armed<'a>(&self, s: &'a mut SharedConstraint) -> Result<&'a mut Live, PluginError> {
        let own = s.stores.call_ticks;
        let live = s.live()?;
        if let Some(cap) = self.cap_ticks.get() {
            live.store.set_epoch_deadline(cap.min(own));
        }
        Ok(live)
    }

    /// The allowed tokens' bitset for this step. Errors (fail the row): a
    /// trap, the plugin's error, or an empty set (a dead end).
    pub fn mask(&self) -> Result<Vec<u32>, PluginError> {
        let mut s = lock(&self.shared);
        let h = s.handle(self.id)?.map_err(|m| failed(&self.name, m))?;
        let live = self.armed(&mut s)?;
        let r = live
            .bindings
            .mlxhost_plugin0_3_0_constraint()
            .session()
            .call_mask(&mut live.store, h);
        let words = match r {
            Ok(r) => r.map_err(|e| failed(&self.name, e.message))?,
            Err(e) => return Err(s.trapped(&e)),
        };
        if words.iter().all(|&w| w == 0) {
            return Err(failed(
                &self.name,
                "no token can continue the output (the grammar is at a dead end)",
            ));
        }
        Ok(words)
    }

    /// The row chose `token`. Errors (fail the row): a trap, or the token
    /// does not fit the grammar.
    pub fn accept(&self, token: u32) -> Result<(), PluginError> {
        let mut s = lock(&self.shared);
        let h = s.handle(self.id)?.map_err(|m| failed(&self.name, m))?;
        let live = self.armed(&mut s)?;
        let r = live
            .bindings
            .mlxhost_plugin0_3_0_constraint()
            .session()
            .call_accept(&mut live.store, h, token);
        match r {
            Ok(Ok(())) => {
                if let Some(log) = s.sessions.get_mut(&self.id) {
                    log.accepted.push(token);
                }
                Ok(())
            }
            Ok(Err(e)) => Err(failed(&self.name, e.message)),
            Err(e) => Err(s.trapped(&e)),
        }
    }
}

impl Drop for ConstraintSession {
    fn drop(&mut self) {
        lock(&self.shared).close(self.id);
    }
}

impl types::Host for PluginState {}

impl vocabulary::Host for PluginState {
    fn table(&mut self) -> wasmtime::Result<vocabulary::TokenTable> {
        let t = self.timed(|s| s.vocab_view().map(|v| v.token_table()))?;
        Ok(vocabulary::TokenTable {
            bytes: t.bytes.clone(),
            ends: t.ends.clone(),
            eos: t.eos.clone(),
            special: t.special.clone(),
        })
    }
}
