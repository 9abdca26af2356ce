//! Admission by memory, against `--memory-budget`. A row reserves the KV it
//! holds now plus a little room ([`KV_GROWTH_TOKENS`] positions), and while
//! it prefills the transient activations of its largest prefill chunk; not
//! its whole `max_tokens` up front (agents send 32000 and generate a few
//! hundred). The scheduler grows the reservation as the row decodes; when
//! the budget runs short it preempts the youngest rows (their KV goes to
//! the prompt cache and they resume later, re-feeding their history), as
//! vLLM's scheduler does. A prompt that cannot fit even alone fails with a
//! 400; one that fits once running rows retire waits in the queue; a row
//! whose own KV outgrows the budget finishes with `length`.
//!
//! The estimate is an upper bound of the model graph's own buffers
//! (`model/llama.rs`): KV `[layers, 2, H_kv, T, D]` in the activation dtype
//! (per cache layer: sliding-window layers keep at most their window, and
//! Gemma 4's full layers have their own `H_kv` and `D`), attention scores
//! `[H, chunk, T]` in float32 for one layer at a time, the MLP's
//! `[chunk, intermediate]` gate, up and product (a mixture-of-experts
//! layer's `[chunk, k, I_expert]` ones and its `[chunk, k, hidden]` gathered
//! inputs, expert outputs and weighted outputs, `model/moe.rs`), Gemma 4's
//! per-layer inputs `[chunk, layers × P]` (`model/gemma4/per_layer.rs`),
//! and the last position's logits `[vocab]` in float32.

use crate::cache::{KvShape, LayerKind};
use crate::model::ModelConfig;

/// The shape numbers the estimate needs (from the model's config and KV
/// cache kinds).
#[derive(Debug, Clone, PartialEq)]
pub struct RowShape {
    /// Cache layers' kinds (one per layer of the model's KV cache).
    pub kinds: Vec<LayerKind>,
    /// Cache layers' KV heads (`H_kv`) and head dimension (`D`), as many
    /// as `kinds`.
    pub kv_shapes: Vec<KvShape>,
    /// Query heads per layer (`H`).
    pub heads: usize,
    /// Residual width.
    pub hidden: usize,
    /// MLP width per token: the widest dense MLP's (Gemma 4's KV-shared
    /// layers may be twice as wide), or a sparse layer's
    /// `k × (I_expert + hidden)` when larger (see the module doc).
    pub intermediate: usize,
    /// Gemma 4's per-layer inputs per token (`layers × width`; 0 without),
    /// held for the whole forward.
    pub per_layer_inputs: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Bytes per KV element (the activation dtype: 2 for float16/bfloat16,
    /// 4 for float32).
    pub kv_elem_bytes: usize,
    /// Bytes a row holds per recurrent-state layer (gated DeltaNet), at any
    /// length: its conv and recurrent states, and as many again for each
    /// checkpoint it may keep (`cache::state`); 0 without such layers.
    pub state_bytes: usize,
    /// The full-attention layers' KV quantization (`--kv-bits`): they hold
    /// packed rows, not `kv_elem_bytes` per element.
    pub kv_quant: Option<crate::cache::KvQuant>,
}

/// Bytes a row holds per gated-DeltaNet layer: the conv state `[K - 1,
/// C]` (activation dtype) and the recurrent state `[H_v, D_v, D_k]`
/// (float32), for the current states, the step before and up to
/// `cache::state::MAX_CHECKPOINTS` + 1 checkpoints; 0 for a model without
/// such layers.
fn recurrent_state_bytes(config: &ModelConfig, elem: usize) -> usize {
    if !crate::model::qwen3_5::config::is_hybrid(&config.model_type) {
        return 0;
    }
    let d = config.linear_attn.dims();
    let one = (d.conv_kernel.saturating_sub(1)) * d.conv_width() * elem
        + d.value_heads * d.value_dim * d.key_dim * 4;
    one * (crate::cache::state::MAX_CHECKPOINTS + 3)
}

/// A sparse layer's per-token MLP width: its `k` experts' `I_expert`-wide
/// gate, up and product plus their `hidden`-wide gathered inputs, outputs
/// and weighted outputs, counted as three buffers of `k × (I_expert +
/// hidden)`; 0 for a dense model.
fn expert_width(config: &ModelConfig) -> usize {
    let moe = &config.moe;
    match (moe.num_experts, moe.num_experts_per_tok) {
        (Some(e), Some(k)) if e > 0 => {
            k * (moe.moe_intermediate_size.unwrap_or(0) + config.hidden_size)
        }
        _ => 0,
    }
}

impl RowShape {
    /// The shape of a model with `config`, cache layer kinds `kinds` and
    /// shapes `kv_shapes` (`CausalLm::new_cache` and `kv_shapes`), and
    /// activation elements of `kv_elem_bytes` bytes.
    pub fn new(
        config: &ModelConfig,
        kinds: Vec<LayerKind>,
        kv_shapes: Vec<KvShape>,
        kv_elem_bytes: usize,
    ) -> RowShape {
        let g = &config.gemma4;
        let widest_dense = (0..config.num_hidden_layers)
            .map(|l| g.mlp_width(config, l))
            .max()
            .unwrap_or(config.intermediate_size);
        RowShape {
            kinds,
            kv_shapes,
            heads: config.num_attention_heads,
            hidden: config.hidden_size,
            intermediate: widest_dense.max(expert_width(config)),
            per_layer_inputs: config.num_hidden_layers * g.per_layer_width(),
            vocab: config.vocab_size,
            kv_elem_bytes,
            state_bytes: recurrent_state_bytes(config, kv_elem_bytes),
            kv_quant: None,
        }
    }

