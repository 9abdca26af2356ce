//! `tool-parsers`: the first-party output parsers of WIT
//! `mlxhost:plugin@0.2.0`, in one component that exports both the
//! `tool-call-parser` and the `reasoning-parser` interfaces (world
//! `parsers` in `wit/world.wit`).
//!
//! Several plugin folders share this component (`plugins/hermes`,
//! `plugins/llama3-json`, `plugins/mistral`, `plugins/qwen3-coder`,
//! `plugins/pythonic`, `plugins/think`, and `plugins/harmony`, which serves
//! both kinds); each manifest picks the format with `[defaults] format =
//! "..."`, which reaches the session as `extra` ([`options`]). Formats:
//! [`formats`]; reasoning: [`think`], and gpt-oss's [`harmony`] for both
//! kinds ([`reasoning`] picks); the streaming contract: [`segment`] and
//! [`stream`]; `docs/parsers.md` has the rules and examples.
//!
//! `call-prefix` is a free function, not a session method, so it cannot
//! read a session's `extra`: it uses the format of the tool-call session
//! created most recently in the same instance (the host creates the session
//! first and uses one instance per request), and `hermes` when no session
//! exists yet.
//!
//! Everything but the `component` module is plain Rust, tested natively
//! (README.md has the command).

pub mod formats;
pub mod harmony;
pub mod json;
pub mod options;
pub mod pylit;
pub mod reasoning;
pub mod segment;
pub mod stream;
pub mod text;
pub mod think;
pub mod tools;

#[cfg(target_arch = "wasm32")]
mod component;

#[cfg(test)]
mod fixture_tests;

#[cfg(test)]
mod consistency_tests;
