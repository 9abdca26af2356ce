//! WASM plugins: manifests, the wasmtime host, host resources (`tensors`),
//! and per-request sessions.
//!
//! Interfaces: `wit/plugin.wit` (`mlxhost:plugin@0.1.0`); authoring guide:
//! `docs/plugins.md`.

pub mod bindings;
pub mod constraint;
pub mod device_ops;
pub mod drafter;
pub mod limiter;
pub mod manifest;
pub mod reload;
pub mod runtime;
pub mod services;
pub mod session;
pub mod smoke;
pub mod tensors;
pub mod timing;
pub mod token_mask;
pub mod vocab;

pub use manifest::{Kind, Manifest};
pub use reload::LivePlugins;
pub use runtime::{PluginError, PluginHost, PluginLimits};
pub use services::AdapterServices;
pub use session::{RowChain, SamplingParams, TokenChain};
pub use vocab::VocabView;
