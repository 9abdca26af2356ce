//! Host side of WIT 0.2.0's adapter services: `response-store` (stored
//! values per adapter, [`crate::cache::ResponseStore`]) and `prompt`
//! (`count-tokens`: the prompt arithmetic of the served model). An adapter
//! instance gets them through its store's [`super::tensors::PluginState`];
//! without them (a store made for another plugin kind, or before the model
//! is loaded) the calls answer "absent" or an error, never trap.

use std::sync::Arc;

use super::bindings::v2::adapter::mlxhost::plugin::{prompt, response_store};
use super::tensors::PluginState;
use crate::cache::ResponseStore;

pub use super::bindings::v2::adapter::mlxhost::plugin::request::GenerationRequest;

/// Counts the prompt tokens of a canonical request (the server's
/// `prepare` path up to tokenization). Err: the 400 message a generation
/// would get.
pub type CountTokens = dyn Fn(GenerationRequest) -> Result<u32, String> + Send + Sync;

/// What one adapter instance may call.
#[derive(Clone)]
pub struct AdapterServices {
    /// The adapter's name: its keys in the store live under it.
    pub namespace: String,
    /// The store; `None` = the server keeps none.
    pub store: Option<Arc<ResponseStore>>,
    /// The prompt counter; `None` = no model to count with.
    pub count_tokens: Option<Arc<CountTokens>>,
}

impl response_store::Host for PluginState {
    fn put(&mut self, key: String, value: Vec<u8>) -> Result<(), String> {
        self.timed(|state| state.store_put(key, value))
    }

    fn get(&mut self, key: String) -> Option<Vec<u8>> {
        self.timed(|state| {
            let s = state.services.as_ref()?;
            s.store.as_ref()?.get(&s.namespace, &key)
        })
    }

    fn delete(&mut self, key: String) -> bool {
        self.timed(|state| match &state.services {
            Some(AdapterServices {
                namespace,
                store: Some(store),
                ..
            }) => store.delete(namespace, &key),
            _ => false,
        })
    }
}

impl PluginState {
    fn store_put(&mut self, key: String, value: Vec<u8>) -> Result<(), String> {
        let Some(s) = &self.services else {
            return Err("this server keeps no response store".into());
        };
        let Some(store) = &s.store else {
            return Err("this server keeps no response store".into());
        };
        store
            .put(&s.namespace, &key, value)
            .map_err(|e| e.to_string())
    }
}

impl prompt::Host for PluginState {
    fn count_tokens(&mut self, request: GenerationRequest) -> Result<u32, String> {
        self.timed(
            |state| match state.services.as_ref().and_then(|s| s.count_tokens.clone()) {
                Some(count) => count(request),
                None => Err("no model is loaded to count tokens with".into()),
            },
        )
    }
}
