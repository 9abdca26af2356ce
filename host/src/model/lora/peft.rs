//! PEFT's adapter folder (`save_pretrained` of a `LoraConfig`):
//! `adapter_model.safetensors` holds
//! `base_model.model.model.layers.N.<module>.lora_A.weight` `[r, in]` and
//! `lora_B.weight` `[out, r]`; `adapter_config.json` holds `r`,
//! `lora_alpha`, `target_modules` and `use_rslora`. The delta is
//! `x @ A^T @ B^T * lora_alpha / r` (`/ sqrt(r)` with rsLoRA), read here as
//! mlx-lm's orientation (`A [in, r]`, `B [r, out]`). Per-module ranks and
//! alphas (`rank_pattern`, `alpha_pattern`), DoRA and bias training are
//! refused.

use std::path::Path;

use mlx_rs::Array;
use serde::Deserialize;

use super::{pair_parts, FoundTensor, LoraError, Module, RawAdapter};

/// The weights file.
pub const WEIGHTS: &str = "adapter_model.safetensors";

#[derive(Deserialize)]
struct Config {
    #[serde(default)]
    peft_type: Option<String>,
    r: f32,
    lora_alpha: f32,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    rank_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    target_modules: Option<serde_json::Value>,
}

/// Reads the folder `dir`.
///
/// Errors: a missing or malformed config, a non-LoRA PEFT type, DoRA,
/// per-module ranks or alphas, a tensor outside the decoder layers'
/// projections, a module not in `target_modules`, an A without its B.
pub fn read(dir: &Path) -> Result<RawAdapter, LoraError> {
    let config_path = dir.join("adapter_config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| LoraError::invalid(&config_path, e))?;
    let config: Config =
        serde_json::from_str(&text).map_err(|e| LoraError::invalid(&config_path, e))?;
    let refuse = |what: &str| Err(LoraError::invalid(&config_path, what));
    if config.peft_type.as_deref().is_some_and(|t| t != "LORA") {
        return refuse("peft_type is not LORA");
    }
    if config.use_dora {
        return refuse("use_dora: DoRA adapters are not served");
    }
    if !config.rank_pattern.is_empty() || !config.alpha_pattern.is_empty() {
        return refuse("rank_pattern / alpha_pattern (per-module ranks) are not supported");
    }
    if config.r <= 0.0 {
        return refuse("r must be positive");
    }
    let scale = if config.use_rslora {
        config.lora_alpha / config.r.sqrt()
    } else {
        config.lora_alpha / config.r
    };
    let targets: Option<Vec<String>> = match &config.target_modules {
        Some(serde_json::Value::Array(v)) => Some(
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect(),
        ),
        _ => None,
    };
    let path = dir.join(WEIGHTS);
    let tensors = Array::load_safetensors(&path).map_err(|e| LoraError::invalid(&path, e))?;
    let mut found = Vec::with_capacity(tensors.len());
    for (name, array) in tensors {
        let (layer, module, is_a) = parse_name(&name).ok_or_else(|| {
            LoraError::invalid(
                &path,
                format!("tensor `{name}` is not `...layers.N.<projection>.lora_A|lora_B.weight` of an adapted projection"),
            )
        })?;
        if let Some(t) = &targets {
            let short = module.path().rsplit('.').next().unwrap_or_default();
            if !t.iter().any(|m| m == short || m == module.path()) {
                return Err(LoraError::invalid(
                    &path,
                    format!("tensor `{name}` adapts `{short}`, which target_modules does not list"),
                ));
            }
        }
        // PEFT stores A [r, in] and B [out, r]: transposed views.
        found.push(FoundTensor {
            layer,
            module,
            is_a,
            name,
            array: array.t(),
        });
    }
    let parts = pair_parts(&path, found, scale, "lora_A and lora_B")?;
    Ok(RawAdapter {
        format: "peft",
        parts,
        path: dir.to_path_buf(),
    })
}

/// `[base_model.model.]model.layers.N.<module path>.lora_A|lora_B.weight`
/// -> (N, module, is A).
fn parse_name(name: &str) -> Option<(usize, Module, bool)> {
    let rest = name.strip_suffix(".weight")?;
    let (rest, leaf) = rest.rsplit_once('.')?;
    let is_a = match leaf {
        "lora_A" => true,
        "lora_B" => false,
        _ => return None,
    };
    let at = rest.find("layers.")?;
    let rest = &rest[at + "layers.".len()..];
    let (layer, module) = rest.split_once('.')?;
    let module = Module::ALL.into_iter().find(|m| m.path() == module)?;
    Some((layer.parse().ok()?, module, is_a))
}
