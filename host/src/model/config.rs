//! Model hyper-parameters, in Hugging Face `config.json` spelling.
//!
//! Read from a model directory's `config.json` or derived from GGUF metadata
//! (`llama.*` keys, see the GGUF spec in ggml's `docs/gguf.md`).

use serde::{Deserialize, Serialize};

pub use super::gemma4::config::{is_gemma4, Gemma4Config};
pub use super::gpt_oss::config::is_gpt_oss;
pub use super::qwen3_5::config::{is_qwen3_5, is_qwen3_next, LinearAttnConfig};

/// Per-tensor affine quantization: `bits` per weight, one f16 scale and bias
/// per `group_size` consecutive weights along the input dimension (MLX's
/// `mx.quantize`, mode `affine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QuantSpec {
    /// Group size in weights (32, 64 or 128).
    pub group_size: i32,
    /// Bits per weight (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

/// Architectures (`model_type` / GGUF `general.architecture`) this build runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",
    "gpt_oss",
    "qwen3_5",
    "qwen3_next",
];

/// Whether `model_type` names Gemma 3's text decoder (mlx-lm's
/// `gemma3_text`; GGUF's and a checkpoint's `gemma3`).
pub fn is_gemma3(model_type: &str) -> bool {
    matches!(model_type, "gemma3_text" | "gemma3")
}

/// Hyper-parameters of a decoder (the fields mlx-lm's `models/llama.py`,
/// `qwen2.py`, `qwen3.py`, `qwen3_moe.py`, `gemma3_text.py`,
/// `gemma4_text.py` and `gpt_oss.py` `ModelArgs` read; Gemma 4's and
/// gpt-oss's `config.json` are normalized first by [`normalize_json`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture: one of [`SUPPORTED_MODEL_TYPES`].
    pub model_type: String,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width; `hidden_size / num_attention_heads` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(serialize_with = "shortest_f32")]
    pub rms_norm_eps: f32,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RoPE base frequency.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    /// Whether the output head reuses the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Context length the model was trained for, in tokens.
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    /// EOS id(s) declared in config.json (an int or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<serde_json::Value>,
    /// BOS id declared in config.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// Dtype the checkpoint's unquantized tensors are stored in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// RoPE scaling (`llama3`, `linear`, `yarn`, ...); absent/`default`
    /// everywhere and `yarn` for gpt-oss ([`super::yarn`]) are implemented,
    /// others are rejected by [`ModelConfig::validate`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// MLX quantization: defaults plus per-module overrides keyed by module
    /// path (e.g. `"model.embed_tokens": {"group_size": 32, "bits": 8}`), as
    /// mlx-lm writes and reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<serde_json::Value>,
    /// Gemma 3: queries are scaled by `query_pre_attn_scalar^-0.5` (not
    /// `head_dim^-0.5`).
    /// Written as an integer when whole: transformers 5 validates it as
    /// an `int` and refuses `256.0` (mlx-lm's `load` goes through it).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "integral_if_whole"
    )]
    pub query_pre_attn_scalar: Option<f32>,
    /// Gemma 3: keys a sliding-window layer's query sees, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Gemma 3: layer `l` is global (full attention) when
    /// `(l + 1) % sliding_window_pattern == 0`, else sliding-window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3: RoPE base of the sliding-window layers (`rope_theta` is
    /// the global layers').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f32>,
    /// Each layer's `sliding_attention` or `full_attention` (Gemma 4,
    /// gpt-oss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Mixture-of-experts MLPs (Qwen3-MoE); all absent for dense models.
    #[serde(flatten)]
    pub moe: MoeConfig,
    /// Gemma 4's own fields (per-layer inputs, KV sharing, per-type head
    /// sizes and RoPE, softcapping); all absent for other models.
    #[serde(flatten)]
    pub gemma4: Gemma4Config,
    /// Qwen3.5's gated-DeltaNet layers and partial RoPE; all absent for
    /// other models.
    #[serde(flatten)]
    pub linear_attn: LinearAttnConfig,
}

/// A `config.json` as [`ModelConfig`] reads it: Gemma 4's nested or
/// partial configs flattened with mlx-lm's defaults
/// ([`super::gemma4::config::normalize`]), gpt-oss's with mlx-lm's
/// defaults and its expert fields in [`MoeConfig`] spelling
/// ([`super::gpt_oss::config::normalize`]); others unchanged.
pub fn normalize_json(raw: serde_json::Value) -> serde_json::Value {
    let raw = super::gemma4::config::normalize(raw);
    super::qwen3_5::config::normalize(super::gpt_oss::config::normalize(raw))
}

