//! mlx-lm's adapter folder, as `mlx_lm.lora` writes it:
//! `adapters.safetensors` holds `model.layers.N.<module>.lora_a` `[in, r]`
//! and `.lora_b` `[r, out]`; `adapter_config.json` holds `fine_tune_type`
//! (`lora`; `dora` and `full` are refused), `num_layers` and
//! `lora_parameters` (`rank`, `scale`, `dropout`, `keys`). The delta is
//! `scale * (x @ lora_a) @ lora_b` (mlx-lm's `LoRALinear`).

use std::collections::BTreeMap;
use std::path::Path;

use mlx_rs::Array;
use serde::Deserialize;

use super::{LoraError, LoraPart, Module, RawAdapter};

/// A module's A and B as found, with their names.
type Pair = (Option<(String, Array)>, Option<(String, Array)>);

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
    let mut pairs: BTreeMap<(usize, Module), Pair> = BTreeMap::new();
    for (name, array) in tensors {
        let (layer, module, leaf) = parse_name(&name).ok_or_else(|| {
            LoraError::invalid(
                &path,
                format!("tensor `{name}` is not `model.layers.N.<projection>.lora_a|lora_b` of an adapted projection"),
            )
        })?;
        let entry = pairs.entry((layer, module)).or_default();
        match leaf {
            "lora_a" => entry.0 = Some((name, array)),
            _ => entry.1 = Some((name, array)),
        }
    }
    let mut parts = Vec::with_capacity(pairs.len());
    for ((layer, module), pair) in pairs {
        match pair {
            (Some((na, a)), Some((nb, b))) => parts.push(LoraPart {
                layer,
                module,
                a,
                b,
                scale: config.lora_parameters.scale,
                names: (na, nb),
            }),
            (Some((n, _)), None) | (None, Some((n, _))) => {
                return Err(LoraError::invalid(
                    &path,
                    format!(
                    "tensor `{n}` has no partner (an adapted projection needs lora_a and lora_b)"
                ),
                ))
            }
            (None, None) => {}
        }
    }
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
