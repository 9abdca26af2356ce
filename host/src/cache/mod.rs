//! KV cache kinds (per-row full cache today; sliding-window, SSM state and
//! quantized kinds plug in beside it) and the RAM prompt cache.

pub mod kv;
pub mod prompt;

pub use kv::KvCache;
pub use prompt::{PromptCache, PromptCacheStats};
