//! Gemma 4's fields of `config.json` and what they mean per layer.
//!
//! Follows mlx-lm 0.32.2's `gemma4_text.ModelArgs` and `gemma4.ModelArgs`:
//! a `gemma4` config (Hugging Face's `Gemma4ForConditionalGeneration`) holds
//! the decoder's fields under `text_config`, its vocabulary size at the top
//! (mlx-lm overwrites the text config's with it, default 262144); a
//! `gemma4_text` config holds them at the top. [`normalize`] turns either
//! into one flat object with mlx-lm's defaults filled in where a field is
//! absent (a field present as `null` stays off, as in mlx-lm: no softcap,
//! no per-layer inputs, `head_dim` on full layers).

use mlx_rs::{ops, Array};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::cache::{KvShape, LayerKind};
use crate::model::config::ModelConfig;
use crate::model::ragged::Rope;

/// The Gemma 4 fields of `config.json`, in that spelling (all `None` on
/// other architectures). After [`normalize`], `None` means the field was
/// `null`: the feature is off.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Config {
    /// Head dimension of the full-attention layers (`head_dim` is the
    /// sliding layers').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_head_dim: Option<usize>,
    /// KV heads of the full-attention layers when `attention_k_eq_v`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_global_key_value_heads: Option<usize>,
    /// Full-attention layers have no `v_proj`: values are the key
    /// projection's output (26B, 31B).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_k_eq_v: Option<bool>,
    /// The last this many layers compute no keys and values: each reuses
    /// those of the last earlier layer of its type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_kv_shared_layers: Option<usize>,
    /// Width of each layer's per-layer input (E2B, E4B); 0 or `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size_per_layer_input: Option<usize>,
    /// Rows of `embed_tokens_per_layer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size_per_layer_input: Option<usize>,
    /// RoPE per layer type: `{"full_attention": {"rope_type":
    /// "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    /// "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    /// Interleaved RoPE (mlx-lm's `rope_traditional`); only `false` runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_traditional: Option<bool>,
    /// Logits become `tanh(x / cap) * cap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f32>,
    /// The KV-shared layers' MLPs are twice `intermediate_size` wide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_double_wide_mlp: Option<bool>,
    /// Mixture-of-experts block beside the MLP (26B-A4B); refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_moe_block: Option<bool>,
}

/// Whether `model_type` names Gemma 4 (mlx-lm's `gemma4_text`, or the
/// `gemma4` checkpoint wrapping it).
pub fn is_gemma4(model_type: &str) -> bool {
    matches!(model_type, "gemma4_text" | "gemma4")
}

/// mlx-lm 0.32.2's `gemma4_text.ModelArgs` defaults, for fields a config
/// leaves out (`rope_parameters` and `layer_types` are derived instead).
fn text_defaults() -> Value {
    json!({
        "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
        "num_attention_heads": 8, "head_dim": 256, "global_head_dim": 512,
        "rms_norm_eps": 1e-6, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
        "num_key_value_heads": 1, "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256, "rope_traditional": false,
        "sliding_window": 512, "sliding_window_pattern": 5,
        "max_position_embeddings": 131072, "attention_k_eq_v": false,
        "final_logit_softcapping": 30.0, "use_double_wide_mlp": true,
        "enable_moe_block": false, "tie_word_embeddings": true,
    })
}

