//! Gemma 4's text decoder (mlx-lm's `gemma4_text`, and the `gemma4`
//! checkpoints that wrap it) over a ragged batch of rows.
//!
//! Follows mlx-lm 0.32.2's `mlx_lm/models/gemma4_text.py`. What it shares
//! with Gemma 3 ([`super::gemma3`]) is shared code: sliding-window and
//! global layers with the same bounded cache ([`LayerKind::SlidingWindow`],
//! trimmable in the RAM and SSD tiers alike), four norms per layer around
//! attention and the GELU-gated MLP ([`gelu_mlp`]), per-head q/k norms,
//! half-split RoPE, scaled embeddings, a tied head, each row's attention
//! over its own cache ([`ragged::attend_rows`]). What differs:
//! - norms multiply by `w` (Gemma 3: `1 + w`); values get a weightless
//!   RMSNorm too; attention is unscaled (the q/k norms set the scale);
//! - the embedding scale is `sqrt(H)` unrounded (Gemma 3 rounds it to
//!   bfloat16), and no float16 clipping of the residual sum;
//! - layer types come from `layer_types`; full layers have their own head
//!   size (`global_head_dim`), proportional partial RoPE and, with
//!   `attention_k_eq_v`, values from the key projection and their own KV
//!   head count;
//! - the last `num_kv_shared_layers` layers compute only queries and
//!   attend over the keys and values an earlier layer of their type wrote
//!   in the same forward (one cache layer serves both; the cache holds only
//!   the non-shared layers), and their MLPs may be twice as wide;
//! - per-layer inputs ([`per_layer`]); each layer's output times a learned
//!   scalar; logits softcapped, `tanh(x / cap) * cap`.
//!
//! Decode runs through MLX ops, as Gemma 3's does.

pub mod config;
mod load;
pub mod per_layer;

use mlx_rs::{fast, ops, ops::indexing::IndexOp, Array, Dtype};

pub use load::build_gemma4;

use super::config::ModelConfig;
use super::cpu_quant::Kernel;
use super::error::Result;
use super::gemma3::gelu_mlp;
use super::linear::{Embedding, Linear};
use super::llama::{Projections, RowInput};
use super::ragged::{self, Rope};
use crate::cache::{KvCache, KvShape, LayerKind};
use per_layer::{PerLayerGate, PerLayerInputs};

/// One layer's attention parameters.
#[derive(Debug, Clone)]
pub struct Gemma4Attention {
    /// `q_proj`, then `k_proj` and `v_proj` where the layer has them (a
    /// KV-shared layer: only `q_proj`; `attention_k_eq_v`: no `v_proj`).
    pub projections: Projections,
    /// Per-head RMSNorm of queries, `[D]`.
    pub q_norm: Array,
    /// Per-head RMSNorm of keys, `[D]`; `None` on a KV-shared layer.
    pub k_norm: Option<Array>,
    /// `o_proj`: `[H, n_heads * D]`.
    pub o_proj: Linear,
    /// Full or sliding-window attention.
    pub kind: LayerKind,
    /// The cache layer its keys and values live in (its own, or the
    /// layer it shares them with).
    pub cache_layer: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads and head dimension.
    pub kv: KvShape,
    /// Its RoPE.
    pub rope: Rope,
}

/// One Gemma 4 decoder layer. Norm weights are the `w` they multiply by.
#[derive(Debug, Clone)]
pub struct Gemma4Layer {
    /// Norm before attention, `[H]`.
    pub input_norm: Array,
    /// Norm of the attention output, before the residual add, `[H]`.
    pub post_attention_norm: Array,
    /// Norm before the MLP, `[H]`.
    pub pre_feedforward_norm: Array,
    /// Norm of the MLP output, before the residual add, `[H]`.
    pub post_feedforward_norm: Array,
    /// Attention.
    pub attn: Gemma4Attention,
    /// `gate_proj`, `up_proj`: `[I, H]` each (`I` doubled on KV-shared
    /// layers with `use_double_wide_mlp`).
    pub gate_up: Projections,
    /// `down_proj`: `[H, I]`.
    pub down_proj: Linear,
    /// Its per-layer input gate, on models with per-layer inputs.
    pub per_layer: Option<PerLayerGate>,
    /// `layer_scalar`: the layer's output is multiplied by it, `[1]`.
    pub layer_scalar: Array,
}

/// Gemma 4's parameters plus its compute dtype.
#[derive(Debug, Clone)]
pub struct Gemma4 {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding `[V, H]`, also the output head when tied.
    pub embed: Embedding,
    /// Per-layer inputs (E2B, E4B); `None` without.
    pub per_layer: Option<PerLayerInputs>,
    /// Decoder layers.
    pub layers: Vec<Gemma4Layer>,
    /// Final norm, `[H]`.
    pub norm: Array,
    /// Untied output head `[V, H]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// Activation dtype.
    pub dtype: Dtype,
    /// CPU kernel for the layers' decode-sized quantized products.
    pub layer_kernel: Kernel,
}

