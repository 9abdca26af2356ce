//! Tensor maps in Hugging Face / MLX naming, from GGUF or safetensors, and
//! assembly of a model ([`Llama`], including Qwen3-MoE's sparse layers,
//! [`Gemma3`], [`super::gemma4::Gemma4`] and [`super::gpt_oss::GptOss`])
//! from them.
//!
//! GGUF tensor names (ggml's `gguf-py/gguf/tensor_mapping.py`) are renamed to
//! mlx-lm's (`model.layers.N.self_attn.q_proj`, ...). llama.cpp's converter
//! permutes the rows of `q_proj`/`k_proj` per head for interleaved RoPE
//! (`[2, D/2] -> [D/2, 2]`); we undo that so one half-split RoPE serves both
//! formats and `convert` writes what mlx-lm expects.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::{Array, Dtype};

use super::config::{ModelConfig, QuantSpec};
use super::error::{ModelError, Result};
use super::gemma3::{Gemma3, Gemma3Layer};
use super::linear::{Embedding, Linear};
use super::llama::{DenseMlp, Layer, Llama, Mlp, Projections};
use super::moe::{GateActivation, Routing, SparseMoe, SwitchLinear};
use crate::cache::slab::DecodeSlab;
use crate::cache::LayerKind;

/// Tensors by MLX name (`model.layers.0.self_attn.q_proj.weight`, ...).
pub type TensorMap = HashMap<String, Array>;

/// How weights are computed with (see `docs/configuration.md`, `--dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDtype {
    /// The checkpoint's own path: quantized linears stay quantized,
    /// activations in the checkpoint's float dtype (float16 for GGUF Q4/Q8),
    /// which is mlx-lm's numerics.
    Native,
    /// Every weight dequantized to float32 at load; GEMV/GEMM go to BLAS.
    Float32,
    /// Quantized linears stay quantized in memory (4/8-bit, MLX affine),
    /// activations float32; on the CPU backend their products run on our
    /// kernel (`cpu_quant`). Linears the kernel cannot compute, and dense
    /// checkpoints, are dequantized to float32 as in [`ComputeDtype::Float32`].
    Quantized,
}

/// Renames one GGUF tensor name of architecture `arch` to MLX naming;
/// `None` for tensors we ignore (e.g. `rope_freqs`). Gemma 3's four norms
/// per layer follow llama.cpp's `LLM_ARCH_GEMMA3` names (`ffn_norm` is the
/// norm before the MLP, `post_ffw_norm` the one after it).
pub fn gguf_to_mlx_name(arch: &str, name: &str) -> Option<String> {
    let (base, suffix) = name.rsplit_once('.')?;
    let mapped = match base {
        "token_embd" => "model.embed_tokens".to_string(),
        "output_norm" => "model.norm".to_string(),
        "output" => "lm_head".to_string(),
        _ => {
            let rest = base.strip_prefix("blk.")?;
            let (layer, module) = rest.split_once('.')?;
            let module = match module {
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                // Mixture-of-experts layers (llama.cpp's `qwen3moe`): the
                // router and the stacked experts, as mlx-lm names them.
                "ffn_gate_inp" => "mlp.gate",
                "ffn_gate_exps" => "mlp.switch_mlp.gate_proj",
                "ffn_up_exps" => "mlp.switch_mlp.up_proj",
                "ffn_down_exps" => "mlp.switch_mlp.down_proj",
                "attn_norm" => "input_layernorm",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_norm" if super::config::is_gemma3(arch) => "pre_feedforward_layernorm",
                "post_attention_norm" => "post_attention_layernorm",
                "post_ffw_norm" => "post_feedforward_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                _ => return None,
            };
            format!("model.layers.{layer}.{module}")
        }
    };
    Some(format!("{mapped}.{suffix}"))
}

/// Undoes llama.cpp's per-head row permutation of q/k projections:
/// rows `[n_heads, D/2, 2]` -> `[n_heads, 2, D/2]` (applies equally to packed
/// weights, scales and biases, whose rows are output features).
pub fn unpermute_rope_rows(a: &Array, n_heads: usize) -> Result<Array> {
    let shape = a.shape();
    let (rows, cols) = (shape[0], shape[1]);
    let n = n_heads as i32;
    let half = rows / n / 2;
    Ok(a.reshape(&[n, half, 2, cols])?
        .swap_axes(1, 2)?
        .reshape(&[rows, cols])?)
}

