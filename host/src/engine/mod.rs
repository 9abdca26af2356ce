//! The engine: requests become [`Sequence`]s that a continuous-batching
//! [`Scheduler`] advances one step at a time, each step one forward for all
//! rows (`docs/architecture.md`, "The engine").
//!
//! - [`request`]: the canonical request, events, summary, errors;
//! - [`sequence`]: one request's row state (history, KV, plugin chain,
//!   detokenizer, stop strings, limits, sink);
//! - [`scheduler`]: admission, the per-step prefill budget, retirement, the
//!   prompt cache on admission and retirement;
//! - `step`: one forward, each row's chain, one evaluation;
//! - [`worker`]: the engine thread that owns the model and the caches, and
//!   the handle the server holds;
//! - [`generate()`]: one request run to completion (CLI, benchmarks);
//! - [`detokenize`]: incremental detokenization and stop strings.

pub mod admission;
pub mod constrain;
pub mod detokenize;
pub mod draft_model;
pub mod generate;
pub mod grammar;
pub mod request;
pub mod scheduler;
pub mod sequence;
pub mod speculative;
mod step;
mod warmup;
pub mod worker;

pub use crate::plugin::session::TokenChain;
pub use generate::{generate, generate_with};
pub use request::{
    effective_params, kv_namespace, lora_namespace, validate, FinishReason, GenerateError,
    GenerateEvent, GenerateRequest, GenerateSummary, TokenInfo,
};
pub use scheduler::{Scheduler, SchedulerConfig, SchedulerStats};
pub use sequence::{Sequence, SequenceSink};
pub use step::StepTiming;