/// A Gemma 4 `config.json` as one flat object in `gemma4_text` spelling
/// with mlx-lm's defaults filled in (see the module doc); other configs
/// unchanged. A `gemma4` config keeps its `model_type`, and its top-level
/// `eos_token_id`, `bos_token_id`, `quantization` and `torch_dtype` win
/// over the text config's (they describe the checkpoint).
pub fn normalize(raw: Value) -> Value {
    let model_type = raw["model_type"].as_str().unwrap_or_default().to_string();
    if !is_gemma4(&model_type) {
        return raw;
    }
    let mut flat: Map<String, Value> = if model_type == "gemma4" {
        let mut text = raw["text_config"].as_object().cloned().unwrap_or_default();
        let vocab = raw.get("vocab_size").cloned().unwrap_or(json!(262144));
        text.insert("vocab_size".into(), vocab);
        for key in [
            "eos_token_id",
            "bos_token_id",
            "quantization",
            "torch_dtype",
        ] {
            if let Some(v) = raw.get(key).filter(|v| !v.is_null()) {
                text.insert(key.into(), v.clone());
            }
        }
        text
    } else {
        raw.as_object().cloned().unwrap_or_default()
    };
    flat.insert("model_type".into(), json!(model_type));
    if let Value::Object(defaults) = text_defaults() {
        for (k, v) in defaults {
            flat.entry(k).or_insert(v);
        }
    }
    Value::Object(flat)
}

/// One layer's attention geometry and RoPE.
#[derive(Debug, Clone)]
pub struct LayerAttention {
    /// Full or sliding-window.
    pub kind: LayerKind,
    /// Query heads.
    pub heads: usize,
    /// Keys/values per position.
    pub kv: KvShape,
    /// Values are the key projection (no `v_proj`).
    pub k_eq_v: bool,
    /// The cache layer it reads: its own, or for a KV-shared layer the
    /// last earlier non-shared layer of its type.
    pub cache_layer: usize,
    /// Whether it computes its own keys and values.
    pub has_kv: bool,
    /// Its type's RoPE, from `rope_parameters`.
    pub rope: RopeSpec,
}

/// A layer type's RoPE, as mlx-lm's `initialize_rope` reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeSpec {
    /// `default`: every pair rotates, base `theta`.
    Default {
        /// Base frequency.
        theta: f32,
    },
    /// `proportional`: the first `rotated` of `D` dimensions' pairs rotate
    /// with periods `factor * theta^(2i / D)` (exponents over the whole
    /// head), the rest not at all.
    Proportional {
        /// Base frequency.
        theta: f32,
        /// Dimensions rotated (`D * partial_rotary_factor`).
        rotated: usize,
        /// Multiplier of the periods.
        factor: f32,
    },
}

impl RopeSpec {
    /// The [`Rope`] a `d`-wide head applies.
    pub fn rope(&self, d: usize) -> crate::model::Result<Rope> {
        Ok(match *self {
            RopeSpec::Default { theta } => Rope::Base(theta),
            RopeSpec::Proportional {
                theta,
                rotated,
                factor,
            } => {
                // As mlx-lm's `ProportionalRoPE`, op for op so the periods
                // round as its do: `factor * base ** (arange(0, r, 2) / D)`
                // then infinite periods for the unrotated pairs.
                let exps = ops::divide(
                    ops::arange::<_, f32>(0.0, rotated as f32, 2.0)?,
                    Array::from_f32(d as f32),
                )?;
                let periods = ops::multiply(
                    ops::power(Array::from_f32(theta), &exps)?,
                    Array::from_f32(factor),
                )?;
                let rest = ((d - rotated) / 2) as i32;
                let inf = ops::full::<f32>(&[rest], Array::from_f32(f32::INFINITY))?;
                Rope::Periods(ops::concatenate(&[periods, inf], 0)?)
            }
        })
    }
}

impl Gemma4Config {
    /// Each layer's type: `layer_types`, or mlx-lm's default of every
    /// `sliding_window_pattern`-th layer full (pattern 5).
    fn layer_is_full(&self, c: &ModelConfig) -> Vec<bool> {
        match &c.layer_types {
            Some(types) => types.iter().map(|t| t == "full_attention").collect(),
            None => {
                let pattern = c.sliding_window_pattern.unwrap_or(5).max(1);
                (0..c.num_hidden_layers)
                    .map(|l| (l % pattern) == pattern - 1)
                    .collect()
            }
        }
    }

    /// Index of the first KV-shared layer (`num_hidden_layers` when none).
    pub fn first_shared(&self, c: &ModelConfig) -> usize {
        let shared = self.num_kv_shared_layers.unwrap_or(0);
        c.num_hidden_layers.saturating_sub(shared)
    }

