//! mlx-lm's adapter folder, as `mlx_lm.lora` writes it:
//! `adapters.safetensors` holds `model.layers.N.<module>.lora_a` `[in, r]`
//! and `.lora_b` `[r, out]`; `adapter_config.json` holds `fine_tune_type`
//! (`lora`; `dora` and `full` are refused), `num_layers` and
//! `lora_parameters` (`rank`, `scale`, `dropout`, `keys`). The delta is
//! `scale * (x @ lora_a) @ lora_b` (mlx-lm's `LoRALinear`).

use std::path::Path;

use mlx_rs::Array;
use serde::Deserialize;

use super::{pair_parts, FoundTensor, LoraError, Module, RawAdapter};

/// The weights file.
pub const WEIGHTS: &str = "adapters.safetensors";

#[derive(Deserialize)]
struct Config {
    #[serde(default = "lora")]
    fine_tune_type: String,
    lora_parameters: Parameters,
}

fn lora() -> String {
    "lora".into()
}

#[derive(Deserialize)]
struct Parameters {
    scale: f32,
}

/// Reads the folder `dir`.
///
/// Errors: a missing or malformed config, a DoRA or full fine-tune, a
/// tensor name outside `model.layers.N.<module>.lora_{a,b}`, an A without
/// its B.
pub fn read(dir: &Path) -> Result<RawAdapter, LoraError> {
    let config_path = dir.join("adapter_config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| LoraError::invalid(&config_path, e))?;
    let config: Config =
        serde_json::from_str(&text).map_err(|e| LoraError::invalid(&config_path, e))?;
    if config.fine_tune_type != "lora" {
        return Err(LoraError::invalid(
            &config_path,
            format!(
                "fine_tune_type `{}`: only `lora` adapters are served",
                config.fine_tune_type
            ),
        ));
    }
    let path = dir.join(WEIGHTS);
    let tensors = Array::load_safetensors(&path).map_err(|e| LoraError::invalid(&path, e))?;
    let mut found = Vec::with_capacity(tensors.len());
    for (name, array) in tensors {
        let (layer, module, leaf) = parse_name(&name).ok_or_else(|| {
            LoraError::invalid(
                &path,
                format!("tensor `{name}` is not `model.layers.N.<projection>.lora_a|lora_b` of an adapted projection"),
            )
        })?;
        found.push(FoundTensor {
            layer,
            module,
            is_a: leaf == "lora_a",
            name,
            array,
        });
    }
    let parts = pair_parts(
        &path,
        found,
        config.lora_parameters.scale,
        "lora_a and lora_b",
    )?;
    Ok(RawAdapter {
        format: "mlx",
        parts,
        path: dir.to_path_buf(),
    })
}

/// `model.layers.N.<module path>.lora_a|lora_b` -> (N, module, leaf).
fn parse_name(name: &str) -> Option<(usize, Module, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, leaf) = rest.rsplit_once('.')?;
    if leaf != "lora_a" && leaf != "lora_b" {
        return None;
    }
    let module = Module::ALL.into_iter().find(|m| m.path() == module)?;
    Some((layer.parse().ok()?, module, leaf))
}
