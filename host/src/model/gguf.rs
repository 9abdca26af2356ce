//! GGUF checkpoints: config and tokenizer from metadata, tensors decoded
//! from ggml's block formats into MLX arrays in MLX naming.
//!
//! Format: ggml `docs/gguf.md` (versions 2 and 3), parsed by
//! [`super::gguf_file`]; block formats by the `ggml-quants` crate. A 2-D
//! quantized tensor becomes MLX affine quantization (groups of 32): 4 bits
//! for Q4_0/Q4_1/Q4_K, 8 bits for Q5_0/Q5_1/Q5_K/Q8_0 (all exact), and for
//! the group-16 K-quants (Q2_K, Q3_K, Q6_K) 8 bits requantized, or, on the
//! float32 compute path, float32 values decoded exactly. F16/BF16/F32 stay
//! dense.

use std::path::Path;

use ggml_quants::GgmlType;
use indicatif::{ProgressBar, ProgressStyle};
use mlx_rs::Array;

use super::config::{is_gemma3, is_gemma4, ModelConfig, MoeConfig};
use super::error::{ModelError, Result};
use super::gguf_file::{GgufFile, MetaValue, TensorInfo};
use super::tokenizer::TextTokenizer;
use super::weights::{gguf_to_mlx_name, unpermute_rope_rows, TensorMap};

/// Architectures this build can run from GGUF (Gemma 4 and gpt-oss run
/// from MLX directories only).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"];

/// llama.cpp's name of Qwen3-MoE (`LLM_ARCH_QWEN3MOE`); mlx-lm's is
/// `qwen3_moe`.
const QWEN3MOE: &str = "qwen3moe";

/// The stacked expert tensors of a sparse layer (ggml `ne`
/// `[in, out, experts]`), with the dimension each multiplies from and to:
/// `(name, in is the expert width)`.
const EXPERT_TENSORS: [(&str, bool); 3] = [
    ("ffn_gate_exps", false),
    ("ffn_up_exps", false),
    ("ffn_down_exps", true),
];

/// Control-token texts that end a turn, as llama.cpp's vocabulary loader
/// collects them (`llama-vocab.cpp`, `special_eog_ids`) beside the declared
/// EOS: a Qwen2 model ends on `<|im_end|>` and on `<|endoftext|>`.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
];

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;

/// An opened GGUF checkpoint.
pub struct Gguf {
    file: GgufFile,
    path: std::path::PathBuf,
    arch: String,
}