/// Loads every `*.safetensors` file in `dir` into one map.
pub fn load_safetensors_dir(dir: &Path) -> Result<TensorMap> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|source| ModelError::Io {
            path: dir.into(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::MissingFile(dir.join("model.safetensors")));
    }
    let mut map = TensorMap::new();
    for file in files {
        // Validate the header ourselves first: MLX's reader reports truncation
        // without naming the file.
        check_safetensors(&file)?;
        let tensors = Array::load_safetensors(&file).map_err(|e| ModelError::invalid(&file, e))?;
        map.extend(tensors);
    }
    Ok(map)
}

/// Checks a safetensors file's header parses and its data section is complete.
fn check_safetensors(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.into(),
        source,
    })?;
    // SAFETY: read-only map of a file we do not modify; a concurrent writer
    // could only make the checks below fail.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io {
        path: path.into(),
        source,
    })?;
    safetensors::SafeTensors::deserialize(&mmap).map_err(|e| ModelError::invalid(path, e))?;
    Ok(())
}

/// Reads linears and vectors out of a [`TensorMap`] into the layout a
/// compute path wants (shared by every architecture's builder).
pub(super) struct Loader<'a> {
    tensors: &'a TensorMap,
    compute: ComputeDtype,
    /// Activation dtype.
    pub(super) act: Dtype,
    /// Input dtype of MLX's quantized matmul.
    qdtype: Dtype,
}

impl<'a> Loader<'a> {
    pub(super) fn new(config: &ModelConfig, tensors: &'a TensorMap, compute: ComputeDtype) -> Self {
        let act = match compute {
            ComputeDtype::Float32 | ComputeDtype::Quantized => Dtype::Float32,
            ComputeDtype::Native => native_activation_dtype(config, tensors),
        };
        // See `Linear::forward`: MLX's CPU quantized matmul wants float32 inputs.
        let qdtype = if crate::runtime::gpu_available() {
            act
        } else {
            Dtype::Float32
        };
        Loader {
            tensors,
            compute,
            act,
            qdtype,
        }
    }

    /// `{prefix}.weight` (+ scales/biases) as a `[out_dim, in_dim]` linear
    /// in the compute path's layout.
    pub(super) fn linear(&self, prefix: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
        let lin = load_linear(self.tensors, prefix, in_dim, out_dim)?;
        match self.compute {
            ComputeDtype::Float32 => lin.to_dense(Dtype::Float32),
            ComputeDtype::Native => lin.cast(self.act, self.qdtype),
            ComputeDtype::Quantized => match lin.quant_spec() {
                Some(spec) if super::cpu_quant::supports(spec) => {
                    lin.cast(Dtype::Float32, Dtype::Float32)
                }
                _ => lin.to_dense(Dtype::Float32),
            },
        }
    }

    /// A `[len]` vector in the activation dtype.
    pub(super) fn vector(&self, name: &str, len: usize) -> Result<Array> {
        let a = get(self.tensors, name)?;
        if a.shape() != [len as i32] {
            return Err(ModelError::Tensor {
                name: name.into(),
                reason: format!("expected shape [{len}], found {:?}", a.shape()),
            });
        }
        Ok(a.as_dtype(self.act)?)
    }

    /// A Gemma norm's multiplier `1 + w` (`[len]`), computed in float32
    /// then cast to the activation dtype.
    fn gemma_norm(&self, name: &str, len: usize) -> Result<Array> {
        let w = self.vector(name, len)?.as_dtype(Dtype::Float32)?;
        Ok(mlx_rs::ops::add(&w, Array::from_f32(1.0))?.as_dtype(self.act)?)
    }

    /// `lin` in the layout the compute path multiplies fastest: on the
    /// quantized CPU path with AVX-512 VNNI, quantized weights repacked for
    /// the integer kernel ([`Linear::packed`]); else unchanged.
    pub(super) fn pack(&self, lin: Linear) -> Result<Linear> {
        if self.compute == ComputeDtype::Quantized && super::cpu_quant::packing_enabled() {
            lin.packed()
        } else {
            Ok(lin)
        }
    }