    /// Width of layer `l`'s MLP: twice `intermediate_size` on KV-shared
    /// layers with `use_double_wide_mlp` (mlx-lm: only when some layer
    /// shares, `first_shared > 0`).
    pub fn mlp_width(&self, c: &ModelConfig, l: usize) -> usize {
        let first = self.first_shared(c);
        let double = self.use_double_wide_mlp.unwrap_or(false) && first > 0 && l >= first;
        c.intermediate_size * if double { 2 } else { 1 }
    }

    /// Width of each layer's per-layer input (0: none).
    pub fn per_layer_width(&self) -> usize {
        self.hidden_size_per_layer_input.unwrap_or(0)
    }

    /// Every layer's attention (see [`LayerAttention`]).
    ///
    /// Errors (naming the field): what [`Gemma4Config::validate`] rejects.
    pub fn layers(&self, c: &ModelConfig) -> Result<Vec<LayerAttention>, String> {
        let full = self.layer_is_full(c);
        let first_shared = self.first_shared(c);
        let window = c.sliding_window.unwrap_or(512);
        let k_eq_v = self.attention_k_eq_v.unwrap_or(false);
        let mut last_of_type: [Option<usize>; 2] = [None, None];
        let mut out = Vec::with_capacity(full.len());
        for (l, &is_full) in full.iter().enumerate() {
            let t = usize::from(is_full);
            let has_kv = l < first_shared;
            if has_kv {
                last_of_type[t] = Some(l);
            }
            let cache_layer = match (has_kv, last_of_type[t]) {
                (true, _) => l,
                (false, Some(src)) => src,
                (false, None) => {
                    return Err(format!(
                        "`num_kv_shared_layers`: shared layer {l} ({}) has no earlier \
                         non-shared layer of its type to take keys and values from",
                        type_name(is_full)
                    ))
                }
            };
            let (kind, head_dim, kv_heads) = if is_full {
                let d = self
                    .global_head_dim
                    .filter(|&d| d > 0)
                    .unwrap_or(c.head_dim());
                let kv = match (k_eq_v, self.num_global_key_value_heads) {
                    (true, Some(n)) => n,
                    _ => c.num_key_value_heads,
                };
                (LayerKind::Full, d, kv)
            } else {
                (
                    LayerKind::SlidingWindow { window },
                    c.head_dim(),
                    c.num_key_value_heads,
                )
            };
            out.push(LayerAttention {
                kind,
                heads: c.num_attention_heads,
                kv: KvShape { kv_heads, head_dim },
                k_eq_v: k_eq_v && is_full,
                cache_layer,
                has_kv,
                rope: self.rope_spec(is_full, head_dim)?,
            });
        }
        Ok(out)
    }

    /// The RoPE of a layer type from `rope_parameters` (mlx-lm's defaults
    /// when the field is absent; a type missing from it: default RoPE,
    /// base 10000, as mlx-lm reads an empty entry).
    fn rope_spec(&self, is_full: bool, head_dim: usize) -> Result<RopeSpec, String> {
        let name = type_name(is_full);
        let defaults = json!({
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        });
        let params = self.rope_parameters.as_ref().unwrap_or(&defaults);
        let p = &params[name];
        let num = |key: &str, default: f64| p[key].as_f64().unwrap_or(default) as f32;
        let theta = num("rope_theta", 10000.0);
        let kind = p["type"]
            .as_str()
            .or_else(|| p["rope_type"].as_str())
            .unwrap_or("default");
        match kind {
            "default" => Ok(RopeSpec::Default { theta }),
            "proportional" => {
                let partial = num("partial_rotary_factor", 1.0);
                let rotated = (head_dim as f32 * partial) as usize;
                if !(0.0..=1.0).contains(&partial) || rotated % 2 == 1 {
                    return Err(format!(
                        "`rope_parameters.{name}.partial_rotary_factor` {partial} must rotate an \
                         even number of the {head_dim} dimensions"
                    ));
                }
                Ok(RopeSpec::Proportional {
                    theta,
                    rotated,
                    factor: num("factor", 1.0),
                })
            }
            other => Err(format!(
                "`rope_parameters.{name}.rope_type` `{other}` is not supported (default, \
                 proportional)"
            )),
        }
    }

