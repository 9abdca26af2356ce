//! KV cache kinds (per-row full and sliding-window KV, recurrent state
//! with checkpoints for hybrid models; quantized kinds plug in beside
//! them), the RAM prompt cache, the SSD cold tier, the two tiers behind
//! one lookup, and the response store adapters keep stored responses in.

pub mod kv;
pub mod prompt;
pub mod quant;
pub mod responses;
pub mod slab;
pub mod ssd;
pub mod state;
pub mod tiers;

pub use kv::{KvCache, KvShape, LayerKind};
pub use prompt::{PromptCache, PromptCacheStats};
pub use quant::{KvQuant, KvQuantError};
pub use responses::{ResponseStore, ResponseStoreConfig};
pub use ssd::{SsdCache, SsdCacheStats, SsdConfig};
pub use tiers::PrefixCache;

/// Length of the common prefix of two token sequences.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Removes and returns the entry with the smallest `last_used` (both tiers
/// evict least recently used first).
pub(crate) fn take_least_recent<T, K: Ord>(
    entries: &mut Vec<T>,
    last_used: impl Fn(&T) -> K,
) -> Option<T> {
    let (oldest, _) = entries
        .iter()
        .enumerate()
        .min_by_key(|(_, e)| last_used(e))?;
    Some(entries.remove(oldest))
}