impl Gguf {
    /// Opens `path` and checks its header and architecture. Errors name
    /// the file (and the tensor, for an unknown tensor type or truncated
    /// data).
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::MissingFile(path.into()));
        }
        let file = GgufFile::open(path)?;
        let arch = match file.get("general.architecture").and_then(MetaValue::as_str) {
            Some(a) => a.to_string(),
            None => return Err(ModelError::invalid(path, "missing `general.architecture`")),
        };
        if is_gemma4(&arch) {
            return Err(ModelError::invalid(
                path,
                "Gemma 4 runs from an MLX directory (mlx-lm's layout), not from GGUF yet",
            ));
        }
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArchitecture {
                path: path.into(),
                arch,
            });
        }
        Ok(Gguf {
            file,
            path: path.into(),
            arch,
        })
    }

    fn meta_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.file.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                ModelError::invalid(
                    &self.path,
                    format!("metadata `{key}` is not an unsigned integer"),
                )
            }),
        }
    }

    fn meta_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.file.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                ModelError::invalid(&self.path, format!("metadata `{key}` is not a number"))
            }),
        }
    }

    fn required(&self, key: &str) -> Result<u64> {
        self.meta_u64(key)?
            .ok_or_else(|| ModelError::invalid(&self.path, format!("missing metadata `{key}`")))
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let bad = || {
            ModelError::invalid(
                &self.path,
                format!("metadata `{key}` is not a string array"),
            )
        };
        match self.file.get(key) {
            Some(MetaValue::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
            None => Err(ModelError::invalid(
                &self.path,
                format!("missing metadata `{key}`"),
            )),
        }
    }

    fn floats(&self, key: &str) -> Result<Vec<f32>> {
        match self.file.get(key) {
            Some(MetaValue::Array(items)) => items
                .iter()
                .map(|v| v.as_f64().map(|x| x as f32))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    ModelError::invalid(
                        &self.path,
                        format!("metadata `{key}` is not a number array"),
                    )
                }),
            _ => Err(ModelError::invalid(
                &self.path,
                format!("missing metadata `{key}`"),
            )),
        }
    }

    fn token_types(&self, n_tokens: usize) -> Result<Vec<i64>> {
        let key = "tokenizer.ggml.token_type";
        let types: Vec<i64> = match self.file.get(key) {
            Some(MetaValue::Array(items)) => items
                .iter()
                .map(|v| match *v {
                    MetaValue::Int(i) => Some(i),
                    MetaValue::Uint(u) => i64::try_from(u).ok(),
                    _ => None,
                })
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    ModelError::invalid(
                        &self.path,
                        format!("metadata `{key}` is not an integer array"),
                    )
                })?,
            _ => vec![1; n_tokens],
        };
        if types.len() != n_tokens {
            return Err(ModelError::invalid(
                &self.path,
                format!("`{key}` has {} entries for {n_tokens} tokens", types.len()),
            ));
        }
        Ok(types)
    }

    /// Qwen3-MoE's expert fields from `qwen3moe.expert_count`,
    /// `.expert_used_count`, `.expert_feed_forward_length` (and
    /// `.expert_weights_norm`, `.expert_gating_func` when present), with
    /// every sparse layer's router and stacked experts checked against
    /// them. llama.cpp's `qwen3moe` graph renormalises the top-k weights
    /// (`norm_w = true`) and makes every layer sparse; a layer without
    /// `ffn_gate_inp` but with a dense `ffn_gate` is taken as dense
    /// (mlx-lm's `mlp_only_layers`).
    ///
    /// Errors name the key or tensor that is missing or disagrees.
    fn moe_config(&self, hidden: usize, layers: usize) -> Result<MoeConfig> {
        let a = &self.arch;
        let count_key = format!("{a}.expert_count");
        let experts = self.required(&count_key)? as usize;
        let used_key = format!("{a}.expert_used_count");
        let used = self.required(&used_key)? as usize;
        let width_key = format!("{a}.expert_feed_forward_length");
        let width = self.required(&width_key)? as usize;
        if experts == 0 || used == 0 || used > experts {
            return Err(ModelError::invalid(
                &self.path,
                format!("`{used_key}` ({used}) must be between 1 and `{count_key}` ({experts})"),
            ));
        }
        let norm_key = format!("{a}.expert_weights_norm");
        let norm = match self.file.get(&norm_key) {
            None => true,
            Some(MetaValue::Bool(b)) => *b,
            Some(_) => {
                return Err(ModelError::invalid(
                    &self.path,
                    format!("metadata `{norm_key}` is not a bool"),
                ))
            }
        };
        let gating_key = format!("{a}.expert_gating_func");
        if let Some(g) = self.meta_u64(&gating_key)?.filter(|&g| g != 1) {
            return Err(ModelError::invalid(
                &self.path,
                format!("`{gating_key}` = {g}: only softmax gating (1) is supported"),
            ));
        }
        let mut dense_layers = Vec::new();
        for l in 0..layers {
            let router = format!("blk.{l}.ffn_gate_inp.weight");
            let Some(info) = self.file.tensor(&router) else {
                if self
                    .file
                    .tensor(&format!("blk.{l}.ffn_gate.weight"))
                    .is_some()
                {
                    dense_layers.push(l);
                    continue;
                }
                return Err(ModelError::invalid(
                    &self.path,
                    format!("tensor `{router}` (layer {l}'s expert router) is missing"),
                ));
            };
            self.check_dims(info, &[hidden, experts], &count_key)?;
            for (name, from_width) in EXPERT_TENSORS {
                let name = format!("blk.{l}.{name}.weight");
                let info = self.file.tensor(&name).ok_or_else(|| {
                    ModelError::invalid(&self.path, format!("tensor `{name}` is missing"))
                })?;
                let dims = if from_width {
                    [width, hidden, experts]
                } else {
                    [hidden, width, experts]
                };
                self.check_dims(info, &dims, &count_key)?;
            }
        }
        Ok(MoeConfig {
            num_experts: Some(experts),
            num_experts_per_tok: Some(used),
            moe_intermediate_size: Some(width),
            // Written out so `convert`'s config.json has every field
            // mlx-lm's `qwen3_moe.ModelArgs` requires.
            decoder_sparse_step: Some(1),
            mlp_only_layers: Some(dense_layers),
            norm_topk_prob: Some(norm),
        })
    }

    /// Checks tensor `info` has ggml dims `want`; the error names it, the
    /// dims found and `count_key` (the expert count it was checked with).
    fn check_dims(&self, info: &TensorInfo, want: &[usize], count_key: &str) -> Result<()> {
        let found: Vec<u64> = info.dims.clone();
        let want: Vec<u64> = want.iter().map(|&d| d as u64).collect();
        if found != want {
            return Err(ModelError::invalid(
                &self.path,
                format!(
                    "tensor `{}` has ggml dims {found:?}, expected {want:?} (the last is `{count_key}`)",
                    info.name
                ),
            ));
        }
        Ok(())
    }

    /// Hyper-parameters from `<arch>.*` metadata, in config.json spelling.
    pub fn config(&self) -> Result<ModelConfig> {
        let a = &self.arch;
        let hidden = self.required(&format!("{a}.embedding_length"))? as usize;
        let layers = self.required(&format!("{a}.block_count"))? as usize;
        let moe = if a == QWEN3MOE {
            self.moe_config(hidden, layers)?
        } else {
            MoeConfig::default()
        };
        let ff_key = format!("{a}.feed_forward_length");
        // An all-sparse Qwen3-MoE needs no dense width; mlx-lm's config
        // requires one, so fall back to the experts'.
        let intermediate = match (self.meta_u64(&ff_key)?, moe.moe_intermediate_size) {
            (Some(v), _) => v as usize,
            (None, Some(w)) if moe.mlp_only_layers.as_ref().is_some_and(Vec::is_empty) => w,
            (None, _) => self.required(&ff_key)? as usize,
        };
        let heads = self.required(&format!("{a}.attention.head_count"))? as usize;
        let tokens_len = match self.file.get("tokenizer.ggml.tokens") {
            Some(MetaValue::Array(t)) => Some(t.len()),
            _ => None,
        };
        let vocab = match self.meta_u64(&format!("{a}.vocab_size"))? {
            Some(v) => v as usize,
            None => tokens_len.ok_or_else(|| ModelError::invalid(&self.path, "no vocab size"))?,
        };
        let has_output = self.file.tensor("output.weight").is_some();
        if self.file.tensor("rope_freqs.weight").is_some() {
            return Err(ModelError::invalid(
                &self.path,
                "scaled RoPE (`rope_freqs`, Llama 3.1+) is not supported yet",
            ));
        }
        let eos = self.meta_u64("tokenizer.ggml.eos_token_id")?;
        let gemma3 = is_gemma3(a);
        if let Some(kind) = self
            .file
            .get(&format!("{a}.rope.scaling.type"))
            .and_then(MetaValue::as_str)
            .filter(|k| *k != "none")
        {
            return Err(ModelError::invalid(
                &self.path,
                format!("RoPE scaling `{kind}` (`{a}.rope.scaling.type`) is not supported yet"),
            ));
        }
        let head_dim = self
            .meta_u64(&format!("{a}.attention.key_length"))?
            .map(|v| v as usize);
        let config = ModelConfig {
            // mlx-lm's names for Gemma 3's text decoder and Qwen3-MoE, so
            // `convert` writes what it loads.
            model_type: if gemma3 {
                "gemma3_text".into()
            } else if a == QWEN3MOE {
                "qwen3_moe".into()
            } else {
                a.clone()
            },
            hidden_size: hidden,
            num_hidden_layers: layers,
            intermediate_size: intermediate,
            num_attention_heads: heads,
            num_key_value_heads: self
                .meta_u64(&format!("{a}.attention.head_count_kv"))?
                .map(|v| v as usize)
                .unwrap_or(heads),
            head_dim,
            rms_norm_eps: self
                .meta_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            vocab_size: vocab,
            rope_theta: self
                .meta_f32(&format!("{a}.rope.freq_base"))?
                .unwrap_or(10_000.0),
            tie_word_embeddings: !has_output,
            max_position_embeddings: self
                .meta_u64(&format!("{a}.context_length"))?
                .map(|v| v as usize)
                .unwrap_or(2048),
            eos_token_id: eos.map(|e| serde_json::json!(e)),
            bos_token_id: self
                .meta_u64("tokenizer.ggml.bos_token_id")?
                .map(|v| v as u32),
            torch_dtype: Some("float16".into()),
            quantization: None,
            rope_scaling: None,
            // llama.cpp (`llama-model.cpp`, LLM_ARCH_GEMMA3) fixes what the
            // GGUF does not carry: every 6th layer global, local RoPE base
            // 10000, queries scaled by 1/sqrt(head_dim) below 27B.
            query_pre_attn_scalar: if gemma3 {
                head_dim.map(|d| d as f32)
            } else {
                None
            },
            sliding_window: if gemma3 {
                self.meta_u64(&format!("{a}.attention.sliding_window"))?
                    .map(|v| v as usize)
            } else {
                None
            },
            sliding_window_pattern: gemma3.then_some(6),
            rope_local_base_freq: gemma3.then_some(10_000.0),
            layer_types: None,
            moe,
            gemma4: Default::default(),
            linear_attn: Default::default(),
        };
        config
            .validate()
            .map_err(|e| ModelError::invalid(&self.path, e))?;
        Ok(config)
    }

    /// Every id that ends generation: the declared `eos`, `eot` and `eom`
    /// ids, then control tokens whose text ends a turn
    /// ([`END_OF_GENERATION_TEXTS`]), as llama.cpp collects them.
    pub fn eos_ids(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = self.meta_u64(key)? {
                if !ids.contains(&(id as u32)) {
                    ids.push(id as u32);
                }
            }
        }
        if let Ok(tokens) = self.strings("tokenizer.ggml.tokens") {
            let types = self.token_types(tokens.len())?;
            for (id, (text, ty)) in tokens.iter().zip(types).enumerate() {
                if ty == TOKEN_TYPE_CONTROL
                    && END_OF_GENERATION_TEXTS.contains(&text.as_str())
                    && !ids.contains(&(id as u32))
                {
                    ids.push(id as u32);
                }
            }
        }
        Ok(ids)
    }

    /// The tokenizer rebuilt from `tokenizer.ggml.*` (byte-level BPE, with
    /// the pre-tokenizer `tokenizer.ggml.pre` names).
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        let model = self
            .file
            .get("tokenizer.ggml.model")
            .and_then(MetaValue::as_str);
        let flag = |key: &str| match self.file.get(key) {
            Some(MetaValue::Bool(b)) => Some(*b),
            _ => None,
        };
        let bos = match flag("tokenizer.ggml.add_bos_token") {
            Some(true) => self
                .meta_u64("tokenizer.ggml.bos_token_id")?
                .map(|id| id as u32),
            _ => None,
        };
        if model == Some("llama") {
            let tokens = self.strings("tokenizer.ggml.tokens")?;
            let types = self.token_types(tokens.len())?;
            let scores = self.floats("tokenizer.ggml.scores")?;
            let space_prefix = flag("tokenizer.ggml.add_space_prefix").unwrap_or(true);
            return TextTokenizer::from_gguf_spm(&tokens, &scores, &types, space_prefix, bos)
                .map_err(|e| ModelError::invalid(&self.path, e));
        }
        if model != Some("gpt2") {
            return Err(ModelError::invalid(
                &self.path,
                format!(
                    "tokenizer model {model:?} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece)"
                ),
            ));
        }
        let tokens = self.strings("tokenizer.ggml.tokens")?;
        // A vocabulary of single characters needs no merges, and gguf-py
        // cannot write an empty array: only then may the key be absent.
        let merges = match self.file.get("tokenizer.ggml.merges") {
            None if tokens.iter().all(|t| t.chars().count() == 1) => Vec::new(),
            _ => self.strings("tokenizer.ggml.merges")?,
        };
        let types = self.token_types(tokens.len())?;
        let pre = self
            .file
            .get("tokenizer.ggml.pre")
            .and_then(MetaValue::as_str)
            .unwrap_or("default");
        TextTokenizer::from_gguf_bpe(&tokens, &merges, &types, pre, bos)
            .map_err(|e| ModelError::invalid(&self.path, e))
    }

    /// `tokenizer.chat_template`, if present.
    pub fn chat_template(&self) -> Option<String> {
        self.file
            .get("tokenizer.chat_template")
            .and_then(MetaValue::as_str)
            .map(String::from)
    }

    /// Whether some matrix is a K-quant (Q2_K..Q6_K, llama.cpp's
    /// super-block formats): such checkpoints are llama.cpp's to define, and
    /// mlxhost's parity reference for them is llama.cpp's own output.
    pub fn has_k_quant_tensors(&self) -> bool {
        self.file.tensors.iter().any(|t| {
            t.dims.len() >= 2
                && GgmlType::from_id(t.type_id).is_some_and(|ty| {
                    matches!(
                        ty,
                        GgmlType::Q2K
                            | GgmlType::Q3K
                            | GgmlType::Q4K
                            | GgmlType::Q5K
                            | GgmlType::Q6K
                    )
                })
        })
    }

    /// Whether any 2-D or 3-D (stacked experts) tensor is stored quantized.
    pub fn has_quantized_tensors(&self) -> bool {
        self.file.tensors.iter().any(|t| {
            t.dims.len() >= 2 && GgmlType::from_id(t.type_id).is_some_and(|ty| !ty.is_float())
        })
    }

    /// All tensors the architecture uses, decoded and renamed to MLX
    /// naming (llama's q/k rows un-permuted for half-split RoPE).
    /// `exact_float32`: decode the group-16 K-quants to float32 (the
    /// float32 compute path) instead of requantizing them to 8 bits.
    /// Shows a progress bar on a terminal.
    ///
    /// Errors name the file and the tensor.
    pub fn tensors(&self, config: &ModelConfig, exact_float32: bool) -> Result<TensorMap> {
        let used: Vec<(&TensorInfo, String)> = self
            .file
            .tensors
            .iter()
            .filter_map(|t| gguf_to_mlx_name(&self.arch, &t.name).map(|n| (t, n)))
            .collect();
        let total: u64 = used.iter().map(|(t, _)| t.elems()).sum();
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("loading    [{bar:40}] {percent}% {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let mut map = TensorMap::new();
        for (info, mlx_name) in used {
            bar.set_message(info.name.clone());
            let arrays = self.decode(info, exact_float32).map_err(|e| {
                ModelError::invalid(&self.path, format!("tensor `{}`: {e}", info.name))
            })?;
            let base = mlx_name.strip_suffix(".weight").map(String::from);
            let rope_heads = if self.arch == "llama" && mlx_name.contains(".self_attn.q_proj.") {
                Some(config.num_attention_heads)
            } else if self.arch == "llama" && mlx_name.contains(".self_attn.k_proj.") {
                Some(config.num_key_value_heads)
            } else {
                None
            };
            // llama.cpp's converter stores Gemma's norm weights as `1 + w`
            // (`convert_hf_to_gguf.py`, Gemma3Model); MLX naming keeps
            // Hugging Face's `w`, as mlx-lm and `convert` expect.
            let norm_shift = is_gemma3(&self.arch) && mlx_name.ends_with("norm.weight");
            for (suffix, array) in arrays {
                let array = match rope_heads {
                    Some(n) => unpermute_rope_rows(&array, n)?,
                    None => array,
                };
                let array = if norm_shift {
                    mlx_rs::ops::subtract(
                        &array.as_dtype(mlx_rs::Dtype::Float32)?,
                        Array::from_f32(1.0),
                    )?
                } else {
                    array
                };
                let name = match (suffix, &base) {
                    ("weight", _) | (_, None) => mlx_name.clone(),
                    (s, Some(b)) => format!("{b}.{s}"),
                };
                map.insert(name, array);
            }
            bar.inc(info.elems());
        }
        bar.finish_and_clear();
        Ok(map)
    }

    /// One tensor as MLX arrays: `[("weight", dense)]`, or
    /// `[("weight", packed), ("scales", ..), ("biases", ..)]`.
    fn decode(
        &self,
        info: &TensorInfo,
        exact_float32: bool,
    ) -> std::result::Result<Vec<(&'static str, Array)>, String> {
        let ty = GgmlType::from_id(info.type_id).ok_or_else(|| {
            format!(
                "ggml type {} is not supported",
                GgmlType::name_of_id(info.type_id)
            )
        })?;
        let data = self.file.data(info);
        let shape: Vec<i32> = info
            .dims
            .iter()
            .rev()
            .map(|&d| i32::try_from(d).map_err(|_| format!("dimension {d} is too large")))
            .collect::<std::result::Result<_, _>>()?;
        let elems = info.elems() as usize;
        let err = |e: ggml_quants::Error| e.to_string();
        let dense = |values: Vec<f32>| Array::from_slice(&values, &shape);
        if ty.is_float() || !(2..=3).contains(&shape.len()) {
            // Half-width floats stay in their own dtype, as MLX's reader kept them.
            let halves = |n: usize| data[..n].chunks_exact(2).map(|b| [b[0], b[1]]);
            let a = match ty {
                GgmlType::F16 => {
                    let n = ty.bytes_for(elems).map_err(err)?;
                    let v: Vec<_> = halves(n).map(half::f16::from_le_bytes).collect();
                    Array::from_slice(&v, &shape)
                }
                GgmlType::BF16 => {
                    let n = ty.bytes_for(elems).map_err(err)?;
                    let v: Vec<_> = halves(n).map(half::bf16::from_le_bytes).collect();
                    Array::from_slice(&v, &shape)
                }
                _ => dense(ggml_quants::dequantize(ty, data, elems).map_err(err)?),
            };
            return Ok(vec![("weight", a)]);
        }
        let group16 = matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K);
        if group16 && exact_float32 {
            let values = ggml_quants::dequantize(ty, data, elems).map_err(err)?;
            return Ok(vec![("weight", dense(values))]);
        }
        // A 3-D tensor (stacked experts, `[experts, out, in]`) quantizes
        // each expert's rows along `in` like a 2-D one: decoded as
        // `experts * out` rows, then given its leading dims back.
        let (lead, cols) = shape.split_at(shape.len() - 1);
        let cols = cols[0];
        let rows: i32 = lead.iter().product();
        let m = ggml_quants::to_mlx_affine(ty, data, rows as usize, cols as usize).map_err(err)?;
        let groups = cols / m.group_size as i32;
        let dims = |last: i32| [lead, &[last]].concat();
        let weight = Array::from_slice(&m.weight, &dims(cols * m.bits as i32 / 32));
        // The legacy types' scales and biases are float16 values times small
        // powers of two: exact in float16, which is what MLX's own GGUF
        // reader returns (the native path's activation dtype follows it).
        let legacy = matches!(
            ty,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0
        );
        let to_f16 = |v: &[f32]| -> Option<Vec<half::f16>> {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            h.iter().zip(v).all(|(h, &x)| h.to_f32() == x).then_some(h)
        };
        let (scales, biases) = match (legacy, to_f16(&m.scales), to_f16(&m.biases)) {
            (true, Some(s), Some(b)) => (
                Array::from_slice(&s, &dims(groups)),
                Array::from_slice(&b, &dims(groups)),
            ),
            _ => (
                Array::from_slice(&m.scales, &dims(groups)),
                Array::from_slice(&m.biases, &dims(groups)),
            ),
        };
        Ok(vec![
            ("weight", weight),
            ("scales", scales),
            ("biases", biases),
        ])
    }

    /// The path this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
