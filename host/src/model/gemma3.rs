//! Gemma 3's text decoder (`gemma3` in GGUF, `gemma3_text` in mlx-lm) over
//! a ragged batch of rows.
//!
//! Follows mlx-lm's `mlx_lm/models/gemma3_text.py` (itself Hugging Face's
//! `modeling_gemma3.py`): embeddings scaled by `sqrt(hidden_size)` (rounded
//! to bfloat16, as both do); per layer four RMSNorms with Gemma's `1 + w`
//! weights (before and after attention, before and after the MLP, the
//! "after" norms applied to the branch before the residual add); per-head
//! RMSNorm of q and k; half-split RoPE with base `rope_local_base_freq` on
//! sliding-window layers and `rope_theta` on the global ones (every
//! `sliding_window_pattern`-th layer); queries scaled by
//! `query_pre_attn_scalar^-0.5`; a GELU (tanh approximation) gated MLP; a
//! tied output head. Sliding-window layers attend to the last
//! `sliding_window` positions (`(q - W, q]`, llama.cpp's standard SWA mask)
//! and keep a bounded cache ([`LayerKind::SlidingWindow`]).
//!
//! Decode runs through MLX ops (the fused CPU decode op is Llama-shaped).

use mlx_rs::{fast, ops, Array, Dtype};

use super::config::ModelConfig;
use super::cpu_quant::Kernel;
use super::error::Result;
use super::linear::{Embedding, Linear};
use super::llama::{Projections, RowInput};
use super::ragged;
use crate::cache::{KvCache, LayerKind};

/// One Gemma 3 decoder layer. Norm weights are stored as `1 + w`, the
/// factor the norms multiply by.
#[derive(Debug, Clone)]
pub struct Gemma3Layer {
    /// Norm before attention, `[H]`.
    pub input_norm: Array,
    /// Norm of the attention output, before the residual add, `[H]`.
    pub post_attention_norm: Array,
    /// Norm before the MLP, `[H]`.
    pub pre_feedforward_norm: Array,
    /// Norm of the MLP output, before the residual add, `[H]`.
    pub post_feedforward_norm: Array,
    /// `q_proj` `[n_heads*D, H]`, `k_proj`/`v_proj` `[n_kv*D, H]`.
    pub qkv: Projections,
    /// Per-head RMSNorm of queries, `[D]`.
    pub q_norm: Array,
    /// Per-head RMSNorm of keys, `[D]`.
    pub k_norm: Array,
    /// `o_proj`: `[H, n_heads * D]`.
    pub o_proj: Linear,
    /// `gate_proj`, `up_proj`: `[I, H]` each.
    pub gate_up: Projections,
    /// `down_proj`: `[H, I]`.
    pub down_proj: Linear,
    /// Full or sliding-window attention.
    pub kind: LayerKind,
    /// RoPE base of this layer.
    pub rope_base: f32,
}

/// Gemma 3's parameters plus its compute dtype.
#[derive(Debug, Clone)]
pub struct Gemma3 {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding `[V, H]`, also the output head.
    pub embed: Embedding,
    /// Decoder layers.
    pub layers: Vec<Gemma3Layer>,
    /// Final norm (`1 + w`), `[H]`.
    pub norm: Array,
    /// Activation dtype.
    pub dtype: Dtype,
    /// CPU kernel for the layers' decode-sized quantized products.
    pub layer_kernel: Kernel,
}

impl Gemma3 {
    /// Layer `l`'s kind: global every `sliding_window_pattern`-th layer
    /// (default 6), sliding-window otherwise; all global without a window.
    pub fn layer_kind(config: &ModelConfig, l: usize) -> LayerKind {
        let pattern = config.sliding_window_pattern.unwrap_or(6).max(1);
        match config.sliding_window {
            Some(window) if !(l + 1).is_multiple_of(pattern) => LayerKind::SlidingWindow { window },
            _ => LayerKind::Full,
        }
    }

    /// Multiplier of the embeddings: `sqrt(hidden_size)` rounded to
    /// bfloat16 (mlx-lm and Hugging Face round it so; llama.cpp does not,
    /// a 0.2% difference for hidden size 640).
    pub fn embed_scale(config: &ModelConfig) -> f32 {
        half::bf16::from_f32((config.hidden_size as f32).sqrt()).to_f32()
    }

