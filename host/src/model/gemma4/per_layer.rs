//! Gemma 4's per-layer inputs (E2B, E4B: `hidden_size_per_layer_input`):
//! besides the residual stream, every token carries one small vector per
//! layer, and each layer adds a gated projection of its vector to the
//! stream after its MLP.
//!
//! As mlx-lm's `Gemma4TextModel._get_per_layer_inputs` and
//! `_project_per_layer_inputs`: the token's row of `embed_tokens_per_layer`
//! (`[V_pl, L * P]`) times `sqrt(P)`, plus `per_layer_model_projection` of
//! the scaled embedding times `H^-0.5`, RMS-normed per layer
//! (`per_layer_projection_norm`), the sum times `2^-0.5`; then per layer
//! (`DecoderLayer`) `h += norm(proj(gelu_tanh(gate(h)) * input_l))`.

use mlx_rs::{fast, ops, Array};

use crate::model::cpu_quant::Kernel;
use crate::model::error::Result;
use crate::model::linear::{Embedding, Linear};

/// The model-level half: each token's `[L, P]` inputs.
#[derive(Debug, Clone)]
pub struct PerLayerInputs {
    /// `embed_tokens_per_layer`: `[V_pl, L * P]`.
    pub embed: Embedding,
    /// Rows of `embed` (`vocab_size_per_layer_input`).
    pub vocab: usize,
    /// Whether `vocab` is smaller than the model's vocabulary, so some ids
    /// have no row.
    pub mask_ids: bool,
    /// `per_layer_model_projection`: `[L * P, H]`.
    pub projection: Linear,
    /// `per_layer_projection_norm`: `[P]`.
    pub norm: Array,
    /// Layers (`L`).
    pub layers: usize,
    /// Width per layer (`P`).
    pub width: usize,
}

impl PerLayerInputs {
    /// `ids: [N]` and the scaled embeddings `h: [N, H]` -> `[N, L, P]` in
    /// `h`'s dtype.
    pub fn inputs(&self, ids: &Array, h: &Array, eps: f32, kernel: Kernel) -> Result<Array> {
        let dtype = h.dtype();
        let n = h.shape()[0];
        let (l, p) = (self.layers as i32, self.width as i32);
        // Ids past the per-layer vocabulary get row 0, as Hugging Face masks
        // them (mlx-lm reads out of bounds; released checkpoints have equal
        // vocabularies, so this never applies to them).
        let ids = if self.mask_ids {
            let inside = ops::lt(ids, Array::from_slice(&[self.vocab as u32], &[1]))?;
            ops::select(&inside, ids, Array::from_slice(&[0u32], &[1]))?
        } else {
            ids.clone()
        };
        let scale = |x: f32| Array::from_f32(x).as_dtype(dtype);
        let embedded = ops::multiply(
            self.embed.lookup(&ids, dtype)?,
            scale((self.width as f32).sqrt())?,
        )?
        .reshape(&[n, l, p])?;
        let projected = ops::multiply(
            self.projection.forward_with(h, kernel)?,
            scale((h.shape()[1] as f32).powf(-0.5))?,
        )?
        .reshape(&[n, l, p])?;
        let projected = fast::rms_norm(&projected, Some(&self.norm), eps)?;
        Ok(ops::multiply(
            ops::add(&projected, &embedded)?,
            scale(2f32.powf(-0.5))?,
        )?)
    }

    /// Parameter arrays.
    pub fn tensors(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        out.extend(self.projection.tensors().into_iter().map(|(_, a)| a));
        out.push(&self.norm);
        out
    }
}

/// A layer's half: the gate that adds its per-layer input to the stream.
#[derive(Debug, Clone)]
pub struct PerLayerGate {
    /// `per_layer_input_gate`: `[P, H]`.
    pub gate: Linear,
    /// `per_layer_projection`: `[H, P]`.
    pub projection: Linear,
    /// `post_per_layer_input_norm`: `[H]`.
    pub norm: Array,
}

impl PerLayerGate {
    /// What the layer adds to `h: [N, H]` given its inputs `input: [N, P]`.
    pub fn forward(&self, h: &Array, input: &Array, eps: f32, kernel: Kernel) -> Result<Array> {
        let gate = mlx_rs::nn::gelu_approximate(self.gate.forward_with(h, kernel)?)?;
        let gated = ops::multiply(&gate, input)?;
        let out = self.projection.forward_with(&gated, kernel)?;
        Ok(fast::rms_norm(&out, Some(&self.norm), eps)?)
    }

    /// Parameter arrays.
    pub fn tensors(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = Vec::new();
        for lin in [&self.gate, &self.projection] {
            out.extend(lin.tensors().into_iter().map(|(_, a)| a));
        }
        out.push(&self.norm);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(rows: usize, cols: usize, scale: f32) -> Linear {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * 0.37).sin() * scale)
            .collect();
        let w = Array::from_slice(&w, &[rows as i32, cols as i32]);
        Linear::Dense {
            weight_t: w.t().contiguous().expect("transpose"),
        }
    }

    /// `[N, L, P]` inputs as mlx-lm computes them, and ids past a smaller
    /// per-layer vocabulary reading row 0 (Hugging Face's mask).
    #[test]
    fn inputs_combine_the_embedding_and_the_projection_per_layer() -> Result<()> {
        let (layers, width, hidden) = (2usize, 4usize, 8usize);
        let inputs = PerLayerInputs {
            // `[V_pl = 3, L * P]` rows, stored as a linear `[L * P, ...]`.
            embed: Embedding(dense(3, layers * width, 1.0)),
            vocab: 3,
            mask_ids: true,
            projection: dense(layers * width, hidden, 0.5),
            norm: Array::from_slice(&[1.0f32, 0.5, 2.0, 1.5], &[4]),
            layers,
            width,
        };
        let h = Array::from_slice(&[0.3f32; 8], &[1, 8]);
        let h = ops::concatenate(&[h.clone(), h.clone(), h], 0)?;
        let ids = Array::from_slice(&[0u32, 2, 4], &[3]);
        let got = inputs.inputs(&ids, &h, 1e-6, Kernel::Float)?;
        assert_eq!(got.shape(), &[3, 2, 4]);
        // By hand: (norm(proj(h) / sqrt(H)) + embed[id] * sqrt(P)) / sqrt(2).
        let proj = ops::multiply(
            inputs.projection.forward(&h)?,
            Array::from_f32((hidden as f32).powf(-0.5)),
        )?
        .reshape(&[3, 2, 4])?;
        let proj = fast::rms_norm(&proj, Some(&inputs.norm), 1e-6)?;
        let rows = inputs
            .embed
            .lookup(&Array::from_slice(&[0u32, 2, 0], &[3]), h.dtype())?;
        let emb = ops::multiply(rows, Array::from_f32(2.0))?.reshape(&[3, 2, 4])?;
        let want = ops::multiply(ops::add(&proj, &emb)?, Array::from_f32(2f32.powf(-0.5)))?;
        let diff = ops::abs(ops::subtract(&got, &want)?)?.max(None)?;
        assert!(diff.item_exact::<f32>() < 1e-6);
        Ok(())
    }
}
