//! Qwen3.5's fields of `config.json` and what they mean per layer.
//!
//! Follows mlx-lm 0.32.2's `qwen3_5.TextModelArgs`: a `qwen3_5` config
//! keeps the decoder under `text_config` (read flat when there is none),
//! fields it leaves out take mlx-lm's defaults, RoPE comes from
//! `rope_parameters` (`rope_theta`, `partial_rotary_factor`; the
//! multimodal `mrope_*` fields do not change text positions), and layer
//! `l` is a gated-DeltaNet layer unless `(l + 1)` is a multiple of
//! `full_attention_interval`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::cache::LayerKind;
use crate::model::config::ModelConfig;

/// Whether `model_type` names Qwen3.5's dense text decoder.
pub fn is_qwen3_5(model_type: &str) -> bool {
    model_type == "qwen3_5"
}

/// Whether `model_type` names Qwen3-Next (Qwen3.5's hybrid with the
/// DeltaNet projections fused per key head and mixture-of-experts MLPs
/// with a shared expert: Qwen3-Next-80B-A3B).
pub fn is_qwen3_next(model_type: &str) -> bool {
    model_type == "qwen3_next"
}

/// Whether `model_type` is one of the gated-DeltaNet hybrids this module
/// builds ([`is_qwen3_5`], [`is_qwen3_next`]).
pub fn is_hybrid(model_type: &str) -> bool {
    is_qwen3_5(model_type) || is_qwen3_next(model_type)
}

/// The linear-attention (gated DeltaNet) fields of `config.json`, in that
/// spelling, plus the partial RoPE of the full-attention layers; all
/// absent on other models.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnConfig {
    /// Value heads of a DeltaNet layer (`H_v`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_value_heads: Option<usize>,
    /// Query/key heads of a DeltaNet layer (`H_k`, dividing `H_v`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_key_heads: Option<usize>,
    /// Query/key head width (`D_k`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_key_head_dim: Option<usize>,
    /// Value head width (`D_v`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_value_head_dim: Option<usize>,
    /// Taps of the causal conv1d (`K`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_conv_kernel_dim: Option<usize>,
    /// Every this many layers one is full attention (the last of each run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    /// Share of a full-attention head's dimensions RoPE rotates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f32>,
    /// Biases on the full-attention projections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Qwen3-Next: the width of the shared expert beside the routed ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_intermediate_size: Option<usize>,
}

/// A DeltaNet layer's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaDims {
    /// Key heads (`H_k`).
    pub key_heads: usize,
    /// Value heads (`H_v`).
    pub value_heads: usize,
    /// Key head width (`D_k`).
    pub key_dim: usize,
    /// Value head width (`D_v`).
    pub value_dim: usize,
    /// Conv taps (`K`).
    pub conv_kernel: usize,
}

impl DeltaDims {
    /// Queries and keys together: `2 · H_k · D_k`.
    pub fn qk_width(&self) -> usize {
        2 * self.key_heads * self.key_dim
    }

    /// Values: `H_v · D_v`.
    pub fn v_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// The conv's channels: queries, keys and values.
    pub fn conv_width(&self) -> usize {
        self.qk_width() + self.v_width()
    }
}

impl LinearAttnConfig {
    /// The DeltaNet layers' geometry (`normalize` filled the defaults).
    pub fn dims(&self) -> DeltaDims {
        DeltaDims {
            key_heads: self.linear_num_key_heads.unwrap_or(16),
            value_heads: self.linear_num_value_heads.unwrap_or(64),
            key_dim: self.linear_key_head_dim.unwrap_or(192),
            value_dim: self.linear_value_head_dim.unwrap_or(128),
            conv_kernel: self.linear_conv_kernel_dim.unwrap_or(4),
        }
    }

    /// Whether layer `l` is a gated-DeltaNet layer (mlx-lm: `(l + 1) %
    /// full_attention_interval != 0`).
    pub fn is_linear_layer(&self, l: usize) -> bool {
        let every = self.full_attention_interval.unwrap_or(4).max(1);
        !(l + 1).is_multiple_of(every)
    }

    /// Dimensions of a full-attention head that RoPE rotates.
    pub fn rotary_dims(&self, head_dim: usize) -> usize {
        (head_dim as f32 * self.partial_rotary_factor.unwrap_or(0.25)) as usize
    }
}