    /// This shape with full-attention layers quantized by `quant`
    /// (`CausalLm::new_cache`'s scheme).
    pub fn with_kv_quant(mut self, quant: Option<crate::cache::KvQuant>) -> RowShape {
        self.kv_quant = quant;
        self
    }

    /// KV bytes of a row holding `tokens` positions: per cache layer
    /// `2 × H_kv × min(tokens, window) × D × elem`; a recurrent-state layer
    /// holds [`RowShape::state_bytes`] whatever the length (once fed).
    pub fn kv_bytes(&self, tokens: usize) -> u64 {
        self.kinds
            .iter()
            .zip(&self.kv_shapes)
            .map(|(k, s)| {
                let kept = match k {
                    LayerKind::Full => tokens,
                    LayerKind::SlidingWindow { window } => tokens.min(*window),
                    LayerKind::Recurrent if tokens > 0 => return self.state_bytes as u64,
                    LayerKind::Recurrent => 0,
                };
                let per_position = match (k, self.kv_quant) {
                    (LayerKind::Full, Some(q)) => q.bytes_per_token(s.kv_heads, s.head_dim) as u64,
                    _ => (2 * s.kv_heads * s.head_dim * self.kv_elem_bytes) as u64,
                };
                kept as u64 * per_position
            })
            .sum()
    }

    /// Transient bytes of one forward feeding `chunk` positions after
    /// `context` positions already cached (float32 scores `[H, chunk,
    /// context + chunk]`, the MLP's three `[chunk, intermediate]` buffers,
    /// four `[chunk, hidden]` residual buffers, the last logits row).
    pub fn activation_bytes(&self, chunk: usize, context: usize) -> u64 {
        let f32 = 4u64;
        let scores = (self.heads * chunk * (context + chunk)) as u64 * f32;
        let mlp = (3 * chunk * self.intermediate) as u64 * f32;
        let residual = (4 * chunk * self.hidden) as u64 * f32;
        // The per-layer embeddings, their projection and their sum.
        let per_layer = (3 * chunk * self.per_layer_inputs) as u64 * f32;
        let logits = self.vocab as u64 * f32;
        scores + mlp + residual + per_layer + logits
    }

    /// The most a row of `prompt` tokens generating up to `max_new` tokens
    /// holds at once: its final KV plus its largest prefill forward
    /// (`prefill_chunk` positions after the rest of the prompt).
    pub fn row_bytes(&self, prompt: usize, max_new: usize, prefill_chunk: usize) -> u64 {
        self.reservation_bytes(prompt + max_new, Some(prompt), prefill_chunk)
    }

    /// What a row reserves: KV for `kv_tokens` positions, plus, while it
    /// prefills up to position `prefill_end`, its largest prefill forward
    /// (`prefill_chunk` positions after the rest).
    pub fn reservation_bytes(
        &self,
        kv_tokens: usize,
        prefill_end: Option<usize>,
        prefill_chunk: usize,
    ) -> u64 {
        self.reservation_left(kv_tokens, prefill_end.map(|e| (e, e)), prefill_chunk)
    }

