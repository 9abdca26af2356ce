//! mlxhost: a WebAssembly-plugin-extensible LLM inference host on MLX.
//!
//! Modules, one concern each: [`model`] (config, weights, tokenizer, chat
//! template, architectures), [`cache`] (KV cache kinds), [`score`]
//! (teacher-forced log-likelihoods), [`engine`] (the decode loop),
//! [`plugin`] (the WASM host), [`server`] (HTTP), [`runtime`] (backend facts),
//! [`paths`] (cache locations).

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod busy_threads;
pub mod cache;
pub mod census;
pub mod device_memory;
pub mod distributed;
pub mod engine;
pub mod gpu_kernel_cache;
pub mod logprobs;
pub mod model;
pub(crate) mod native_op;
pub mod output;
pub mod paths;
pub mod plugin;
pub mod runtime;
pub mod score;
pub mod server;
