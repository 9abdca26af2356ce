//! Models: configuration, weights, tokenizer, chat template, architectures,
//! and loading them from a GGUF file or an MLX model directory.

pub mod arch;
pub mod catalog;
pub mod chat_template;
pub mod config;
pub mod convert;
pub mod cpu_quant;
pub mod cpu_swiglu;
pub mod cuda_decode_attention;
pub mod cuda_fused;
pub mod cuda_kernel;
pub mod cuda_qmv;
pub mod cuda_split_attention;
pub mod decode_attention;
pub mod decode_layer;
pub mod error;
pub mod fingerprint;
pub mod gated_delta;
pub mod gemma3;
pub mod gemma4;
pub mod gguf;
pub mod gguf_file;
pub mod gpt_oss;
pub mod linear;
pub mod llama;
pub mod lora;
pub mod moe;
pub mod mxfp4;
pub mod prefill_attention;
pub mod quantized_kv;
pub mod qwen3_5;
pub mod ragged;
pub mod strftime;
pub mod tokenizer;
pub mod weights;
pub mod yarn;

use std::path::{Path, PathBuf};

use mlx_rs::Array;

pub use arch::CausalLm;
pub use chat_template::{ChatMessage, ChatTemplate, TemplateMessage};
pub use config::ModelConfig;
pub use error::{ModelError, Result};
pub use llama::{Llama, RowInput};
pub use tokenizer::TextTokenizer;
pub use weights::ComputeDtype;

/// The `--dtype` option: how to compute with the checkpoint's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DtypeArg {
    /// On the CPU backend: a quantized checkpoint keeps its 4/8-bit weights
    /// (mlxhost's quantized kernels), else float32 dequantized weights when
    /// they fit in half the available memory; the checkpoint's path on
    /// GPU/Metal.
    #[default]
    Auto,
    /// The checkpoint's path: quantized weights, float16 activations
    /// (mlx-lm's numerics).
    Native,
    /// float32 dequantized weights everywhere.
    Float32,
    /// Quantized weights stay 4/8-bit in memory, float32 activations; on
    /// the CPU backend mlxhost's quantized kernel computes the products.
    Quantized,
}

/// Where a model was loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFormat {
    /// A single `.gguf` file.
    Gguf,
    /// An MLX model directory (config.json + safetensors + tokenizer files).
    MlxDir,
}

/// A model ready to run: weights, tokenizer, template and stop ids.
pub struct LoadedModel {
    /// The architecture with its weights, behind the interface the engine
    /// uses.
    pub model: Box<dyn CausalLm>,
    /// Text <-> ids.
    pub tokenizer: TextTokenizer,
    /// Chat template, if the checkpoint has one.
    pub template: Option<ChatTemplate>,
    /// Every id that ends generation.
    pub eos_ids: Vec<u32>,
    /// The path given.
    pub path: PathBuf,
    /// GGUF or MLX directory.
    pub format: ModelFormat,
    /// The compute path chosen.
    pub compute: ComputeDtype,
    /// The checkpoint's tensors as loaded (before the compute cast), kept
    /// only when `keep_tensors` was asked (for `convert`).
    pub source_tensors: Option<weights::TensorMap>,
    /// BOS token string (for templates and tokenizer_config.json).
    pub bos_token: Option<String>,
    /// The LoRA adapters served on top of it (`--lora-dir`; empty unless
    /// set after loading).
    pub lora: lora::LoraSet,
    /// The fingerprint of the adapter merged into the weights
    /// (`--lora-merge`, [`LoadedModel::merge_lora`]); part of every cache
    /// namespace, so KV of the merged weights never meets the base's.
    pub merged_lora: Option<String>,
    /// The draft model speculative decoding's `draft-model` drafter runs
    /// (`--draft-model`; `engine::draft_model`), checked to share this
    /// model's vocabulary.
    pub draft: Option<Box<LoadedModel>>,
}

impl LoadedModel {
    /// Merges the adapter in folder `dir` into the weights
    /// (`--lora-merge`).
    ///
    /// Errors: the adapter does not load or fit; the architecture runs no
    /// adapters.
    pub fn merge_lora(&mut self, dir: &Path) -> Result<()> {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "merged".into());
        let adapter = lora::LoraSet::load_one(&name, dir, self.model.lora_targets())?;
        self.model.merge_lora(&adapter)?;
        self.merged_lora = Some(adapter.fingerprint.clone());
        Ok(())
    }
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("compute", &self.compute)
            .finish_non_exhaustive()
    }
}

