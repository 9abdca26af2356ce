//! The RAM prompt cache: KV caches of finished requests, reused for the
//! longest usable prefix of a new prompt (agents resend growing
//! conversations; re-prefilling them dominates a local server's latency).
//!
//! Entries are keyed by a namespace (the KV scheme today: compute dtype; the
//! LoRA adapter set and KV quantization join it when they exist, so KV
//! computed under one never seeds another) and the token ids the KV holds.
//! A lookup takes the entry sharing the longest prefix with the prompt,
//! clones its KV (MLX arrays are immutable values: the clone shares memory
//! until written) and trims it to the shared prefix, which a full-attention
//! cache allows and a sliding-window one allows within its rollback margin
//! (`KvCache::reusable`; an entry that cannot be trimmed that far is not a
//! hit). At least one prompt token is always left to prefill, so
//! the step has logits. Memory is capped in bytes (the KV allocation,
//! capacity included); the least recently used entries go first.

use crate::cache::common_prefix;
use crate::cache::kv::KvCache;

/// Counters for `GET /stats`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PromptCacheStats {
    /// Lookups that reused at least one token.
    pub hits: u64,
    /// Lookups that reused nothing.
    pub misses: u64,
    /// Prompt tokens not prefilled thanks to the cache (sum over hits).
    pub tokens_reused: u64,
    /// Entries held.
    pub entries: usize,
    /// Bytes held (KV allocations).
    pub bytes: usize,
    /// The byte cap (`--prompt-cache`).
    pub max_bytes: usize,
    /// Entries evicted to stay under the cap.
    pub evictions: u64,
    /// Shared-prefix entries made where a new entry branched off an
    /// existing one (see [`BRANCH_MIN_TOKENS`]).
    pub branches: u64,
    /// Hits by the kind of cache that served them: `full` (every layer
    /// full KV), `sliding` (some sliding-window layers), `recurrent` (a
    /// hybrid model's recurrent states with the KV).
    pub hits_by_kind: std::collections::BTreeMap<String, u64>,
    /// Recurrent hits that resumed from a state checkpoint short of the
    /// prefix the prompt shares with the entry (the prompt diverged after
    /// it, or the entry holds no state there).
    pub checkpoint_hits: u64,
}

/// The kind of a cache for [`PromptCacheStats::hits_by_kind`].
pub fn kind_name(kv: &KvCache) -> &'static str {
    let kinds = kv.kinds();
    if kinds.contains(&crate::cache::LayerKind::Recurrent) {
        "recurrent"
    } else if kinds.iter().all(|k| *k == crate::cache::LayerKind::Full) {
        "full"
    } else {
        "sliding"
    }
}

struct Entry {
    namespace: String,
    tokens: Vec<u32>,
    kv: KvCache,
    bytes: usize,
    last_used: u64,
    /// Already handed to the SSD tier (no need to snapshot it again).
    persisted: bool,
    /// A shared prefix kept where entries branch (never replaced by an
    /// entry that extends it; see [`BRANCH_MIN_TOKENS`]).
    branch: bool,
}

/// An entry leaving RAM (eviction) or to be written (snapshot): its
/// namespace, the token ids its KV holds, and the KV.
pub struct Snapshot {
    /// Cache namespace.
    pub namespace: String,
    /// Token ids; `kv.offset() == tokens.len()`.
    pub tokens: Vec<u32>,
    /// The KV (shares the cached arrays).
    pub kv: KvCache,
}

/// A byte-capped LRU of KV caches keyed by (namespace, token prefix).
pub struct PromptCache {
    max_bytes: usize,
    entries: Vec<Entry>,
    clock: u64,
    stats: PromptCacheStats,
    /// Keep evicted entries that were never persisted, for the SSD tier.
    keep_evicted: bool,
    evicted: Vec<Snapshot>,
}

/// A reusable prefix: the KV (trimmed to `reused` positions).
pub struct Reuse {
    /// KV holding the first `reused` prompt tokens.
    pub kv: KvCache,
    /// Prompt tokens covered.
    pub reused: usize,
    /// Where the KV came from.
    pub source: ReuseSource,
}

/// Where a request's reused prefix came from (`GET /stats`, per request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReuseSource {
    /// Nothing was reused.
    None,
    /// The RAM prompt cache.
    Ram,
    /// The SSD tier.
    Ssd,
    /// A row still running (its prompt was being prefilled or decoded
    /// beside this one).
    RunningRow,
}

/// The shortest shared prefix kept as an entry of its own when a new entry
/// branches off an existing one (a common system prompt under several
/// conversations): shorter ones cost a copy for little prefill.
pub const BRANCH_MIN_TOKENS: usize = 256;

