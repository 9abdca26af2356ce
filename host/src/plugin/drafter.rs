//! Drafter plugins (WIT 0.4.0 `drafter-plugin`): one instance and session
//! per row, fed the row's history incrementally (the tokens it gained since
//! the previous call), asked for up to `k` draft tokens per step in which
//! the row speculates. The engine verifies the drafts
//! (`engine::speculative`); a drafter only ever changes speed.
//!
//! A drafter that traps, misses its deadline or returns an error fails
//! nothing: [`PluginDrafter::draft`] reports it and the engine drops the
//! drafter, so the row goes on decoding without drafts.

use std::time::{Duration, Instant};

use wasmtime::component::ResourceAny;
use wasmtime::Store;

use super::bindings::v4::drafter::exports::mlxhost::plugin0_4_0::drafter::DraftOptions;
use super::bindings::v4::drafter::DrafterPlugin;
use super::manifest::Kind;
use super::runtime::{PluginError, PluginHost};
use super::session::{created_with, failed, merged_params, trap_cause};
use super::tensors::PluginState;

/// One row's drafter session.
pub struct PluginDrafter {
    name: String,
    store: Store<PluginState>,
    bindings: DrafterPlugin,
    session: ResourceAny,
    /// History tokens the session has been given.
    seen: usize,
    ticks: u64,
    vocab: u32,
    /// Wall time inside the plugin's calls.
    pub plugin_time: Duration,
}

impl PluginDrafter {
    /// Instantiates drafter `name` for a row whose prompt is `prompt_len`
    /// tokens, with its `[defaults]` and the request's
    /// `plugin_params.<name>` merged over them.
    ///
    /// Errors: no drafter plugin of that name; instantiation failed; its
    /// `create` trapped or rejected the parameters.
    pub fn new(
        host: &PluginHost,
        name: &str,
        prompt_len: usize,
        vocab: usize,
        plugin_params: &serde_json::Value,
    ) -> Result<Self, PluginError> {
        let p = host.get(name, Kind::Drafter)?;
        let pre = p
            .drafter
            .as_ref()
            .ok_or_else(|| failed(name, "no drafter world"))?;
        let mut store = host.new_store(Kind::Drafter);
        let bindings = pre
            .instantiate(&mut store)
            .map_err(|e| failed(name, trap_cause(&e)))?;
        let extra = merged_params(name, p.manifest.defaults_json(), plugin_params);
        let options = DraftOptions {
            prompt_len: prompt_len as u32,
            vocab_size: vocab as u32,
            extra: extra.to_string(),
        };
        let session = created_with(
            name,
            bindings
                .mlxhost_plugin0_4_0_drafter()
                .session()
                .call_create(&mut store, &options),
            |e| e.message,
        )?;
        Ok(PluginDrafter {
            name: name.to_string(),
            store,
            bindings,
            session,
            seen: 0,
            ticks: host.deadline_ticks(Kind::Drafter),
            vocab: vocab as u32,
            plugin_time: Duration::ZERO,
        })
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Up to `k` draft tokens to follow `history` (which extends the
    /// history of the previous call). Ids outside the vocabulary end the
    /// drafts there; more than `k` are cut.
    ///
    /// Errors: the plugin trapped, missed its deadline or returned an
    /// error (the engine then drops this drafter).
    pub fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>, PluginError> {
        let started = Instant::now();
        let appended = &history[self.seen.min(history.len())..];
        self.store.set_epoch_deadline(self.ticks);
        let result = self
            .bindings
            .mlxhost_plugin0_4_0_drafter()
            .session()
            .call_draft(&mut self.store, self.session, appended, k as u32);
        self.plugin_time += started.elapsed();
        super::timing::record(&self.name, started.elapsed());
        let mut drafts = result
            .map_err(|e| failed(&self.name, trap_cause(&e)))?
            .map_err(|e| failed(&self.name, e.message))?;
        self.seen = history.len();
        drafts.truncate(k);
        if let Some(bad) = drafts.iter().position(|&id| id >= self.vocab) {
            drafts.truncate(bad);
        }
        Ok(drafts)
    }
}