/// The mixture-of-experts fields of `config.json` (Qwen3-MoE: mlx-lm's
/// `qwen3_moe.ModelArgs`, Hugging Face's `Qwen3MoeConfig`), in that
/// spelling. Absent on dense models.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per sparse layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    /// Experts each token is routed to (top-k of the router).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Width of each expert's SwiGLU MLP (`intermediate_size` is the dense
    /// layers').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// Layer `l` is sparse when `(l + 1) % decoder_sparse_step == 0` (and
    /// not in `mlp_only_layers`); Hugging Face's default is 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    /// Layers that keep a dense MLP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Whether the chosen experts' router probabilities are renormalised
    /// to sum to 1 (Hugging Face's default: no).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
}

impl MoeConfig {
    /// Whether layer `l` has a sparse (mixture-of-experts) MLP, by mlx-lm's
    /// rule: experts exist, `l` is not in `mlp_only_layers` and `(l + 1)`
    /// is a multiple of `decoder_sparse_step`.
    pub fn is_sparse_layer(&self, l: usize) -> bool {
        let experts = self.num_experts.unwrap_or(0);
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        let dense = self
            .mlp_only_layers
            .as_ref()
            .is_some_and(|d| d.contains(&l));
        experts > 0 && !dense && (l + 1).is_multiple_of(step)
    }

    /// Checks the fields a model with experts needs are present and
    /// consistent; the message names the field.
    fn validate(&self) -> Result<(), String> {
        let Some(experts) = self.num_experts.filter(|&e| e > 0) else {
            return Ok(());
        };
        let top_k = self
            .num_experts_per_tok
            .ok_or("`num_experts_per_tok` is required with `num_experts`")?;
        if top_k == 0 || top_k > experts {
            return Err(format!(
                "`num_experts_per_tok` ({top_k}) must be between 1 and `num_experts` ({experts})"
            ));
        }
        match self.moe_intermediate_size {
            None => return Err("`moe_intermediate_size` is required with `num_experts`".into()),
            Some(0) => return Err("`moe_intermediate_size` must be positive".into()),
            Some(_) => {}
        }
        if self.decoder_sparse_step == Some(0) {
            return Err("`decoder_sparse_step` must be positive".into());
        }
        Ok(())
    }
}

/// Writes an f32 as the shortest decimal that round-trips (`1e-5`, not
/// `9.999999747378752e-6`), as Python would.
fn shortest_f32<S: serde::Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    let text = format!("{v}");
    s.serialize_f64(text.parse::<f64>().unwrap_or(*v as f64))
}

/// Writes a whole number as a JSON integer (`256`), else as a float.
fn integral_if_whole<S: serde::Serializer>(v: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => s.serialize_i64(*x as i64),
        Some(x) => s.serialize_f64(*x as f64),
        None => s.serialize_none(),
    }
}

fn default_rope_theta() -> f32 {
    10_000.0
}

fn default_context() -> usize {
    2048
}

impl ModelConfig {
    /// Per-head width in elements.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// EOS ids declared by `eos_token_id` (int or list); empty when absent.
    pub fn declared_eos_ids(&self) -> Vec<u32> {
        eos_ids_from_json(self.eos_token_id.as_ref())
    }

    /// Checks the shape parameters are consistent; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !SUPPORTED_MODEL_TYPES.contains(&self.model_type.as_str()) {
            return Err(format!(
                "unsupported model_type `{}` (supported: {})",
                self.model_type,
                SUPPORTED_MODEL_TYPES.join(", ")
            ));
        }
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(format!("`{name}` must be positive"));
            }
        }
        if let Some(scaling) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("?");
            match kind {
                "default" => {}
                "yarn" if is_gpt_oss(&self.model_type) => {
                    super::yarn::YarnParams::from_scaling(scaling)?;
                }
                _ => {
                    return Err(format!(
                        "`rope_scaling` of type `{kind}` is not supported yet"
                    ))
                }
            }
        }
        // Before the expert fields: Gemma 4's MoE names its top-k
        // `top_k_experts`, so `MoeConfig` would blame the wrong field.
        if is_gemma4(&self.model_type) {
            self.gemma4.validate(self)?;
        }
        if is_gpt_oss(&self.model_type) {
            super::gpt_oss::config::validate(self)?;
        }
        if super::qwen3_5::config::is_hybrid(&self.model_type) {
            super::qwen3_5::config::validate(self)?;
        }
        if self.model_type == "qwen3_moe" && self.moe.num_experts.unwrap_or(0) == 0 {
            return Err("`num_experts` must be positive for `qwen3_moe`".into());
        }
        self.moe.validate()?;
        if is_gemma3(&self.model_type) && self.sliding_window == Some(0) {
            return Err("`sliding_window` must be positive".into());
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err("`num_attention_heads` must be a multiple of `num_key_value_heads`".into());
        }
        Ok(())
    }
}