impl PromptCache {
    /// An empty cache holding at most `max_bytes` (0 disables it).
    pub fn new(max_bytes: usize) -> Self {
        PromptCache {
            max_bytes,
            entries: Vec::new(),
            clock: 0,
            stats: PromptCacheStats {
                max_bytes,
                ..Default::default()
            },
            keep_evicted: false,
            evicted: Vec::new(),
        }
    }

    /// Keeps evicted entries, to be taken with [`PromptCache::take_evicted`]
    /// (the SSD tier spills them).
    pub fn keep_evicted(mut self) -> Self {
        self.keep_evicted = true;
        self
    }

    /// How many tokens of `prompt` [`PromptCache::lookup`] would reuse, with
    /// no side effects.
    pub fn peek(&self, namespace: &str, prompt: &[u32]) -> usize {
        if !self.enabled() || prompt.len() < 2 {
            return 0;
        }
        let limit = prompt.len() - 1;
        self.entries
            .iter()
            .filter(|e| e.namespace == namespace)
            .map(|e| e.kv.reusable(common_prefix(&e.tokens, prompt).min(limit)))
            .max()
            .unwrap_or(0)
    }

    /// Counts a lookup this tier did not serve (another tier did).
    pub fn note_miss(&mut self) {
        if self.enabled() {
            self.stats.misses += 1;
        }
    }

    /// Evicted entries (see [`PromptCache::keep_evicted`]).
    pub fn take_evicted(&mut self) -> Vec<Snapshot> {
        std::mem::take(&mut self.evicted)
    }

    /// Whether some entry was never persisted.
    pub fn has_unpersisted(&self) -> bool {
        self.entries.iter().any(|e| !e.persisted)
    }

    /// Entries never persisted, now marked persisted (the caller hands them
    /// to the SSD tier).
    pub fn take_unpersisted(&mut self) -> Vec<Snapshot> {
        self.entries
            .iter_mut()
            .filter(|e| !e.persisted)
            .map(|e| {
                e.persisted = true;
                Snapshot {
                    namespace: e.namespace.clone(),
                    tokens: e.tokens.clone(),
                    kv: e.kv.clone(),
                }
            })
            .collect()
    }