    /// Checks what mlxhost runs; the message names the field.
    pub fn validate(&self, c: &ModelConfig) -> Result<(), String> {
        if self.enable_moe_block == Some(true) {
            return Err(
                "`enable_moe_block`: Gemma 4's mixture-of-experts layers (26B-A4B: a \
                        router and experts beside each MLP) are not supported; the dense \
                        Gemma 4 models are"
                    .into(),
            );
        }
        if self.rope_traditional == Some(true) {
            return Err("`rope_traditional: true` is not supported for Gemma 4".into());
        }
        if let Some(types) = &c.layer_types {
            if types.len() != c.num_hidden_layers {
                return Err(format!(
                    "`layer_types` has {} entries for {} layers",
                    types.len(),
                    c.num_hidden_layers
                ));
            }
            if let Some(t) = types
                .iter()
                .find(|t| !matches!(t.as_str(), "sliding_attention" | "full_attention"))
            {
                return Err(format!(
                    "`layer_types`: `{t}` is not `sliding_attention` or `full_attention`"
                ));
            }
        }
        if c.sliding_window == Some(0) {
            return Err("`sliding_window` must be positive".into());
        }
        if self.num_kv_shared_layers.unwrap_or(0) > c.num_hidden_layers {
            return Err("`num_kv_shared_layers` exceeds `num_hidden_layers`".into());
        }
        if let Some(n) = self.num_global_key_value_heads {
            if n == 0 || !c.num_attention_heads.is_multiple_of(n) {
                return Err(
                    "`num_attention_heads` must be a multiple of `num_global_key_value_heads`"
                        .into(),
                );
            }
        }
        if self.per_layer_width() > 0 && self.vocab_size_per_layer_input.unwrap_or(0) == 0 {
            return Err("`vocab_size_per_layer_input` must be positive with \
                        `hidden_size_per_layer_input`"
                .into());
        }
        self.layers(c).map(|_| ())
    }
}

