//! The `grammar` constraint plugin (WIT `mlxhost:plugin@0.3.0`,
//! `constraint-plugin`): structured output on llguidance. The host keeps one
//! instance per model: `engine.create` builds the token trie once from the
//! host's token table, and each row's `session` compiles its grammar (JSON
//! Schema, `json_object`, regex, Lark, a choice list) and answers a token
//! bitset per step.
//!
//! `tokens`, `spec` and `engine` are plain Rust, unit-tested natively;
//! `component` is the WASM glue.

pub mod engine;
pub mod spec;
pub mod tokens;

#[cfg(target_arch = "wasm32")]
mod component;
