//! Host side of the adapter services: WIT 0.2.0's `response-store` (stored
//! values per adapter, [`crate::cache::ResponseStore`]) and `prompt`
//! (`count-tokens`: the prompt arithmetic of the served model), 0.3.0's
//! `structured-output` (the request's output constraint) and 0.4.0's
//! `speculation` (the request's drafter and draft length). An adapter
//! instance gets them through its store's [`super::tensors::PluginState`];
//! without them (a store made for another plugin kind, or before the model
//! is loaded) the calls answer "absent" or an error, never trap.

use std::sync::Arc;

use super::bindings::v2::adapter::mlxhost::plugin::{prompt, response_store};
use super::bindings::v3::structured_output::mlxhost::plugin0_3_0::structured_output;
use super::bindings::v4::speculation::mlxhost::plugin0_4_0::speculation;
use super::constraint::{ConstraintRequest, Grammar};
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
    /// The constraint plugins loaded, by name.
    pub constraint_plugins: Vec<String>,
    /// The constraint plugin a request gets when it names none
    /// (`--grammar-plugin`).
    pub default_constraint: String,
    /// The drafter plugins loaded, by name.
    pub drafter_plugins: Vec<String>,
}

/// What an adapter chose for its request's speculation
/// (`speculation.speculate`): `None` fields take the server's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpeculationChoice {
    /// The drafter; `Some("none")` turns speculation off.
    pub drafter: Option<String>,
    /// The most draft tokens per step; 0 turns speculation off.
    pub max_draft: Option<u32>,
}

/// The most draft tokens per step a request may ask for (a verification
/// forward feeds this many positions beside the row's token).
pub const MAX_DRAFT_TOKENS: u32 = 64;

impl speculation::Host for PluginState {
    fn speculate(&mut self, o: speculation::SpeculativeOptions) -> Result<(), String> {
        let Some(s) = &self.services else {
            return Err("speculative decoding is not available here".into());
        };
        if let Some(name) = o.drafter.as_deref().filter(|n| *n != "none") {
            if !s.drafter_plugins.iter().any(|d| d == name) {
                return Err(if s.drafter_plugins.is_empty() {
                    format!("no drafter plugin named `{name}` is loaded (none is)")
                } else {
                    format!(
                        "no drafter plugin named `{name}` is loaded (available: {})",
                        s.drafter_plugins.join(", ")
                    )
                });
            }
        }
        if let Some(n) = o.max_draft.filter(|n| *n > MAX_DRAFT_TOKENS) {
            return Err(format!(
                "at most {MAX_DRAFT_TOKENS} draft tokens per step can be asked for, got {n}"
            ));
        }
        self.speculation = Some(SpeculationChoice {
            drafter: o.drafter,
            max_draft: o.max_draft,
        });
        Ok(())
    }
}

/// The largest grammar a request may give (JSON Schema, regex, Lark or
/// choices, bytes): compiled on the engine thread, so bounded.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// The size of a grammar's text.
fn grammar_bytes(g: &Grammar) -> usize {
    match g {
        Grammar::JsonSchema(s) | Grammar::Regex(s) | Grammar::Lark(s) => s.len(),
        Grammar::JsonObject => 0,
        Grammar::Choice(c) => c.iter().map(|s| s.len() + 1).sum(),
    }
}

impl structured_output::Host for PluginState {
    fn constrain(&mut self, c: structured_output::OutputConstraint) -> Result<(), String> {
        let Some(s) = &self.services else {
            return Err("structured output is not available here".into());
        };
        let plugin = c.plugin.unwrap_or_else(|| s.default_constraint.clone());
        if !s.constraint_plugins.contains(&plugin) {
            return Err(if s.constraint_plugins.is_empty() {
                format!(
                    "structured output needs a constraint plugin (`{plugin}`), and none is loaded"
                )
            } else {
                format!(
                    "no constraint plugin named `{plugin}` is loaded (available: {})",
                    s.constraint_plugins.join(", ")
                )
            });
        }
        let size = grammar_bytes(&c.grammar);
        if size > MAX_GRAMMAR_BYTES {
            return Err(format!(
                "the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted"
            ));
        }
        self.constraint = Some(ConstraintRequest {
            plugin,
            grammar: c.grammar,
            field: c.field,
        });
        Ok(())
    }

    fn strict_tools(&mut self, names: Vec<String>) {
        self.strict_tools = names;
    }
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