impl Gemma4 {
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
        let kernel = self.layer_kernel;
        // mlx-lm multiplies by the Python float `sqrt(H)` (cast to the
        // activation dtype), not by Gemma 3's bfloat16-rounded value.
        let scale = Array::from_f32((c.hidden_size as f32).sqrt()).as_dtype(self.dtype)?;
        let mut h = ops::multiply(&self.embed.lookup(&ids, self.dtype)?, &scale)?;
        let per_layer = match &self.per_layer {
            Some(p) => Some(p.inputs(&ids, &h, eps, kernel)?),
            None => None,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, Some(&layer.input_norm), eps)?;
            let attn = self.attention(&layer.attn, &x, rows, &lens, &positions)?;
            let attn = layer.attn.o_proj.forward_with(&attn, kernel)?;
            h = ops::add(
                &h,
                fast::rms_norm(&attn, Some(&layer.post_attention_norm), eps)?,
            )?;
            let x = fast::rms_norm(&h, Some(&layer.pre_feedforward_norm), eps)?;
            let down = gelu_mlp(&layer.gate_up, &layer.down_proj, &x, kernel)?;
            h = ops::add(
                &h,
                fast::rms_norm(&down, Some(&layer.post_feedforward_norm), eps)?,
            )?;
            if let (Some(gate), Some(inputs)) = (&layer.per_layer, &per_layer) {
                let input = inputs.index((.., l as i32, ..));
                h = ops::add(&h, gate.forward(&h, &input, eps, kernel)?)?;
            }
            h = ops::multiply(&h, &layer.layer_scalar)?;
        }
        for (row, &t) in rows.iter_mut().zip(&lens) {
            row.cache.advance(t);
        }
        let cap = c.gemma4.final_logit_softcapping;
        ragged::head(&h, rows, &lens, c.vocab_size, |hs| {
            let hs = fast::rms_norm(hs, Some(&self.norm), eps)?.as_dtype(Dtype::Float32)?;
            let logits = match &self.lm_head {
                Some(head) => head.forward(&hs)?,
                None => self.embed.as_linear(&hs)?,
            }
            .as_dtype(Dtype::Float32)?;
            match cap {
                Some(cap) => softcap(&logits, cap),
                None => Ok(logits),
            }
        })
    }

    /// Self-attention for all rows: `x: [N, H]` -> `[N, n_heads * D]`.
    /// Projections, norms and RoPE run once for all tokens; attention per
    /// row against its own cache, over this layer's new keys and values or,
    /// on a KV-shared layer, over those its source layer wrote.
    fn attention(
        &self,
        attn: &Gemma4Attention,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        positions: &Array,
    ) -> Result<Array> {
        let eps = self.config.rms_norm_eps;
        let (nh, nkv, d) = (
            attn.heads as i32,
            attn.kv.kv_heads as i32,
            attn.kv.head_dim as i32,
        );
        let parts = attn.projections.forward(x, self.layer_kernel)?;
        let n = parts[0].shape()[0];
        let rope = |a: &Array, heads: i32, norm: &Array| {
            ragged::rope_heads_with(a, heads, d, Some((norm, eps)), &attn.rope, positions)
        };
        let q = rope(&parts[0], nh, &attn.q_norm)?;
        let kv = match (&attn.k_norm, parts.get(1)) {
            (Some(k_norm), Some(k_raw)) => {
                // `attention_k_eq_v`: the values are the key projection
                // before its norm and RoPE.
                let v_raw = parts.get(2).unwrap_or(k_raw);
                let v = fast::rms_norm(&v_raw.reshape(&[n, nkv, 1, d])?, None, eps)?;
                Some((rope(k_raw, nkv, k_norm)?, v))
            }
            _ => None,
        };
        ragged::attend_rows(
            attn.cache_layer,
            attn.kind,
            &q,
            kv.as_ref().map(|(k, v)| (k, v)),
            rows,
            lens,
            (nh, nkv, d),
            1.0,
            None,
        )
    }

    /// A fresh cache for one row: one layer per layer that computes keys
    /// and values (KV-shared layers read those), sliding-window ones
    /// bounded.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_kinds(
            &self
                .cache_layers()
                .map(|a| a.kind)
                .collect::<Vec<LayerKind>>(),
        )
    }

    /// Each cache layer's key/value geometry.
    pub fn kv_shapes(&self) -> Vec<KvShape> {
        self.cache_layers().map(|a| a.kv).collect()
    }

    /// The attention of the layers that own a cache layer, in cache order.
    fn cache_layers(&self) -> impl Iterator<Item = &Gemma4Attention> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(l, layer)| layer.attn.cache_layer == *l)
            .map(|(_, layer)| &layer.attn)
    }

    /// Every parameter array.
    pub fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        if let Some(p) = &self.per_layer {
            out.extend(p.tensors());
        }
        for layer in &self.layers {
            out.extend([
                &layer.input_norm,
                &layer.post_attention_norm,
                &layer.pre_feedforward_norm,
                &layer.post_feedforward_norm,
                &layer.attn.q_norm,
                &layer.layer_scalar,
            ]);
            out.extend(&layer.attn.k_norm);
            if let Rope::Periods(p) = &layer.attn.rope {
                out.push(p);
            }
            let mut linears = layer.attn.projections.linears();
            linears.extend(layer.gate_up.linears());
            linears.extend([&layer.attn.o_proj, &layer.down_proj]);
            for lin in linears {
                out.extend(lin.tensors().into_iter().map(|(_, a)| a));
            }
            if let Some(gate) = &layer.per_layer {
                out.extend(gate.tensors());
            }
        }
        out.push(&self.norm);
        if let Some(head) = &self.lm_head {
            out.extend(head.tensors().into_iter().map(|(_, a)| a));
        }
        out
    }
}

/// `tanh(x / cap) * cap` (mlx-lm's `logit_softcap`).
fn softcap(x: &Array, cap: f32) -> Result<Array> {
    let cap = Array::from_f32(cap).as_dtype(x.dtype())?;
    Ok(ops::multiply(ops::tanh(ops::divide(x, &cap)?)?, &cap)?)
}