/// Each layer's cache kind: recurrent state for the DeltaNet layers, full
/// KV for the others.
pub fn layer_kinds(c: &ModelConfig) -> Vec<LayerKind> {
    (0..c.num_hidden_layers)
        .map(|l| match c.linear_attn.is_linear_layer(l) {
            true => LayerKind::Recurrent,
            false => LayerKind::Full,
        })
        .collect()
}

/// mlx-lm 0.32.2's `TextModelArgs` defaults, for fields a config leaves
/// out.
fn defaults() -> Value {
    json!({
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "linear_num_value_heads": 64, "linear_num_key_heads": 16,
        "linear_key_head_dim": 192, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "tie_word_embeddings": false, "attention_bias": false,
    })
}

/// A `qwen3_5` `config.json` flattened (its `text_config`, with the
/// root's `quantization`, `torch_dtype` and token ids where the text
/// config has none), mlx-lm's defaults filled in and `rope_parameters`
/// read into `rope_theta`, `partial_rotary_factor` and `rope_scaling` (a
/// `default` RoPE leaves none); other configs unchanged.
pub fn normalize(raw: Value) -> Value {
    let model_type = raw["model_type"].as_str().unwrap_or_default().to_string();
    if is_qwen3_next(&model_type) {
        // mlx-lm's `qwen3_next.ModelArgs`: a flat config whose RoPE fields
        // are the flat `rope_theta`, `partial_rotary_factor` and
        // `rope_scaling`; defaults only for the fields it defaults.
        let mut flat = raw.as_object().cloned().unwrap_or_default();
        for (k, v) in [
            ("full_attention_interval", json!(4)),
            ("attention_bias", json!(false)),
            ("norm_topk_prob", json!(false)),
            ("tie_word_embeddings", json!(false)),
        ] {
            if flat.get(k).is_none_or(Value::is_null) {
                flat.insert(k.into(), v);
            }
        }
        return Value::Object(flat);
    }
    if !is_qwen3_5(&model_type) {
        return raw;
    }
    let mut flat: Map<String, Value> = match raw.get("text_config").and_then(Value::as_object) {
        Some(text) => {
            let mut text = text.clone();
            for key in [
                "quantization",
                "torch_dtype",
                "eos_token_id",
                "bos_token_id",
            ] {
                if let Some(v) = raw.get(key).filter(|v| !v.is_null()) {
                    if text.get(key).is_none_or(Value::is_null) {
                        text.insert(key.into(), v.clone());
                    }
                }
            }
            text
        }
        None => raw.as_object().cloned().unwrap_or_default(),
    };
    flat.insert("model_type".into(), json!("qwen3_5"));
    if let Value::Object(d) = defaults() {
        for (k, v) in d {
            if flat.get(&k).is_none_or(Value::is_null) {
                flat.insert(k, v);
            }
        }
    }
    // mlx-lm: an absent `rope_parameters` is its default (theta 1e5, a
    // quarter of each head rotated); a null one leaves the flat fields.
    let rope = match flat.remove("rope_parameters") {
        None => Some(json!({"type": "default"})),
        Some(Value::Null) => None,
        Some(p) => Some(p),
    };
    if let Some(p) = rope {
        let theta = p.get("rope_theta").cloned().unwrap_or(json!(100000.0));
        let partial = p
            .get("partial_rotary_factor")
            .cloned()
            .unwrap_or(json!(0.25));
        flat.insert("rope_theta".into(), theta);
        flat.insert("partial_rotary_factor".into(), partial);
        let kind = p
            .get("type")
            .or_else(|| p.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let scaling = match kind.as_str() {
            "default" => Value::Null,
            _ => {
                let mut s = p.clone();
                if let Some(o) = s.as_object_mut() {
                    o.insert("type".into(), json!(kind));
                }
                s
            }
        };
        flat.insert("rope_scaling".into(), scaling);
    }
    for (k, v) in [
        ("rope_theta", json!(100000.0)),
        ("partial_rotary_factor", json!(0.25)),
    ] {
        if flat.get(k).is_none_or(Value::is_null) {
            flat.insert(k.into(), v);
        }
    }
    Value::Object(flat)
}

/// Checks what mlxhost runs of a `qwen3_5` or `qwen3_next` config; the
/// message names the field.
pub fn validate(c: &ModelConfig) -> Result<(), String> {
    let a = &c.linear_attn;
    let d = a.dims();
    for (name, v) in [
        ("linear_num_key_heads", d.key_heads),
        ("linear_num_value_heads", d.value_heads),
        ("linear_key_head_dim", d.key_dim),
        ("linear_value_head_dim", d.value_dim),
        ("linear_conv_kernel_dim", d.conv_kernel),
        (
            "full_attention_interval",
            a.full_attention_interval.unwrap_or(4),
        ),
    ] {
        if v == 0 {
            return Err(format!("`{name}` must be positive"));
        }
    }
    if !d.value_heads.is_multiple_of(d.key_heads) {
        return Err(format!(
            "`linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
            d.value_heads, d.key_heads
        ));
    }
    let factor = a.partial_rotary_factor.unwrap_or(0.25);
    let rotary = a.rotary_dims(c.head_dim());
    if !(factor > 0.0 && factor <= 1.0) || rotary == 0 || !rotary.is_multiple_of(2) {
        return Err(format!(
            "`partial_rotary_factor` ({factor}) must rotate an even, positive number of the \
             head's {} dimensions",
            c.head_dim()
        ));
    }
    if a.attention_bias == Some(true) {
        return Err(format!(
            "`attention_bias: true` is not supported yet for `{}`",
            c.model_type
        ));
    }
    let experts = c.moe.num_experts.unwrap_or(0);
    if is_qwen3_5(&c.model_type) && experts > 0 {
        return Err(
            "`num_experts`: Qwen3.5's mixture of experts is `qwen3_5_moe`, not \
                    supported yet"
                .into(),
        );
    }
    if is_qwen3_next(&c.model_type)
        && experts > 0
        && a.shared_expert_intermediate_size.unwrap_or(0) == 0
    {
        return Err(
            "`shared_expert_intermediate_size` must be positive for `qwen3_next` with experts"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: Value) -> ModelConfig {
        let raw = json!({"model_type": "qwen3_5", "text_config": text,
                         "quantization": {"group_size": 64, "bits": 4}});
        serde_json::from_value(normalize(raw)).expect("valid config")
    }

    #[test]
    fn reads_the_text_config_and_rope_parameters() {
        let c = config(json!({
            "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 96,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}
        }));
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert_eq!(c.rope_theta, 1e7);
        assert!(c.rope_scaling.is_none());
        assert!(c.quantization.is_some());
        assert_eq!(c.linear_attn.rotary_dims(32), 8);
        let kinds = layer_kinds(&c);
        assert_eq!(kinds[3], LayerKind::Full);
        assert_eq!(kinds[0], LayerKind::Recurrent);
        assert_eq!(kinds[4], LayerKind::Recurrent);
        assert_eq!(c.linear_attn.dims().key_dim, 192, "mlx-lm's default");
    }

    #[test]
    fn rejects_what_it_cannot_run_by_field() {
        let base = json!({
            "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        });
        for (field, v) in [
            ("linear_num_value_heads", json!(3)),
            ("linear_conv_kernel_dim", json!(0)),
            ("partial_rotary_factor", json!(0.0)),
            ("attention_bias", json!(true)),
        ] {
            let mut text = base.clone();
            text[field] = v;
            text["rope_parameters"] = Value::Null;
            let err = config(text).validate().unwrap_err();
            assert!(err.contains(field), "{field}: {err}");
        }
        let mut text = base;
        text["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0});
        let err = config(text).validate().unwrap_err();
        assert!(err.contains("yarn"), "{err}");
    }

    #[test]
    fn reads_a_flat_qwen3_next_config_with_experts() {
        let raw = json!({
            "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 5,
            "intermediate_size": 96, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 256, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
            "shared_expert_intermediate_size": 48, "rope_theta": 1e7,
            "partial_rotary_factor": 0.25, "rope_scaling": null, "rms_norm_eps": 1e-6,
        });
        let c: ModelConfig = serde_json::from_value(normalize(raw)).expect("valid config");
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert_eq!(c.rope_theta, 1e7, "the flat field, not qwen3_5's default");
        assert_eq!(c.moe.norm_topk_prob, Some(false), "mlx-lm's default");
        assert!(c.moe.is_sparse_layer(0) && !c.moe.is_sparse_layer(1));
        assert_eq!(layer_kinds(&c)[3], LayerKind::Full);
        let mut no_shared = c.clone();
        no_shared.linear_attn.shared_expert_intermediate_size = None;
        let err = no_shared.validate().unwrap_err();
        assert!(err.contains("shared_expert_intermediate_size"), "{err}");
    }
}
