//! Both cache tiers behind one lookup: the RAM prompt cache, and the SSD
//! tier under it. A lookup restores from SSD only when the disk holds a
//! strictly longer usable prefix than RAM. Finished requests go to RAM;
//! the SSD gets them when RAM evicts them (spill) and, write-behind, once
//! requests settle ([`PrefixCache::settle`]). Either tier may be off.

use std::time::Duration;

use super::prompt::{PromptCache, PromptCacheStats, Reuse, Snapshot};
use super::ssd::SsdCache;
use super::KvCache;

/// The RAM and SSD tiers.
pub struct PrefixCache {
    ram: PromptCache,
    ssd: Option<SsdCache>,
    /// Entries RAM did not keep (it is off, or they exceed its cap), waiting
    /// for the next settle to reach the SSD.
    direct: Vec<Snapshot>,
}

impl PrefixCache {
    /// RAM only (`ssd: None`), SSD only (a RAM cache of 0 bytes), or both.
    pub fn new(ram: PromptCache, ssd: Option<SsdCache>) -> Self {
        let ram = if ssd.is_some() {
            ram.keep_evicted()
        } else {
            ram
        };
        PrefixCache {
            ram,
            ssd,
            direct: Vec::new(),
        }
    }

    /// The longest usable cached prefix of `prompt`: from RAM, or from SSD
    /// when it covers strictly more tokens.
    pub fn lookup(&mut self, namespace: &str, prompt: &[u32]) -> Option<Reuse> {
        if let Some(ssd) = &self.ssd {
            let in_ram = self.ram.peek(namespace, prompt);
            if ssd.peek(namespace, prompt) > in_ram {
                if let Some(r) = ssd.restore(namespace, prompt) {
                    self.ram.note_miss();
                    return Some(r);
                }
            }
        }
        self.ram.lookup(namespace, prompt)
    }

    /// How many tokens of `prompt` [`PrefixCache::lookup`] would reuse
    /// (either tier), with no side effects.
    pub fn peek(&self, namespace: &str, prompt: &[u32]) -> usize {
        let ram = self.ram.peek(namespace, prompt);
        let ssd = self.ssd.as_ref().map_or(0, |s| s.peek(namespace, prompt));
        ram.max(ssd)
    }

    /// Stores a finished request's KV (exactly `tokens`' positions).
    pub fn insert(&mut self, namespace: &str, tokens: Vec<u32>, kv: KvCache) {
        if let Some(left) = self.ram.insert(namespace, tokens, kv) {
            if self.ssd.is_some() {
                // Keep only the newest of a growing sequence.
                self.direct.retain(|d| {
                    !(d.namespace == left.namespace && left.tokens.starts_with(&d.tokens))
                });
                self.direct.push(left);
                // They pin their KV until written: past the budget, write now.
                let held: usize = self.direct.iter().map(|d| d.kv.nbytes()).sum();
                if held > super::ssd::writer::QUEUE_BUDGET_BYTES / 2 {
                    let batch = std::mem::take(&mut self.direct);
                    self.write(batch);
                }
            }
        }
    }

    /// Hands entries RAM just evicted (never written) to the SSD writer.
    /// Cheap; call after every request.
    pub fn spill_evicted(&mut self) {
        let evicted = self.ram.take_evicted();
        self.write(evicted);
    }

    /// Whether a settle would write anything.
    pub fn has_unwritten(&self) -> bool {
        self.ssd.is_some() && (!self.direct.is_empty() || self.ram.has_unpersisted())
    }

    /// Requests have settled: hands every entry not yet on disk to the SSD
    /// writer (write-behind; the disk work is on the writer thread).
    pub fn settle(&mut self) {
        if self.ssd.is_none() {
            return;
        }
        let mut batch = std::mem::take(&mut self.direct);
        batch.extend(self.ram.take_unpersisted());
        self.write(batch);
    }

    fn write(&self, batch: Vec<Snapshot>) {
        let Some(ssd) = &self.ssd else { return };
        for s in batch {
            if let Err(e) = ssd.submit(&s.namespace, &s.tokens, &s.kv) {
                tracing::warn!(error = %e, "entry not written to the SSD cache");
            }
        }
    }

    /// Settles, then waits for the writer (at most `timeout`); for a clean
    /// shutdown. Returns whether everything reached the disk.
    pub fn flush(&mut self, timeout: Duration) -> bool {
        self.spill_evicted();
        self.settle();
        self.ssd.as_ref().is_none_or(|s| s.flush(timeout))
    }

    /// The RAM tier's counters.
    pub fn ram_stats(&self) -> PromptCacheStats {
        self.ram.stats()
    }

    /// The SSD tier, when on.
    pub fn ssd(&self) -> Option<&SsdCache> {
        self.ssd.as_ref()
    }
}
