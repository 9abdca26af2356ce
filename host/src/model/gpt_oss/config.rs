//! gpt-oss's fields of `config.json` and what they mean per layer.
//!
//! Follows mlx-lm 0.32.2's `gpt_oss.ModelArgs`: fields a config leaves out
//! take its defaults (gpt-oss-120b's shape), every layer is a
//! mixture-of-experts layer whose experts are `intermediate_size` wide,
//! and `layer_types` (default: sliding, full, alternating) says which
//! layers attend through the `sliding_window`. [`normalize`] writes the
//! expert fields in [`MoeConfig`](crate::model::config::MoeConfig)'s
//! spelling (`num_local_experts` as `num_experts`, `intermediate_size` also
//! as `moe_intermediate_size`), so memory estimates and admission count
//! the experts as they do Qwen3-MoE's.

use serde_json::{json, Map, Value};

use crate::cache::LayerKind;
use crate::model::config::ModelConfig;

/// Whether `model_type` names gpt-oss.
pub fn is_gpt_oss(model_type: &str) -> bool {
    model_type == "gpt_oss"
}

/// mlx-lm 0.32.2's `gpt_oss.ModelArgs` defaults, for fields a config
/// leaves out.
fn defaults() -> Value {
    json!({
        "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4,
        "vocab_size": 201088, "rms_norm_eps": 1e-5, "hidden_size": 2880,
        "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "sliding_window": 128, "rope_theta": 150000,
    })
}

/// A gpt-oss `config.json` with mlx-lm's defaults filled in and its expert
/// fields also in [`MoeConfig`](crate::model::config::MoeConfig) spelling
/// (see the module doc); other configs unchanged. Fields mlx-lm does not
/// read for gpt-oss and that would change what our shared MoE code does
/// (`mlp_only_layers`, `decoder_sparse_step`, `norm_topk_prob`) are
/// dropped: every gpt-oss layer routes the same way.
pub fn normalize(raw: Value) -> Value {
    if !is_gpt_oss(raw["model_type"].as_str().unwrap_or_default()) {
        return raw;
    }
    let mut flat: Map<String, Value> = raw.as_object().cloned().unwrap_or_default();
    if let Value::Object(d) = defaults() {
        for (k, v) in d {
            if flat.get(&k).is_none_or(Value::is_null) {
                flat.insert(k, v);
            }
        }
    }
    for key in ["mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"] {
        flat.remove(key);
    }
    let experts = flat["num_local_experts"].clone();
    let width = flat["intermediate_size"].clone();
    flat.insert("num_experts".into(), experts);
    flat.insert("moe_intermediate_size".into(), width);
    Value::Object(flat)
}