    /// [`Loader::pack`] for each product of `p` (after fusing: packed
    /// weights are not fused).
    pub(super) fn pack_projections(&self, p: Projections) -> Result<Projections> {
        Ok(match p {
            Projections::Fused(lin, widths) => Projections::Fused(self.pack(lin)?, widths),
            Projections::Separate(parts) => Projections::Separate(
                parts
                    .into_iter()
                    .map(|l| self.pack(l))
                    .collect::<Result<_>>()?,
            ),
        })
    }

    /// Layer `l`'s MLP at `mlp` (`model.layers.{l}.mlp`): on the sparse
    /// layers of a mixture-of-experts model ([`super::config::MoeConfig`])
    /// its router and experts, else the dense SwiGLU.
    pub(super) fn mlp(&self, c: &ModelConfig, l: usize, mlp: &str) -> Result<Mlp> {
        let h = c.hidden_size;
        if !c.moe.is_sparse_layer(l) {
            let i = c.intermediate_size;
            let gate = self.linear(&format!("{mlp}.gate_proj"), h, i)?;
            let up = self.linear(&format!("{mlp}.up_proj"), h, i)?;
            return Ok(Mlp::Dense(DenseMlp {
                gate_up: self.pack_projections(Projections::new(vec![gate, up])?)?,
                down_proj: self.pack(self.linear(&format!("{mlp}.down_proj"), i, h)?)?,
            }));
        }
        // `validate` made these present on a model with experts.
        let experts = c.moe.num_experts.unwrap_or(0);
        let i = c.moe.moe_intermediate_size.unwrap_or(0);
        let switch = |proj: &str, in_dim: usize, out_dim: usize| {
            self.switch_linear(mlp, proj, experts, in_dim, out_dim)
        };
        Ok(Mlp::Sparse(SparseMoe {
            // Never packed: the top-k follows the router's logits to their
            // last bits, so they keep the exact float32 kernel (the packed
            // one rounds activations to 24 bits); the product is tiny.
            router: self.linear(&format!("{mlp}.gate"), h, experts)?,
            gate_proj: switch("gate_proj", h, i)?,
            up_proj: switch("up_proj", h, i)?,
            down_proj: switch("down_proj", i, h)?,
            router_bias: None,
            top_k: c.moe.num_experts_per_tok.unwrap_or(1) as i32,
            routing: Routing::SoftmaxTopK {
                norm_topk_prob: c.moe.norm_topk_prob.unwrap_or(false),
            },
            activation: GateActivation::Silu,
        }))
    }