fn type_name(is_full: bool) -> &'static str {
    if is_full {
        "full_attention"
    } else {
        "sliding_attention"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gemma-4-E2B's text config (Hugging Face `config.json`), the fields
    /// that shape the graph.
    fn e2b() -> Value {
        let mut types = vec!["sliding_attention"; 4];
        types.push("full_attention");
        let types: Vec<&str> = types.iter().cycle().take(35).copied().collect();
        json!({
            "model_type": "gemma4", "vocab_size": 262144, "eos_token_id": [1, 106],
            "text_config": {
                "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35,
                "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
                "global_head_dim": 512, "num_global_key_value_heads": null,
                "attention_k_eq_v": false, "sliding_window": 512, "vocab_size": 262144,
                "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
                "num_kv_shared_layers": 20, "use_double_wide_mlp": true,
                "intermediate_size": 6144, "rms_norm_eps": 1e-6,
                "final_logit_softcapping": 30.0, "eos_token_id": 1, "layer_types": types,
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                       "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
                }
            }
        })
    }

    fn config(raw: Value) -> ModelConfig {
        serde_json::from_value(normalize(raw)).expect("valid config")
    }

    #[test]
    fn e2b_shares_kv_from_the_last_layer_of_each_type() {
        let c = config(e2b());
        assert_eq!(c.model_type, "gemma4");
        assert_eq!(c.declared_eos_ids(), vec![1, 106]);
        assert!(c.validate().is_ok());
        let g = &c.gemma4;
        let layers = g.layers(&c).expect("layers");
        assert_eq!(g.first_shared(&c), 15);
        for (l, a) in layers.iter().enumerate() {
            let full = l % 5 == 4;
            assert_eq!(a.kind == LayerKind::Full, full, "layer {l}");
            assert_eq!(a.has_kv, l < 15);
            let want = match (l < 15, full) {
                (true, _) => l,
                (false, true) => 14,
                (false, false) => 13,
            };
            assert_eq!(a.cache_layer, want, "layer {l}");
            assert_eq!(a.kv.head_dim, if full { 512 } else { 256 });
            assert_eq!(a.kv.kv_heads, 1);
            assert_eq!(g.mlp_width(&c, l), if l < 15 { 6144 } else { 12288 });
        }
        assert_eq!(
            layers[4].rope,
            RopeSpec::Proportional {
                theta: 1e6,
                rotated: 128,
                factor: 1.0
            }
        );
        assert_eq!(layers[0].rope, RopeSpec::Default { theta: 1e4 });
        assert_eq!(g.final_logit_softcapping, Some(30.0));
        assert_eq!(g.per_layer_width(), 256);
    }

    #[test]
    fn absent_fields_take_mlx_lm_defaults_and_null_turns_them_off() {
        let c = config(json!({
            "model_type": "gemma4_text", "hidden_size": 8, "num_hidden_layers": 10,
            "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 4, "vocab_size": 10, "num_kv_shared_layers": 0,
            "final_logit_softcapping": null, "hidden_size_per_layer_input": null
        }));
        let g = &c.gemma4;
        assert_eq!(g.final_logit_softcapping, None);
        assert_eq!(g.per_layer_width(), 0);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rms_norm_eps, 1e-6);
        // Every fifth layer full (mlx-lm's pattern; Gemma 3's is 6).
        let layers = g.layers(&c).expect("layers");
        let full: Vec<usize> = (0..10)
            .filter(|&l| layers[l].kind == LayerKind::Full)
            .collect();
        assert_eq!(full, vec![4, 9]);
        assert_eq!(layers[4].kv.head_dim, 512);
        assert!(layers.iter().all(|a| a.has_kv));
    }

    #[test]
    fn k_eq_v_full_layers_take_the_global_kv_heads() {
        let mut raw = e2b();
        raw["text_config"]["attention_k_eq_v"] = json!(true);
        raw["text_config"]["num_global_key_value_heads"] = json!(2);
        let c = config(raw);
        let layers = c.gemma4.layers(&c).expect("layers");
        assert!(layers[4].k_eq_v && layers[4].kv.kv_heads == 2);
        assert!(!layers[3].k_eq_v && layers[3].kv.kv_heads == 1);
    }

    #[test]
    fn unsupported_variants_are_refused_by_field() {
        for (path, value, field) in [
            ("enable_moe_block", json!(true), "enable_moe_block"),
            ("rope_traditional", json!(true), "rope_traditional"),
            ("layer_types", json!(["full_attention"]), "layer_types"),
            ("num_kv_shared_layers", json!(36), "num_kv_shared_layers"),
            ("num_kv_shared_layers", json!(35), "num_kv_shared_layers"),
            (
                "rope_parameters",
                json!({"full_attention": {"rope_type": "yarn"}}),
                "rope_parameters.full_attention.rope_type",
            ),
        ] {
            let mut raw = e2b();
            raw["text_config"][path] = value.clone();
            let err = config(raw).validate().unwrap_err();
            assert!(err.contains(field), "{path} = {value}: {err}");
        }
    }

    #[test]
    fn proportional_rope_rotates_only_the_first_pairs() -> crate::model::Result<()> {
        let spec = RopeSpec::Proportional {
            theta: 1e6,
            rotated: 4,
            factor: 1.0,
        };
        let Rope::Periods(p) = spec.rope(16)? else {
            panic!("periods expected");
        };
        let p = p.as_slice::<f32>().to_vec();
        assert_eq!(p.len(), 8);
        assert_eq!(p[0], 1.0);
        assert!((p[1] - 1e6f32.powf(2.0 / 16.0)).abs() < 1e-3);
        assert!(p[2..].iter().all(|x| x.is_infinite()));
        Ok(())
    }
}