/// Each layer's attention: `layer_types` (`sliding_attention` bounded by
/// `sliding_window`, `full_attention`), or mlx-lm's default of sliding and
/// full alternating from a sliding first layer.
///
/// Errors (naming the field): a `layer_types` of the wrong length or with
/// another type, no `layer_types` for an odd number of layers (mlx-lm's
/// default list is one short there and its last layer would never run),
/// a zero window.
pub fn layer_kinds(c: &ModelConfig) -> Result<Vec<LayerKind>, String> {
    let window = c.sliding_window.unwrap_or(128);
    if window == 0 {
        return Err("`sliding_window` must be positive".into());
    }
    let l = c.num_hidden_layers;
    let Some(types) = &c.layer_types else {
        if l % 2 == 1 {
            return Err(format!(
                "`layer_types` is required for an odd number of layers ({l}): mlx-lm's default \
                 alternation covers {} of them",
                l - 1
            ));
        }
        return Ok((0..l)
            .map(|i| match i % 2 {
                0 => LayerKind::SlidingWindow { window },
                _ => LayerKind::Full,
            })
            .collect());
    };
    if types.len() != l {
        return Err(format!(
            "`layer_types` has {} entries for {l} layers",
            types.len()
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "sliding_attention" => Ok(LayerKind::SlidingWindow { window }),
            "full_attention" => Ok(LayerKind::Full),
            other => Err(format!(
                "`layer_types`: `{other}` is not `sliding_attention` or `full_attention`"
            )),
        })
        .collect()
}

/// Checks what mlxhost runs of a gpt-oss config; the message names the
/// field.
pub fn validate(c: &ModelConfig) -> Result<(), String> {
    layer_kinds(c)?;
    if c.moe.num_experts.unwrap_or(0) == 0 {
        return Err("`num_local_experts` must be positive".into());
    }
    if c.tie_word_embeddings {
        return Err(
            "`tie_word_embeddings: true`: gpt-oss has its own `lm_head` (mlx-lm reads no \
             tied head for it)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss-20b's `config.json`, the fields that shape the graph.
    fn gpt_oss_20b() -> Value {
        let types: Vec<&str> = ["sliding_attention", "full_attention"]
            .iter()
            .cycle()
            .take(24)
            .copied()
            .collect();
        json!({
            "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
            "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
            "vocab_size": 201088, "rms_norm_eps": 1e-5, "sliding_window": 128,
            "layer_types": types, "rope_theta": 150000, "swiglu_limit": 7.0,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096,
                             "rope_type": "yarn", "truncate": false},
            "tie_word_embeddings": false, "eos_token_id": 200002, "pad_token_id": 199999,
            "attention_bias": true, "max_position_embeddings": 131072
        })
    }

    fn config(raw: Value) -> ModelConfig {
        serde_json::from_value(crate::model::config::normalize_json(raw)).expect("valid config")
    }

    #[test]
    fn gpt_oss_20b_alternates_sliding_and_full_layers_of_experts() {
        let c = config(gpt_oss_20b());
        assert_eq!(c.validate(), Ok(()));
        let kinds = layer_kinds(&c).expect("kinds");
        assert_eq!(kinds.len(), 24);
        assert_eq!(kinds[0], LayerKind::SlidingWindow { window: 128 });
        assert_eq!(kinds[1], LayerKind::Full);
        assert_eq!(c.moe.num_experts, Some(32));
        assert_eq!(c.moe.moe_intermediate_size, Some(2880));
        assert!((0..24).all(|l| c.moe.is_sparse_layer(l)));
        assert_eq!(c.rope_theta, 150000.0);
    }

    #[test]
    fn absent_fields_take_mlx_lm_defaults() {
        let c = config(json!({"model_type": "gpt_oss"}));
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(
            (c.num_hidden_layers, c.hidden_size, c.vocab_size),
            (36, 2880, 201088)
        );
        assert_eq!(c.moe.num_experts, Some(128));
        assert_eq!(c.moe.num_experts_per_tok, Some(4));
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.sliding_window, Some(128));
        // No `layer_types`: sliding first, then alternating.
        let kinds = layer_kinds(&c).expect("kinds");
        assert_eq!(kinds[34], LayerKind::SlidingWindow { window: 128 });
        assert_eq!(kinds[35], LayerKind::Full);
    }

    /// gpt-oss-20b's layer types with one unknown type.
    fn chunked_types() -> Value {
        let mut types = gpt_oss_20b()["layer_types"].clone();
        types[3] = json!("chunked_attention");
        types
    }

    #[test]
    fn unsupported_variants_are_refused_by_field() {
        for (field, value, named) in [
            ("layer_types", json!(["full_attention"]), "layer_types"),
            ("layer_types", chunked_types(), "chunked_attention"),
            ("sliding_window", json!(0), "sliding_window"),
            ("num_local_experts", json!(0), "num_local_experts"),
            ("num_experts_per_tok", json!(33), "num_experts_per_tok"),
            ("tie_word_embeddings", json!(true), "tie_word_embeddings"),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0}),
                "llama3",
            ),
            (
                "rope_scaling",
                json!({"rope_type": "yarn"}),
                "rope_scaling.factor",
            ),
        ] {
            let mut raw = gpt_oss_20b();
            raw[field] = value.clone();
            let err = config(raw).validate().unwrap_err();
            assert!(err.contains(named), "{field} = {value}: {err}");
        }
        let mut odd = gpt_oss_20b();
        odd["num_hidden_layers"] = json!(3);
        odd.as_object_mut().map(|o| o.remove("layer_types"));
        let err = config(odd).validate().unwrap_err();
        assert!(err.contains("layer_types"), "{err}");
    }
}