    /// Projection `proj` of every expert of the MLP at `mlp`, in the compute
    /// path's layout (see [`Loader::experts`]).
    fn switch_linear(
        &self,
        mlp: &str,
        proj: &str,
        experts: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<SwitchLinear> {
        self.experts(SwitchLinear::load(
            self.tensors,
            mlp,
            proj,
            experts,
            in_dim,
            out_dim,
        )?)
    }

    /// Stacked experts in the compute path's layout. Quantized experts
    /// (affine or `mxfp4`) stay quantized on the quantized path too (MLX's
    /// `gather_qmm` reads only the chosen experts; our CPU kernels compute
    /// plain linears only).
    pub(super) fn experts(&self, sw: SwitchLinear) -> Result<SwitchLinear> {
        match self.compute {
            ComputeDtype::Float32 => sw.to_dense(Dtype::Float32),
            ComputeDtype::Native => sw.cast(self.act, self.qdtype),
            ComputeDtype::Quantized if sw.is_quantized() => sw.cast(Dtype::Float32, Dtype::Float32),
            ComputeDtype::Quantized => sw.to_dense(Dtype::Float32),
        }
    }

    pub(super) fn layer_kernel(&self) -> super::cpu_quant::Kernel {
        match self.compute {
            ComputeDtype::Quantized => super::cpu_quant::Kernel::for_layers(),
            _ => super::cpu_quant::Kernel::Float,
        }
    }
}

/// Builds the model `config.model_type` names from MLX-named tensors.
///
/// Errors name the missing or malformed tensor.
pub fn build_model(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Box<dyn super::CausalLm>> {
    if super::config::is_gemma3(&config.model_type) {
        Ok(Box::new(build_gemma3(config, tensors, compute)?))
    } else if super::config::is_gemma4(&config.model_type) {
        Ok(Box::new(super::gemma4::build_gemma4(
            config, tensors, compute,
        )?))
    } else if super::config::is_gpt_oss(&config.model_type) {
        Ok(Box::new(super::gpt_oss::build_gpt_oss(
            config, tensors, compute,
        )?))
    } else if super::qwen3_5::config::is_hybrid(&config.model_type) {
        Ok(Box::new(super::qwen3_5::build_qwen3_5(
            config, tensors, compute,
        )?))
    } else {
        Ok(Box::new(build_llama(config, tensors, compute)?))
    }
}

/// Builds a [`Gemma3`] from MLX-named tensors (norm weights as Hugging
/// Face stores them, `w` of `1 + w`).
///
/// Errors name the missing or malformed tensor.
pub fn build_gemma3(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Gemma3> {
    let c = config;
    let ld = Loader::new(c, tensors, compute);
    let hd = c.head_dim();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let q = ld.linear(&format!("{p}.self_attn.q_proj"), h, q_out)?;
        let k = ld.linear(&format!("{p}.self_attn.k_proj"), h, kv_out)?;
        let v = ld.linear(&format!("{p}.self_attn.v_proj"), h, kv_out)?;
        let gate = ld.linear(&format!("{p}.mlp.gate_proj"), h, i)?;
        let up = ld.linear(&format!("{p}.mlp.up_proj"), h, i)?;
        let kind = Gemma3::layer_kind(c, l);
        layers.push(Gemma3Layer {
            input_norm: ld.gemma_norm(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_norm: ld
                .gemma_norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            pre_feedforward_norm: ld
                .gemma_norm(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
            post_feedforward_norm: ld
                .gemma_norm(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
            qkv: Projections::new(vec![q, k, v])?,
            q_norm: ld.gemma_norm(&format!("{p}.self_attn.q_norm.weight"), hd)?,
            k_norm: ld.gemma_norm(&format!("{p}.self_attn.k_norm.weight"), hd)?,
            o_proj: ld.linear(&format!("{p}.self_attn.o_proj"), q_out, h)?,
            gate_up: Projections::new(vec![gate, up])?,
            down_proj: ld.linear(&format!("{p}.mlp.down_proj"), i, h)?,
            kind,
            rope_base: match kind {
                LayerKind::SlidingWindow { .. } => c.rope_local_base_freq.unwrap_or(10_000.0),
                LayerKind::Full | LayerKind::Recurrent => c.rope_theta,
            },
        });
    }
    Ok(Gemma3 {
        config: c.clone(),
        embed: Embedding(ld.linear("model.embed_tokens", h, c.vocab_size)?),
        layers,
        norm: ld.gemma_norm("model.norm.weight", h)?,
        dtype: ld.act,
        layer_kernel: ld.layer_kernel(),
    })
}

/// Builds a [`Llama`] from MLX-named tensors.
///
/// Quantization of each linear is inferred from shapes as mlx-lm 0.32 does:
/// `group_size = in / scales.cols`, `bits = weight.cols * 32 / in`.
/// Errors name the missing or malformed tensor.
pub fn build_llama(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Llama> {
    let c = config;
    let ld = Loader::new(c, tensors, compute);
    let act = ld.act;
    let hd = c.head_dim();
    let linear = |prefix: &str, in_dim: usize, out_dim: usize| ld.linear(prefix, in_dim, out_dim);
    let vector = |name: &str| ld.vector(name, c.hidden_size);
    let h = c.hidden_size;
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let q = linear(&format!("{p}.self_attn.q_proj"), h, q_out)?;
        let k = linear(&format!("{p}.self_attn.k_proj"), h, kv_out)?;
        let v = linear(&format!("{p}.self_attn.v_proj"), h, kv_out)?;
        let qkv_bias = qkv_bias(tensors, &p, [q_out, kv_out, kv_out], act)?;
        let head_norm = |which: &str| -> Result<Option<Array>> {
            let name = format!("{p}.self_attn.{which}.weight");
            if !tensors.contains_key(&name) {
                return Ok(None);
            }
            ld.vector(&name, hd).map(Some)
        };
        layers.push(Layer {
            input_norm: vector(&format!("{p}.input_layernorm.weight"))?,
            post_attention_norm: vector(&format!("{p}.post_attention_layernorm.weight"))?,
            qkv: ld.pack_projections(Projections::new(vec![q, k, v])?)?,
            qkv_bias,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            o_proj: ld.pack(linear(&format!("{p}.self_attn.o_proj"), q_out, h)?)?,
            mlp: ld.mlp(c, l, &format!("{p}.mlp"))?,
        });
    }
    // Packed (on the quantized CPU path): the tied output head streams the
    // packed layout, and lookups gather rows from it.
    let embed = Embedding(ld.pack(linear("model.embed_tokens", h, c.vocab_size)?)?);
    let lm_head = if c.tie_word_embeddings || !tensors.contains_key("lm_head.weight") {
        None
    } else {
        Some(ld.pack(linear("lm_head", h, c.vocab_size)?)?)
    };
    Ok(Llama {
        config: c.clone(),
        embed,
        layers,
        norm: vector("model.norm.weight")?,
        lm_head,
        dtype: act,
        fused_decode: None,
        layer_kernel: ld.layer_kernel(),
        decode_slab: DecodeSlab::default(),
        tp: None,
    }
    .with_fused_decode())
}

/// The q/k/v biases of layer `prefix` concatenated (`[q + 2 kv]`, in
/// `dtype`), when the checkpoint has them (Qwen2: all three); `None` when
/// it has none. Errors: only some of the three, or a wrong length.
fn qkv_bias(
    tensors: &TensorMap,
    prefix: &str,
    widths: [usize; 3],
    dtype: Dtype,
) -> Result<Option<Array>> {
    let names = ["q_proj", "k_proj", "v_proj"].map(|m| format!("{prefix}.self_attn.{m}.bias"));
    let found: Vec<Option<&Array>> = names.iter().map(|n| tensors.get(n)).collect();
    if found.iter().all(Option::is_none) {
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(3);
    for ((name, a), w) in names.iter().zip(found).zip(widths) {
        let a = a.ok_or_else(|| ModelError::Tensor {
            name: name.clone(),
            reason: "missing while the other attention biases are present".into(),
        })?;
        if a.shape() != [w as i32] {
            return Err(ModelError::Tensor {
                name: name.clone(),
                reason: format!("expected shape [{w}], found {:?}", a.shape()),
            });
        }
        parts.push(a.as_dtype(dtype)?);
    }
    Ok(Some(mlx_rs::ops::concatenate(&parts, 0)?))
}

/// Activation dtype of the native path: the float dtype the checkpoint's
/// quantization scales (or, unquantized, its embedding) are stored in.
fn native_activation_dtype(c: &ModelConfig, tensors: &TensorMap) -> Dtype {
    let probe = tensors
        .get("model.embed_tokens.scales")
        .or_else(|| tensors.get("model.embed_tokens.weight"));
    match probe.map(|a| a.dtype()) {
        Some(d @ (Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)) => d,
        _ => match c.torch_dtype.as_deref() {
            Some("bfloat16") => Dtype::Bfloat16,
            Some("float32") => Dtype::Float32,
            _ => Dtype::Float16,
        },
    }
}

fn get<'a>(tensors: &'a TensorMap, name: &str) -> Result<&'a Array> {
    tensors.get(name).ok_or_else(|| ModelError::Tensor {
        name: name.into(),
        reason: "missing from the checkpoint".into(),
    })
}

/// Reads `{prefix}.weight` (+ `.scales`, `.biases` when quantized) and checks
/// it is `[out_dim, in_dim]` once unpacked.
fn load_linear(tensors: &TensorMap, prefix: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
    let wname = format!("{prefix}.weight");
    let weight = get(tensors, &wname)?.clone();
    let shape = weight.shape().to_vec();
    let bad = |reason: String| ModelError::Tensor {
        name: wname.clone(),
        reason,
    };
    if shape.len() != 2 || shape[0] as usize != out_dim {
        return Err(bad(format!(
            "expected {out_dim} rows, found shape {shape:?}"
        )));
    }
    let Some(scales) = tensors.get(&format!("{prefix}.scales")) else {
        if shape[1] as usize != in_dim {
            return Err(bad(format!(
                "expected shape [{out_dim}, {in_dim}], found {shape:?}"
            )));
        }
        return Ok(Linear::Dense {
            weight_t: weight.t().contiguous()?,
        });
    };
    let biases_name = format!("{prefix}.biases");
    let groups = scales.shape().get(1).copied().unwrap_or(0) as usize;
    let packed = shape[1] as usize;
    if super::mxfp4::is_mxfp4(scales, tensors.get(&biases_name)) {
        // MLX's `mxfp4` (gpt-oss's format, and what `mlx_lm.convert
        // --q-mode mxfp4` writes for every linear): our linear kernels are
        // affine-only, so a plain linear is dequantized here (exact in
        // float32); stacked experts keep it (`moe::ExpertWeights::Mxfp4`).
        let (group, bits) = (
            super::mxfp4::GROUP_SIZE as usize,
            super::mxfp4::BITS as usize,
        );
        if groups * group != in_dim || packed * 32 / bits != in_dim {
            return Err(bad(format!(
                "uint8 scales without biases are mxfp4 (4 bits, groups of 32), but packed \
                 width {packed} and {groups} groups do not fit input width {in_dim}"
            )));
        }
        let dense = super::mxfp4::dequantize(&weight, scales, Dtype::Float32)?;
        return Ok(Linear::Dense {
            weight_t: dense.t().contiguous()?,
        });
    }
    let biases = get(tensors, &biases_name)?.clone();
    for (name, a) in [(format!("{prefix}.scales"), scales), (biases_name, &biases)] {
        if a.shape() != [out_dim as i32, groups as i32] {
            return Err(ModelError::Tensor {
                name,
                reason: format!(
                    "expected shape [{out_dim}, {groups}] (one row per output of {wname}), \
                     found {:?}",
                    a.shape()
                ),
            });
        }
    }
    if groups == 0 || !in_dim.is_multiple_of(groups) || !(packed * 32).is_multiple_of(in_dim) {
        return Err(bad(format!(
            "cannot infer quantization: packed width {packed}, {groups} groups, input width {in_dim}"
        )));
    }
    let spec = QuantSpec {
        group_size: (in_dim / groups) as i32,
        bits: (packed * 32 / in_dim) as i32,
    };
    Ok(Linear::Quantized {
        weight,
        scales: scales.clone(),
        biases,
        spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renames_gguf_tensors_to_mlx() {
        assert_eq!(
            gguf_to_mlx_name("llama", "blk.3.attn_q.scales").as_deref(),
            Some("model.layers.3.self_attn.q_proj.scales")
        );
        assert_eq!(
            gguf_to_mlx_name("llama", "token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(
            gguf_to_mlx_name("llama", "blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            gguf_to_mlx_name("gemma3", "blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            gguf_to_mlx_name("gemma3", "blk.0.post_ffw_norm.weight").as_deref(),
            Some("model.layers.0.post_feedforward_layernorm.weight")
        );
        assert_eq!(gguf_to_mlx_name("llama", "rope_freqs.weight"), None);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() -> Result<()> {
        // llama.cpp: rows [n, 2, D/2] -> [n, D/2, 2]. Build that from 0..rows.
        let (n, d, cols) = (2, 4, 1);
        let hf: Vec<f32> = (0..(n * d) as i32).map(|x| x as f32).collect();
        let hf = Array::from_slice(&hf, &[(n * d) as i32, cols]);
        let permuted = hf
            .reshape(&[n as i32, 2, (d / 2) as i32, cols])?
            .swap_axes(1, 2)?
            .reshape(&[(n * d) as i32, cols])?;
        let back = unpermute_rope_rows(&permuted, n)?;
        assert_eq!(back.as_slice::<f32>(), hf.as_slice::<f32>());
        Ok(())
    }
}