/// Options for [`load`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `--dtype`.
    pub dtype: DtypeArg,
    /// Keep the checkpoint tensors in [`LoadedModel::source_tensors`].
    pub keep_tensors: bool,
    /// Load only this rank's shard of the weights and run as that rank of
    /// the group (`serve --tensor-parallel`, [`crate::distributed`]).
    pub tensor_parallel: Option<std::sync::Arc<crate::distributed::Group>>,
}

/// The default model: SmolLM2-135M-Instruct as installed by
/// `scripts/setup.sh` under the cache directory.
pub fn default_model_path() -> PathBuf {
    crate::paths::cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Loads a model from a `.gguf` file or an MLX model directory and evaluates
/// its weights.
///
/// Errors: [`ModelError::MissingFile`] when the path or a required file is
/// absent; [`ModelError::InvalidFile`] for truncated or malformed files;
/// [`ModelError::UnsupportedArchitecture`] for other architectures.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    if !path.exists() {
        return Err(ModelError::MissingFile(path.into()));
    }
    let (config, tensors, tokenizer, template_src, eos_ids, bos_token, format, compute) =
        if path.is_dir() {
            let (config, tensors, tokenizer, template, eos, bos, format) = load_dir_parts(path)?;
            // MLX checkpoints: mlx-lm is the reference; exact float32 products.
            cpu_quant::set_low_precision_prefill(false);
            let compute = resolve_compute(opts.dtype, is_quantized_checkpoint(&tensors), &config);
            (
                config, tensors, tokenizer, template, eos, bos, format, compute,
            )
        } else {
            let g = gguf::Gguf::open(path)?;
            let config = g.config()?;
            let tokenizer = g.tokenizer()?;
            let compute = resolve_compute(opts.dtype, g.has_quantized_tensors(), &config);
            // K-quants on the quantized path: prefill products and attention
            // round to bfloat16 (AMX) or int8, as llama.cpp (their parity
            // reference) rounds x to int8; `--dtype float32` keeps float32
            // everywhere. `MLXHOST_PREFILL_PRODUCTS` overrides.
            cpu_quant::set_low_precision_prefill(
                g.has_k_quant_tensors() && compute != ComputeDtype::Float32,
            );
            let tensors = g.tensors(&config, compute == ComputeDtype::Float32)?;
            let eos = g.eos_ids()?;
            let bos = config.bos_token_id.and_then(|id| tokenizer.id_to_token(id));
            (
                config,
                tensors,
                tokenizer,
                g.chat_template(),
                eos,
                bos,
                ModelFormat::Gguf,
                compute,
            )
        };
    let (config, mut tensors) = (config, tensors);
    let config = match &opts.tensor_parallel {
        Some(g) => {
            crate::distributed::shard::shard_llama(&config, &mut tensors, g.rank(), g.size())?
        }
        None => config,
    };
    let mut model: Box<dyn CausalLm> = weights::build_model(&config, &tensors, compute)?;
    if let Some(g) = &opts.tensor_parallel {
        model.set_tensor_parallel(g.clone())?;
    }
    let params: Vec<&Array> = model.parameters();
    mlx_rs::transforms::eval(params)?;
    let eos_token = eos_ids
        .first()
        .and_then(|&id| tokenizer.id_to_token(id))
        .unwrap_or_default();
    let template = match template_src {
        Some(src) => Some(ChatTemplate::new(
            &src,
            bos_token.as_deref().unwrap_or(""),
            &eos_token,
        )?),
        None => None,
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        template,
        eos_ids,
        path: path.into(),
        format,
        compute,
        source_tensors: opts.keep_tensors.then_some(tensors),
        bos_token,
        lora: lora::LoraSet::default(),
        merged_lora: None,
        draft: None,
    })
}

type DirParts = (
    ModelConfig,
    weights::TensorMap,
    TextTokenizer,
    Option<String>,
    Vec<u32>,
    Option<String>,
    ModelFormat,
);

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::MissingFile(path.into()),
        _ => ModelError::Io {
            path: path.into(),
            source: e,
        },
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::invalid(path, e))
}

/// Only the tokenizer of a model (a `.gguf` file's metadata or a
/// directory's `tokenizer.json`), without loading weights: for tools that
/// need the vocabulary (`mlxhost plugins check`).
///
/// Errors: a missing file, or metadata that does not describe a tokenizer.
pub fn load_tokenizer(path: &Path) -> Result<TextTokenizer> {
    if path.is_dir() {
        TextTokenizer::from_file(&path.join("tokenizer.json"))
    } else {
        gguf::Gguf::open(path)?.tokenizer()
    }
}