    /// Whether the cache stores anything at all.
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// The longest usable cached prefix of `prompt` in `namespace`, at most
    /// `prompt.len() - 1` tokens. Counts a hit or a miss.
    pub fn lookup(&mut self, namespace: &str, prompt: &[u32]) -> Option<Reuse> {
        if !self.enabled() || prompt.len() < 2 {
            return None;
        }
        self.clock += 1;
        let limit = prompt.len() - 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.namespace == namespace)
            .map(|e| {
                let shared = common_prefix(&e.tokens, prompt).min(limit);
                (e.kv.reusable(shared), shared, e)
            })
            .filter(|(n, _, _)| *n > 0)
            .max_by_key(|(n, _, e)| (*n, e.last_used));
        match best {
            Some((reused, shared, entry)) => {
                entry.last_used = self.clock;
                let mut kv = entry.kv.clone();
                kv.truncate(reused);
                self.stats.hits += 1;
                let kind = kind_name(&kv);
                *self.stats.hits_by_kind.entry(kind.into()).or_default() += 1;
                if kind == "recurrent" && reused < shared {
                    self.stats.checkpoint_hits += 1;
                }
                self.stats.tokens_reused += reused as u64;
                // Every entry the prompt extends was used whole: a shared
                // system prompt's entry stays recent while conversations
                // under it come and go.
                let clock = self.clock;
                for e in self.entries.iter_mut().filter(|e| {
                    e.namespace == namespace
                        && e.tokens.len() <= reused
                        && prompt.starts_with(&e.tokens)
                }) {
                    e.last_used = clock;
                }
                Some(Reuse {
                    kv,
                    reused,
                    source: ReuseSource::Ram,
                })
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Stores the KV of `tokens` (exactly the positions `kv` holds). Entries
    /// that are a prefix of `tokens` are replaced (this one covers them,
    /// when it can be trimmed back to them);
    /// then the least recently used go until the cap holds. Returns the
    /// entry when it was not stored (the cache is disabled, or the entry is
    /// larger than the whole cap), so another tier can take it.
    pub fn insert(
        &mut self,
        namespace: &str,
        tokens: Vec<u32>,
        mut kv: KvCache,
    ) -> Option<Snapshot> {
        // A row still in the decode slab brings its buffers out of it (and
        // its recurrent states out of the last decode step's stack).
        kv.detach();
        kv.detach_states();
        if tokens.is_empty() || kv.offset() != tokens.len() {
            return None;
        }
        let bytes = kv.nbytes();
        if !self.enabled() || bytes > self.max_bytes {
            return Some(Snapshot {
                namespace: namespace.to_string(),
                tokens,
                kv,
            });
        }
        self.clock += 1;
        let branch = self.branch_point(namespace, &tokens, &kv);
        // A sliding-window entry covers a shorter one only if it can still
        // be trimmed back to it.
        self.entries.retain(|e| {
            (e.branch && e.tokens.len() < tokens.len())
                || !(e.namespace == namespace
                    && e.tokens.len() <= tokens.len()
                    && tokens[..e.tokens.len()] == e.tokens[..]
                    && kv.reusable(e.tokens.len()) == e.tokens.len())
        });
        if let Some(shared) = branch {
            // The shared prefix as an entry of its own, in compact buffers
            // (a view would pin the whole conversation's allocation).
            let mut prefix = kv.clone();
            prefix.truncate(shared);
            if prefix.compact().is_ok() && prefix.offset() == shared {
                let bytes = prefix.nbytes();
                self.entries.push(Entry {
                    namespace: namespace.to_string(),
                    tokens: tokens[..shared].to_vec(),
                    kv: prefix,
                    bytes,
                    last_used: self.clock,
                    persisted: false,
                    branch: true,
                });
                self.stats.branches += 1;
            }
        }
        self.entries.push(Entry {
            namespace: namespace.to_string(),
            tokens,
            kv,
            bytes,
            last_used: self.clock,
            persisted: false,
            branch: false,
        });
        while self.bytes() > self.max_bytes {
            // On a tie a shared prefix outlives the conversations under it
            // (a lookup touches both).
            let Some(e) = super::take_least_recent(&mut self.entries, |e| (e.last_used, e.branch))
            else {
                break;
            };
            self.stats.evictions += 1;
            // Spilled even when written before: the SSD may have evicted
            // it since (the writer skips it when the disk still has it).
            if self.keep_evicted {
                self.evicted.push(Snapshot {
                    namespace: e.namespace,
                    tokens: e.tokens,
                    kv: e.kv,
                });
            }
        }
        None
    }

    /// Where `tokens` branches off an entry it does not extend: the longest
    /// prefix it shares with one (at least [`BRANCH_MIN_TOKENS`], usable by
    /// `kv`), when no entry holds exactly that prefix already.
    fn branch_point(&self, namespace: &str, tokens: &[u32], kv: &KvCache) -> Option<usize> {
        let same = || self.entries.iter().filter(|e| e.namespace == namespace);
        let shared = same()
            .map(|e| common_prefix(&e.tokens, tokens))
            .filter(|&n| n < tokens.len())
            .filter(|&n| same().all(|e| e.tokens.len() != n || tokens[..n] != e.tokens[..]))
            .filter(|&n| {
                same().any(|e| e.tokens.len() > n && common_prefix(&e.tokens, tokens) == n)
            })
            .max()?;
        (shared >= BRANCH_MIN_TOKENS && kv.reusable(shared) == shared).then_some(shared)
    }

    fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Current counters.
    pub fn stats(&self) -> PromptCacheStats {
        PromptCacheStats {
            entries: self.entries.len(),
            bytes: self.bytes(),
            ..self.stats.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops;

    /// A KV cache of `n` positions (1 layer, 1 head, dim 4) worth 256*4*4*2 bytes.
    fn kv(n: usize) -> KvCache {
        let mut c = KvCache::new(1);
        let k = ops::ones::<f32>(&[1, 1, n as i32, 4]).unwrap();
        c.update(0, &k, &k).unwrap();
        c.advance(n);
        c
    }

    #[test]
    fn reuses_the_longest_prefix_and_leaves_one_token_to_prefill() {
        let mut cache = PromptCache::new(1 << 30);
        cache.insert("f32", vec![1, 2, 3, 4], kv(4));
        cache.insert("f32", vec![1, 2, 9], kv(3));
        let r = cache.lookup("f32", &[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((r.reused, r.kv.offset()), (4, 4));
        // The whole prompt is cached: one token is still prefilled.
        let r = cache.lookup("f32", &[1, 2, 3, 4]).unwrap();
        assert_eq!(r.reused, 3);
        // A divergent tail is trimmed away.
        let r = cache.lookup("f32", &[1, 2, 3, 7, 7]).unwrap();
        assert_eq!((r.reused, r.kv.offset()), (3, 3));
        assert!(cache.lookup("f32", &[5, 6]).is_none());
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.tokens_reused), (3, 1, 10));
    }

    #[test]
    fn namespaces_never_seed_each_other() {
        let mut cache = PromptCache::new(1 << 30);
        cache.insert("float32", vec![1, 2, 3], kv(3));
        assert!(cache.lookup("native", &[1, 2, 3, 4]).is_none());
        assert!(cache.lookup("float32", &[1, 2, 3, 4]).is_some());
    }

    #[test]
    fn evicts_least_recently_used_first_and_replaces_covered_prefixes() {
        let one = kv(3).nbytes();
        let mut cache = PromptCache::new(2 * one);
        cache.insert("n", vec![1, 1, 1], kv(3));
        cache.insert("n", vec![2, 2, 2], kv(3));
        // Touch [1, 1, 1] so [2, 2, 2] is the least recently used.
        assert!(cache.lookup("n", &[1, 1, 1, 5]).is_some());
        cache.insert("n", vec![3, 3, 3], kv(3));
        assert!(cache.lookup("n", &[2, 2, 2, 5]).is_none(), "evicted");
        assert!(cache.lookup("n", &[1, 1, 1, 5]).is_some());
        assert!(cache.lookup("n", &[3, 3, 3, 5]).is_some());
        assert_eq!(cache.stats().evictions, 1);
        // A longer conversation replaces the entry it extends.
        cache.insert("n", vec![3, 3, 3, 4], kv(4));
        assert_eq!(cache.stats().entries, 2);
    }

    #[test]
    fn a_shared_system_prompt_outlives_the_conversations_under_it() {
        let system: Vec<u32> = (0..BRANCH_MIN_TOKENS as u32).collect();
        let conv = |tail: u32| {
            let mut t = system.clone();
            t.extend([tail; 40]);
            t
        };
        let n = BRANCH_MIN_TOKENS + 40;
        // Room for the prefix entry and one conversation (plus capacity).
        let mut cache = PromptCache::new(kv(n).nbytes() + kv(BRANCH_MIN_TOKENS).nbytes() + 64 * 32);
        cache.insert("n", conv(1), kv(n));
        assert_eq!(cache.stats().branches, 0, "nothing to branch from yet");
        // A second conversation under the same system prompt: the shared
        // prefix becomes an entry of its own, in compact buffers.
        cache.insert("n", conv(2), kv(n));
        let s = cache.stats();
        assert_eq!(s.branches, 1);
        // A third evicts the older conversations, never the shared prefix
        // (every lookup under it touches it).
        assert!(cache.lookup("n", &conv(2)).is_some());
        cache.insert("n", conv(3), kv(n));
        let r = cache
            .lookup("n", &conv(9))
            .expect("the system prompt is still cached");
        assert_eq!(r.reused, BRANCH_MIN_TOKENS);
        // A conversation extending the prefix does not replace it.
        cache.insert("n", conv(4), kv(n));
        let r = cache.lookup("n", &conv(8)).expect("still cached");
        assert_eq!(r.reused, BRANCH_MIN_TOKENS);
        assert_eq!(cache.stats().branches, 1, "one entry for one prefix");
        // Short shared prefixes do not branch.
        let mut small = PromptCache::new(1 << 30);
        small.insert("n", vec![1, 2, 3, 4], kv(4));
        small.insert("n", vec![1, 2, 5, 6], kv(4));
        assert_eq!(small.stats().branches, 0);
    }

    /// A one-layer sliding-window cache (window 4) of `n` positions, fed one
    /// token at a time.
    fn windowed(n: usize) -> KvCache {
        let mut c = KvCache::with_kinds(&[crate::cache::LayerKind::SlidingWindow { window: 4 }]);
        let k = ops::ones::<f32>(&[1, 1, 1, 4]).unwrap();
        for _ in 0..n {
            c.update(0, &k, &k).unwrap();
            c.advance(1);
        }
        c
    }

    #[test]
    fn a_sliding_window_entry_is_reused_only_within_its_rollback_margin() {
        let n = 2 * KvCache::STEP + KvCache::ROLLBACK + 10;
        let tokens: Vec<u32> = (0..n as u32).collect();
        let short = tokens[..20].to_vec();
        let mut cache = PromptCache::new(1 << 30);
        cache.insert("n", short.clone(), windowed(20));
        cache.insert("n", tokens.clone(), windowed(n));
        // The long entry cannot be trimmed back to 20 tokens: the short one stays.
        assert_eq!(cache.stats().entries, 2);
        let min = windowed(n).min_resume();
        let mut near = tokens[..min + 1].to_vec();
        near.push(9999);
        assert_eq!(cache.peek("n", &near), min + 1);
        let mut far = tokens[..min - 1].to_vec();
        far.push(9999);
        // Too far back for the long entry; the short one still serves 20.
        assert_eq!(cache.peek("n", &far), 20);
        let r = cache.lookup("n", &far).unwrap();
        assert_eq!((r.reused, r.kv.offset()), (20, 20));
    }

    #[test]
    fn zero_bytes_disables_it() {
        let mut cache = PromptCache::new(0);
        cache.insert("n", vec![1, 2], kv(2));
        assert!(cache.lookup("n", &[1, 2, 3]).is_none());
        assert_eq!(cache.stats().entries, 0);
    }
}