    /// Runs the rows' new tokens through the model, extending each row's
    /// cache, and returns per row the logits `[n, V]` (float32, lazy) for
    /// positions `logits_from..tokens.len()`. With `device_ids` (`[N]`
    /// uint32, lazy) the packed token ids come from it instead of the rows'
    /// `tokens` (see [`super::CausalLm::forward_device_ids`]).
    ///
    /// Errors: a token id `>= vocab_size`; MLX errors.
    pub fn forward_ids(
        &self,
        rows: &mut [RowInput<'_>],
        device_ids: Option<&Array>,
    ) -> Result<Vec<Array>> {
        let c = &self.config;
        let Some(ragged::Packed {
            ids,
            lens,
            positions,
        }) = ragged::pack(rows, c.vocab_size)?
        else {
            return Ok(ragged::no_logits(rows.len(), c.vocab_size));
        };
        let ids = device_ids.cloned().unwrap_or(ids);
        let eps = c.rms_norm_eps;
        let scale = Array::from_f32(Self::embed_scale(c)).as_dtype(self.dtype)?;
        let mut h = ops::multiply(&self.embed.lookup(&ids, self.dtype)?, &scale)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, Some(&layer.input_norm), eps)?;
            let attn = self.attention(l, layer, &x, rows, &lens, &positions)?;
            let attn = layer.o_proj.forward_with(&attn, self.layer_kernel)?;
            h = residual(
                &h,
                &fast::rms_norm(&attn, Some(&layer.post_attention_norm), eps)?,
            )?;
            let x = fast::rms_norm(&h, Some(&layer.pre_feedforward_norm), eps)?;
            let down = gelu_mlp(&layer.gate_up, &layer.down_proj, &x, self.layer_kernel)?;
            h = residual(
                &h,
                &fast::rms_norm(&down, Some(&layer.post_feedforward_norm), eps)?,
            )?;
        }
        for (row, &t) in rows.iter_mut().zip(&lens) {
            row.cache.advance(t);
        }
        ragged::head(&h, rows, &lens, c.vocab_size, |hs| {
            let hs = fast::rms_norm(hs, Some(&self.norm), eps)?.as_dtype(Dtype::Float32)?;
            Ok(self.embed.as_linear(&hs)?.as_dtype(Dtype::Float32)?)
        })
    }

    /// Self-attention for all rows: `x: [N, H]` -> `[N, n_heads * D]`.
    /// Projections, q/k norms and RoPE run once for all tokens; attention
    /// per row against its own cache.
    fn attention(
        &self,
        l: usize,
        layer: &Gemma3Layer,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        positions: &Array,
    ) -> Result<Array> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let (nh, nkv) = (c.num_attention_heads as i32, c.num_key_value_heads as i32);
        let qkv = layer.qkv.forward(x, self.layer_kernel)?;
        let n = qkv[0].shape()[0];
        let rope = |a: &Array, heads: i32, norm: &Array| {
            let norm = Some((norm, c.rms_norm_eps));
            ragged::rope_heads(a, heads, d, norm, layer.rope_base, positions)
        };
        let q = rope(&qkv[0], nh, &layer.q_norm)?;
        let k = rope(&qkv[1], nkv, &layer.k_norm)?;
        let v = qkv[2].reshape(&[n, nkv, 1, d])?;
        let scale = c.query_pre_attn_scalar.unwrap_or(d as f32).powf(-0.5);
        ragged::attend_rows(
            l,
            layer.kind,
            &q,
            Some((&k, &v)),
            rows,
            lens,
            (nh, nkv, d),
            scale,
            None,
        )
    }

    /// A fresh cache for one row: sliding-window layers bounded.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_kinds(&self.layers.iter().map(|l| l.kind).collect::<Vec<_>>())
    }

    /// Every parameter array.
    pub fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        for layer in &self.layers {
            out.extend([
                &layer.input_norm,
                &layer.post_attention_norm,
                &layer.pre_feedforward_norm,
                &layer.post_feedforward_norm,
                &layer.q_norm,
                &layer.k_norm,
            ]);
            let mut linears = layer.qkv.linears();
            linears.extend(layer.gate_up.linears());
            linears.extend([&layer.o_proj, &layer.down_proj]);
            for lin in linears {
                out.extend(lin.tensors().into_iter().map(|(_, a)| a));
            }
        }
        out.push(&self.norm);
        out
    }
}

/// Gemma's gated MLP `down(gelu_tanh(gate(x)) * up(x))` (`x: [N, H]`;
/// `gate_up` the gate and up projections), shared by Gemma 3 and Gemma 4.
pub(super) fn gelu_mlp(
    gate_up: &Projections,
    down: &Linear,
    x: &Array,
    kernel: Kernel,
) -> Result<Array> {
    let gu = gate_up.forward(x, kernel)?;
    let act = ops::multiply(mlx_rs::nn::gelu_approximate(&gu[0])?, &gu[1])?;
    down.forward_with(&act, kernel)
}

/// `h + branch`; in float16, added in float32 and clipped to float16's
/// range, as mlx-lm's `clip_residual` does (Gemma's residual stream
/// overflows float16 otherwise).
fn residual(h: &Array, branch: &Array) -> Result<Array> {
    if h.dtype() != Dtype::Float16 {
        return Ok(ops::add(h, branch)?);
    }
    let bound = f32::from(half::f16::MAX);
    let sum = ops::add(
        h.as_dtype(Dtype::Float32)?,
        branch.as_dtype(Dtype::Float32)?,
    )?;
    Ok(ops::clip(&sum, (-bound, bound))?.as_dtype(Dtype::Float16)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sixth_layer_is_global() {
        let config: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
            "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 262144,
            "sliding_window": 512, "sliding_window_pattern": 6
        }))
        .expect("valid config");
        let global: Vec<usize> = (0..18)
            .filter(|&l| Gemma3::layer_kind(&config, l) == LayerKind::Full)
            .collect();
        assert_eq!(global, vec![5, 11, 17]);
        assert_eq!(
            Gemma3::layer_kind(&config, 0),
            LayerKind::SlidingWindow { window: 512 }
        );
        assert_eq!(Gemma3::embed_scale(&config), 25.25);
    }
}