    /// As [`RowShape::reservation_bytes`], for a row with `left` of its
    /// `prefill` positions still to feed (`Some((end, left))`): its largest
    /// forward still to come is the last chunk, at most `left` positions.
    pub fn reservation_left(
        &self,
        kv_tokens: usize,
        prefill: Option<(usize, usize)>,
        prefill_chunk: usize,
    ) -> u64 {
        let activations = prefill.map_or(0, |(end, left)| {
            let chunk = left.min(end).min(prefill_chunk.max(1));
            self.activation_bytes(chunk, end - chunk)
        });
        self.kv_bytes(kv_tokens) + activations
    }
}

/// Positions a row's KV reservation grows by (and the room past its
/// prompt it reserves at admission).
pub const KV_GROWTH_TOKENS: usize = 256;

/// Positions to reserve for a row that will hold `needed` positions after
/// its next step and at most `final_positions` ever: `needed` rounded up to
/// a whole number of [`KV_GROWTH_TOKENS`], capped at `final_positions`
/// (never below `needed`).
pub fn grown_tokens(needed: usize, final_positions: usize) -> usize {
    let rounded = needed.div_ceil(KV_GROWTH_TOKENS).max(1) * KV_GROWTH_TOKENS;
    rounded.min(final_positions).max(needed)
}

/// `--memory-budget`: how many bytes the running rows may reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBudget {
    /// No admission check.
    Off,
    /// This many bytes.
    Bytes(u64),
    /// 90% of the memory available when the scheduler starts (after the
    /// model is loaded), less `keep` bytes (the RAM prompt cache's cap);
    /// no check where available memory cannot be read (not Linux).
    Auto {
        /// Bytes left out of the budget.
        keep: u64,
    },
    /// Inside MLX's memory limit (`--memory-limit`; on a GPU by default):
    /// the limit less what MLX holds when the scheduler starts (the
    /// weights), the buffer cache's cap and `keep` (the prompt cache's).
    Device {
        /// What [`crate::device_memory::MemoryLimits::apply`] set.
        limits: crate::device_memory::MemoryLimits,
        /// Bytes left out of the budget.
        keep: u64,
    },
}

impl MemoryBudget {
    /// The budget in bytes now (`None`: no check).
    pub fn resolve(self) -> Option<u64> {
        let auto = |keep: u64| {
            crate::runtime::available_memory_bytes()
                .map(|a| (a as f64 * 0.9) as u64)
                .map(|a| a.saturating_sub(keep))
        };
        match self {
            MemoryBudget::Off => None,
            MemoryBudget::Bytes(b) => Some(b),
            MemoryBudget::Auto { keep } => auto(keep),
            MemoryBudget::Device { limits, keep } => Some(device_budget(
                limits,
                crate::device_memory::current().active_bytes,
                keep,
            )),
        }
    }
}

/// [`MemoryBudget::Device`]'s bytes: the limit less `active` (what MLX
/// holds now), the cache's cap and `keep`; zero when those fill it.
pub fn device_budget(limits: crate::device_memory::MemoryLimits, active: u64, keep: u64) -> u64 {
    limits
        .limit
        .saturating_sub(active)
        .saturating_sub(limits.cache_limit)
        .saturating_sub(keep)
}

