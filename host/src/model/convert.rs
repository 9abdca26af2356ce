//! `mlxhost convert`: a GGUF checkpoint to the standard MLX model directory
//! that mlx-lm loads unchanged (`config.json`, `model.safetensors` with MLX
//! affine quantization, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`).
//!
//! Quantized tensors are written as MLX returns them from GGUF (Q4_0/Q4_1 as
//! 4-bit, Q8_0 as 8-bit, group 32); per-module quantization that differs from
//! the most common one is recorded in `config.json` under `quantization`, the
//! way mlx-lm records mixed quantization. Unquantized tensors are stored in
//! float16, the dtype mlx-lm computes this model in.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use mlx_rs::{Array, Dtype};

use super::config::QuantSpec;
use super::error::{ModelError, Result};
use super::gguf::Gguf;

/// What [`convert_gguf`] wrote.
#[derive(Debug)]
pub struct ConvertReport {
    /// The output directory.
    pub out_dir: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
}

/// Converts `gguf` into the MLX layout at `out_dir`.
///
/// The directory is written under a temporary name and renamed into place,
/// so a failed conversion leaves nothing half-written. Errors: the input's
/// load errors; [`ModelError::InvalidFile`] when `out_dir` exists and is not
/// empty.
pub fn convert_gguf(gguf: &Path, out_dir: &Path, progress: bool) -> Result<ConvertReport> {
    if out_dir.exists()
        && std::fs::read_dir(out_dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(ModelError::invalid(
            out_dir,
            "output directory exists and is not empty",
        ));
    }
    let g = Gguf::open(gguf)?;
    let mut config = g.config()?;
    let tokenizer = g.tokenizer()?;
    let tensors = g.tensors(&config, false)?;

    let bar = if progress {
        ProgressBar::new(tensors.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:10} [{bar:40}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message("converting");

    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut out: BTreeMap<String, Array> = BTreeMap::new();
    let mut specs: HashMap<String, QuantSpec> = HashMap::new();
    for name in names {
        let a = &tensors[name];
        let a = match a.dtype() {
            Dtype::Float32 | Dtype::Bfloat16 => a.as_dtype(Dtype::Float16)?,
            _ => a.clone(),
        };
        a.eval()?;
        if let Some(module) = name.strip_suffix(".scales") {
            if let Some(spec) = quant_spec_of(&tensors, module, &config) {
                specs.insert(module.to_string(), spec);
            }
        }
        out.insert(name.clone(), a);
        bar.inc(1);
    }
    bar.set_message("writing");

    config.quantization = quantization_json(&specs);
    config.torch_dtype = Some("float16".into());

    let parent = out_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| ModelError::Io {
        path: parent.into(),
        source,
    })?;
    let staging = parent.join(format!(
        ".{}.partial-{}",
        out_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|source| ModelError::Io {
        path: staging.clone(),
        source,
    })?;
    let result = write_all(&staging, &g, &config, &tokenizer, &out);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    if out_dir.exists() {
        std::fs::remove_dir(out_dir).map_err(|source| ModelError::Io {
            path: out_dir.into(),
            source,
        })?;
    }
    std::fs::rename(&staging, out_dir).map_err(|source| ModelError::Io {
        path: out_dir.into(),
        source,
    })?;
    let bytes = std::fs::metadata(out_dir.join("model.safetensors"))
        .map(|m| m.len())
        .unwrap_or(0);
    bar.finish_with_message("done");
    Ok(ConvertReport {
        out_dir: out_dir.into(),
        tensors: out.len(),
        bytes,
    })
}

fn write_all(
    dir: &Path,
    g: &Gguf,
    config: &super::ModelConfig,
    tokenizer: &super::TextTokenizer,
    tensors: &BTreeMap<String, Array>,
) -> Result<()> {
    let io = |path: PathBuf| move |source| ModelError::Io { path, source };
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "mlx".to_string());
    let st = dir.join("model.safetensors");
    Array::save_safetensors(tensors.iter().map(|(k, v)| (k.as_str(), v)), &meta, &st)
        .map_err(|e| ModelError::invalid(&st, e))?;
    let config_path = dir.join("config.json");
    let mut cfg = serde_json::to_value(config).map_err(|e| ModelError::invalid(&config_path, e))?;
    // mlx-lm reads `quantization`; transformers-style tools read `quantization_config`.
    cfg["quantization_config"] = cfg["quantization"].clone();
    let architecture = match config.model_type.as_str() {
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        "gemma3_text" => "Gemma3ForCausalLM",
        _ => "LlamaForCausalLM",
    };
    cfg["architectures"] = serde_json::json!([architecture]);
    write_json(&config_path, &cfg).map_err(io(config_path.clone()))?;
    tokenizer.save(&dir.join("tokenizer.json"))?;
    let eos_ids = g.eos_ids()?;
    let token = |id: Option<u32>| id.and_then(|id| tokenizer.id_to_token(id));
    let mut tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.adds_bos(),
        "add_prefix_space": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": config.max_position_embeddings,
        "eos_token": token(eos_ids.first().copied()),
        "bos_token": token(config.bos_token_id),
    });
    if let Some(t) = g.chat_template() {
        tc["chat_template"] = serde_json::json!(t);
    }
    let tc_path = dir.join("tokenizer_config.json");
    write_json(&tc_path, &tc).map_err(io(tc_path.clone()))?;
    let gen_path = dir.join("generation_config.json");
    let gen = serde_json::json!({ "eos_token_id": eos_ids, "bos_token_id": config.bos_token_id });
    write_json(&gen_path, &gen).map_err(io(gen_path.clone()))?;
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// Quantization of `module` from its tensors' shapes (the last axis of
/// 2-D linears and of stacked experts, `[experts, out, in * bits / 32]`).
fn quant_spec_of(
    tensors: &super::weights::TensorMap,
    module: &str,
    config: &super::ModelConfig,
) -> Option<QuantSpec> {
    let w = tensors.get(&format!("{module}.weight"))?;
    let s = tensors.get(&format!("{module}.scales"))?;
    let in_dim = if module.ends_with("o_proj") {
        config.num_attention_heads * config.head_dim()
    } else if module.ends_with("switch_mlp.down_proj") {
        config.moe.moe_intermediate_size?
    } else if module.ends_with("down_proj") {
        config.intermediate_size
    } else {
        config.hidden_size
    };
    let groups = *s.shape().last()? as usize;
    let packed = *w.shape().last()? as usize;
    (groups > 0).then(|| QuantSpec {
        group_size: (in_dim / groups) as i32,
        bits: (packed * 32 / in_dim) as i32,
    })
}

/// `{"group_size", "bits", "mode"}` of the most common spec, plus an entry
/// per module that differs (mlx-lm's per-layer quantization format).
fn quantization_json(specs: &HashMap<String, QuantSpec>) -> Option<serde_json::Value> {
    let mut counts: HashMap<QuantSpec, usize> = HashMap::new();
    for s in specs.values() {
        *counts.entry(*s).or_default() += 1;
    }
    let (default, _) = counts.into_iter().max_by_key(|(s, n)| (*n, s.bits))?;
    let mut q = serde_json::json!({
        "group_size": default.group_size,
        "bits": default.bits,
        "mode": "affine",
    });
    let mut modules: Vec<_> = specs.iter().filter(|(_, s)| **s != default).collect();
    modules.sort_by(|a, b| a.0.cmp(b.0));
    for (module, s) in modules {
        q[module] = serde_json::json!({ "group_size": s.group_size, "bits": s.bits });
    }
    Some(q)
}