/// Reads an `eos_token_id` field that may be an int, a list of ints or null.
pub fn eos_ids_from_json(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_eos_as_int_or_list() {
        assert_eq!(eos_ids_from_json(Some(&serde_json::json!(2))), vec![2]);
        assert_eq!(
            eos_ids_from_json(Some(&serde_json::json!([2, 0]))),
            vec![2, 0]
        );
        assert!(eos_ids_from_json(None).is_empty());
    }

    #[test]
    fn gemma_query_scalar_is_written_as_an_integer() {
        let c: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 8, "num_hidden_layers": 1,
            "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6, "vocab_size": 10, "query_pre_attn_scalar": 256
        }))
        .expect("valid config");
        let v = serde_json::to_value(&c).expect("serializes");
        assert_eq!(v["query_pre_attn_scalar"], serde_json::json!(256));
    }

    #[test]
    fn rejects_other_architectures_by_name() {
        let mut c: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
            "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5, "vocab_size": 10
        }))
        .expect("valid config");
        assert!(c.validate().is_ok());
        assert_eq!(c.head_dim(), 4);
        c.model_type = "mamba".into();
        assert!(c.validate().unwrap_err().contains("mamba"));
    }

    fn qwen3_moe(extra: serde_json::Value) -> ModelConfig {
        let mut v = serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 4,
            "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6, "vocab_size": 10, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": true
        });
        if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            v.extend(extra.clone());
        }
        serde_json::from_value(v).expect("valid config")
    }

    #[test]
    fn sparse_layers_follow_mlx_lm_rule() {
        let c = qwen3_moe(serde_json::json!({}));
        assert!(c.validate().is_ok());
        assert!((0..4).all(|l| c.moe.is_sparse_layer(l)));
        let c = qwen3_moe(serde_json::json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}));
        let sparse: Vec<bool> = (0..4).map(|l| c.moe.is_sparse_layer(l)).collect();
        assert_eq!(sparse, [false, true, false, false]);
        // Written back in config.json spelling, dense models without the fields.
        let v = serde_json::to_value(&c).expect("serializes");
        assert_eq!(v["mlp_only_layers"], serde_json::json!([3]));
        let dense = qwen3_moe(serde_json::json!({})).moe;
        assert_eq!(dense.num_experts, Some(4));
        let mut llama = c.clone();
        llama.moe = MoeConfig::default();
        llama.model_type = "llama".into();
        let v = serde_json::to_value(&llama).expect("serializes");
        assert!(v.get("num_experts").is_none());
        assert!(!llama.moe.is_sparse_layer(0));
    }

    #[test]
    fn rejects_inconsistent_expert_fields_by_name() {
        for (extra, field) in [
            (
                serde_json::json!({"num_experts_per_tok": 5}),
                "num_experts_per_tok",
            ),
            (
                serde_json::json!({"num_experts_per_tok": 0}),
                "num_experts_per_tok",
            ),
            (
                serde_json::json!({"moe_intermediate_size": 0}),
                "moe_intermediate_size",
            ),
            (
                serde_json::json!({"decoder_sparse_step": 0}),
                "decoder_sparse_step",
            ),
            (serde_json::json!({"num_experts": 0}), "num_experts"),
        ] {
            let err = qwen3_moe(extra.clone()).validate().unwrap_err();
            assert!(err.contains(field), "{extra}: {err}");
        }
        let mut c = qwen3_moe(serde_json::json!({}));
        c.moe.moe_intermediate_size = None;
        assert!(c.validate().unwrap_err().contains("moe_intermediate_size"));
    }
}