/// Formats bytes as GiB with two decimals, for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kinds: Vec<LayerKind>) -> RowShape {
        let kv = KvShape {
            kv_heads: 3,
            head_dim: 64,
        };
        RowShape {
            kv_shapes: vec![kv; kinds.len()],
            kinds,
            heads: 9,
            hidden: 576,
            intermediate: 1536,
            per_layer_inputs: 0,
            vocab: 49152,
            kv_elem_bytes: 4,
            state_bytes: 0,
            kv_quant: None,
        }
    }

    /// Quantized full layers count their packed rows; sliding-window
    /// layers stay float.
    #[test]
    fn quantized_full_layers_count_packed_rows() {
        let q = crate::cache::KvQuant::new(4, 64).ok();
        let kinds = vec![LayerKind::Full, LayerKind::SlidingWindow { window: 8 }];
        let float = shape(kinds.clone());
        let quant = shape(kinds).with_kv_quant(q);
        // Full: 2 x 3 heads x (8 + 2) words x 4 bytes; sliding: float32.
        assert_eq!(
            float.kv_bytes(100) - quant.kv_bytes(100),
            100 * (2 * 3 * 64 * 4 - 240)
        );
        assert_eq!(quant.kv_bytes(100), 100 * 240 + 8 * 2 * 3 * 64 * 4);
    }

    /// A hybrid model's rows hold their recurrent states (and checkpoints)
    /// at any length, counted once fed; its full layers' KV per position.
    #[test]
    fn recurrent_layers_count_their_states_not_positions() {
        let c: ModelConfig = serde_json::from_value(crate::model::qwen3_5::config::normalize(
            serde_json::json!({
                "model_type": "qwen3_5", "text_config": {
                    "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                    "vocab_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                }
            }),
        ))
        .expect("config");
        let kinds = crate::model::qwen3_5::config::layer_kinds(&c);
        let kv = KvShape {
            kv_heads: 2,
            head_dim: 32,
        };
        let s = RowShape::new(&c, kinds, vec![kv; 4], 4);
        // conv [3, 2*2*32 + 4*16] float32 + state [4, 16, 32] float32, 11 copies.
        let one = 3 * 192 * 4 + 4 * 16 * 32 * 4;
        assert_eq!(
            s.state_bytes,
            one * (crate::cache::state::MAX_CHECKPOINTS + 3)
        );
        assert_eq!(s.kv_bytes(0), 0);
        let per_position = 2 * 2 * 32 * 4;
        for tokens in [1, 1000] {
            assert_eq!(
                s.kv_bytes(tokens),
                (3 * s.state_bytes + tokens * per_position) as u64
            );
        }
    }

    #[test]
    fn sparse_layers_count_their_chosen_experts_buffers() {
        // Qwen3-30B-A3B's shape: 8 of 128 experts, 768 wide, hidden 2048.
        let mut c: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
            "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 151936, "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768
        }))
        .expect("config");
        let kinds = vec![LayerKind::Full; 48];
        let kv = vec![
            KvShape {
                kv_heads: 4,
                head_dim: 128
            };
            48
        ];
        assert_eq!(
            RowShape::new(&c, kinds.clone(), kv.clone(), 2).intermediate,
            8 * (768 + 2048)
        );
        c.moe = Default::default();
        assert_eq!(RowShape::new(&c, kinds, kv, 2).intermediate, 6144);
    }

    #[test]
    fn device_budget_is_the_limit_less_weights_cache_and_prompt_cache() {
        let g = 1u64 << 30;
        let limits = crate::device_memory::MemoryLimits {
            limit: 72 * g,
            cache_limit: 7 * g,
        };
        assert_eq!(device_budget(limits, 17 * g, g), 47 * g);
        assert_eq!(device_budget(limits, 70 * g, g), 0);
    }

    #[test]
    fn kv_grows_with_tokens_and_stops_at_the_window() {
        let full = shape(vec![LayerKind::Full; 30]);
        // SmolLM2-135M in float32: 30 layers × 2 × 3 × 64 × 4 = 46,080 B/token.
        assert_eq!(full.kv_bytes(1), 46_080);
        assert_eq!(full.kv_bytes(1000), 46_080_000);
        let sliding = shape(vec![LayerKind::SlidingWindow { window: 512 }; 30]);
        assert_eq!(sliding.kv_bytes(512), sliding.kv_bytes(4096));
        assert!(sliding.kv_bytes(511) < sliding.kv_bytes(512));
    }

    #[test]
    fn reservations_grow_in_whole_steps_up_to_the_final_length() {
        assert_eq!(grown_tokens(1, 10_000), KV_GROWTH_TOKENS);
        assert_eq!(grown_tokens(KV_GROWTH_TOKENS, 10_000), KV_GROWTH_TOKENS);
        assert_eq!(
            grown_tokens(KV_GROWTH_TOKENS + 1, 10_000),
            2 * KV_GROWTH_TOKENS
        );
        // Capped by what the row can ever hold, never below the need.
        assert_eq!(grown_tokens(300, 310), 310);
        assert_eq!(grown_tokens(300, 200), 300);
        let s = shape(vec![LayerKind::Full; 30]);
        assert_eq!(s.reservation_bytes(100, None, 512), s.kv_bytes(100));
        assert_eq!(
            s.reservation_bytes(1300, Some(1000), 512),
            s.kv_bytes(1300) + s.activation_bytes(512, 488)
        );
        // A resumed row whose cache gave back all but 3 of its 1000
        // positions: its last forward feeds 3, not a whole chunk.
        assert_eq!(
            s.reservation_left(1300, Some((1000, 3)), 512),
            s.kv_bytes(1300) + s.activation_bytes(3, 997)
        );
    }

    #[test]
    fn a_row_counts_its_final_kv_and_its_largest_chunk() {
        let s = shape(vec![LayerKind::Full; 30]);
        let row = s.row_bytes(1000, 200, 512);
        assert_eq!(row, s.kv_bytes(1200) + s.activation_bytes(512, 488));
        // A short prompt is one chunk of its own length.
        assert_eq!(
            s.row_bytes(10, 5, 512),
            s.kv_bytes(15) + s.activation_bytes(10, 0)
        );
        assert!(s.row_bytes(1000, 2000, 512) > s.row_bytes(1000, 200, 512));
    }
}
