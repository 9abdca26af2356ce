//! KV cache kinds (per-row full cache today; sliding-window, SSM state and
//! quantized kinds plug in beside it), the RAM prompt cache, the SSD cold
//! tier, and the two tiers behind one lookup.

pub mod kv;
pub mod prompt;
pub mod ssd;
pub mod tiers;

pub use kv::KvCache;
pub use prompt::{PromptCache, PromptCacheStats};
pub use ssd::{SsdCache, SsdCacheStats, SsdConfig};
pub use tiers::PrefixCache;