/// Reads an MLX model directory: config.json, *.safetensors, tokenizer.json,
/// tokenizer_config.json (chat template, special tokens) and, when present,
/// generation_config.json (more EOS ids).
fn load_dir_parts(dir: &Path) -> Result<DirParts> {
    let config_path = dir.join("config.json");
    let config_json = config::normalize_json(read_json(&config_path)?);
    let arch = config_json["model_type"].as_str().unwrap_or("").to_string();
    if !config::SUPPORTED_MODEL_TYPES.contains(&arch.as_str()) {
        return Err(ModelError::UnsupportedArchitecture {
            path: config_path,
            arch,
        });
    }
    let config: ModelConfig =
        serde_json::from_value(config_json).map_err(|e| ModelError::invalid(&config_path, e))?;
    config
        .validate()
        .map_err(|e| ModelError::invalid(&config_path, e))?;
    let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json"))?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.is_file() {
        read_json(&tc_path)?
    } else {
        serde_json::Value::Null
    };
    let token_str = |v: &serde_json::Value| -> Option<String> {
        v.as_str()
            .map(String::from)
            .or_else(|| v["content"].as_str().map(String::from))
    };
    let template = tc["chat_template"]
        .as_str()
        .map(String::from)
        .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
    let mut eos = config.declared_eos_ids();
    let gen_path = dir.join("generation_config.json");
    if gen_path.is_file() {
        for id in config::eos_ids_from_json(Some(&read_json(&gen_path)?["eos_token_id"])) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    if let Some(id) = token_str(&tc["eos_token"]).and_then(|t| tokenizer.token_to_id(&t)) {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let bos = token_str(&tc["bos_token"])
        .or_else(|| config.bos_token_id.and_then(|id| tokenizer.id_to_token(id)));
    let tensors = weights::load_safetensors_dir(dir)?;
    Ok((
        config,
        tensors,
        tokenizer,
        template,
        eos,
        bos,
        ModelFormat::MlxDir,
    ))
}

/// `--dtype auto`: on the CPU backend, a quantized checkpoint keeps its
/// quantized weights ([`ComputeDtype::Quantized`]); else
/// float32 when the dequantized weights fit in half of the available memory;
/// otherwise (and on GPU/Metal) the checkpoint's path.
fn resolve_compute(
    arg: DtypeArg,
    quantized_checkpoint: bool,
    config: &ModelConfig,
) -> ComputeDtype {
    match arg {
        DtypeArg::Native => ComputeDtype::Native,
        DtypeArg::Float32 => ComputeDtype::Float32,
        DtypeArg::Quantized => ComputeDtype::Quantized,
        DtypeArg::Auto => {
            if crate::runtime::gpu_available() {
                return ComputeDtype::Native;
            }
            if cpu_quant::enabled() && quantized_checkpoint {
                return ComputeDtype::Quantized;
            }
            let params = approx_params(config);
            let f32_bytes = params * 4;
            match crate::runtime::available_memory_bytes() {
                Some(avail) if f32_bytes > avail / 2 => ComputeDtype::Native,
                _ => ComputeDtype::Float32,
            }
        }
    }
}

/// Whether the checkpoint has quantized linears (MLX's `.scales` next to a
/// weight). Under [`ComputeDtype::Quantized`] the ones our kernel cannot
/// compute are dequantized to float32 one by one.
fn is_quantized_checkpoint(tensors: &weights::TensorMap) -> bool {
    tensors.keys().any(|name| name.ends_with(".scales"))
}

/// Parameter count of a config (embedding counted once when tied; every
/// expert of a sparse layer, which all stay in memory; Gemma 4's per-layer
/// inputs).
fn approx_params(c: &ModelConfig) -> u64 {
    let h = c.hidden_size as u64;
    let hd = c.head_dim() as u64;
    let attn = h * hd * (2 * c.num_attention_heads as u64 + 2 * c.num_key_value_heads as u64);
    let mlp = |l: usize| match (c.moe.is_sparse_layer(l), c.moe.num_experts) {
        (true, Some(e)) => {
            let per_expert = 3 * h * c.moe.moe_intermediate_size.unwrap_or(0) as u64;
            e as u64 * (per_expert + h)
        }
        _ => 3 * h * c.gemma4.mlp_width(c, l) as u64,
    };
    let embed = h * c.vocab_size as u64 * if c.tie_word_embeddings { 1 } else { 2 };
    let layers: u64 = (0..c.num_hidden_layers)
        .map(|l| attn + mlp(l) + 2 * h)
        .sum();
    // Gemma 4's per-layer inputs: an embedding of `layers × P` per token
    // (most of E2B's parameters) and its projection from the stream.
    let g = &c.gemma4;
    let per_layer = (c.num_hidden_layers * g.per_layer_width()) as u64
        * (g.vocab_size_per_layer_input.unwrap_or(0) as u64 + h);
    layers + embed + per_layer + h
}
