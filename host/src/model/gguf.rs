//! GGUF checkpoints: header validation, config and tokenizer from metadata,
//! tensors through MLX's GGUF reader (`mx.load`), renamed to MLX naming.
//!
//! Format: ggml `docs/gguf.md` (version 2 and 3). MLX returns Q4_0/Q4_1/Q8_0
//! tensors as MLX affine quantization (group 32) and F16/F32 as dense; it
//! cannot read K-quants.

use std::io::Read;
use std::path::Path;

use mlx_rs::io::{GgufFile, GgufMetadataValue};
use mlx_rs::Array;

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::tokenizer::TextTokenizer;
use super::weights::{gguf_to_mlx_name, unpermute_rope_rows, TensorMap};

/// Architectures this build can run from GGUF.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

/// An opened GGUF checkpoint.
pub struct Gguf {
    file: GgufFile,
    path: std::path::PathBuf,
    arch: String,
}

impl Gguf {
    /// Opens `path`, checking magic, version and that the file is not
    /// truncated before handing it to MLX. Errors name the file.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(ModelError::MissingFile(path.into()));
        }
        check_header(path)?;
        let file = GgufFile::load(path).map_err(|e| ModelError::invalid(path, e))?;
        let arch = match file.get_metadata_string("general.architecture") {
            Ok(Some(a)) => a,
            _ => return Err(ModelError::invalid(path, "missing `general.architecture`")),
        };
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
        match self.file.get_metadata(key) {
            Ok(Some(GgufMetadataValue::Array(a))) => {
                let a = a.as_dtype(mlx_rs::Dtype::Float64)?;
                Ok(Some(a.try_item_cast::<f64>().map_err(|e| {
                    ModelError::invalid(&self.path, format!("metadata `{key}`: {e}"))
                })? as u64))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(ModelError::invalid(
                &self.path,
                format!("metadata `{key}`: {e}"),
            )),
        }
    }

    fn meta_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.file.get_metadata(key) {
            Ok(Some(GgufMetadataValue::Array(a))) => Ok(Some(
                a.as_dtype(mlx_rs::Dtype::Float32)?
                    .try_item_cast::<f32>()
                    .map_err(|e| {
                        ModelError::invalid(&self.path, format!("metadata `{key}`: {e}"))
                    })?,
            )),
            Ok(_) => Ok(None),
            Err(e) => Err(ModelError::invalid(
                &self.path,
                format!("metadata `{key}`: {e}"),
            )),
        }
    }

    fn required(&self, key: &str) -> Result<u64> {
        self.meta_u64(key)?
            .ok_or_else(|| ModelError::invalid(&self.path, format!("missing metadata `{key}`")))
    }

    /// Hyper-parameters from `<arch>.*` metadata, in config.json spelling.
    pub fn config(&self) -> Result<ModelConfig> {
        let a = &self.arch;
        let hidden = self.required(&format!("{a}.embedding_length"))? as usize;
        let heads = self.required(&format!("{a}.attention.head_count"))? as usize;
        let tokens_len = self
            .file
            .get_metadata_strings("tokenizer.ggml.tokens")
            .ok()
            .flatten()
            .map(|t| t.len());
        let vocab = match self.meta_u64(&format!("{a}.vocab_size"))? {
            Some(v) => v as usize,
            None => tokens_len.ok_or_else(|| ModelError::invalid(&self.path, "no vocab size"))?,
        };
        let has_output = matches!(self.file.get_array("output.weight"), Ok(Some(_)));
        if matches!(self.file.get_array("rope_freqs.weight"), Ok(Some(_))) {
            return Err(ModelError::invalid(
                &self.path,
                "scaled RoPE (`rope_freqs`, Llama 3.1+) is not supported yet",
            ));
        }
        let eos = self.meta_u64("tokenizer.ggml.eos_token_id")?;
        let config = ModelConfig {
            model_type: a.clone(),
            hidden_size: hidden,
            num_hidden_layers: self.required(&format!("{a}.block_count"))? as usize,
            intermediate_size: self.required(&format!("{a}.feed_forward_length"))? as usize,
            num_attention_heads: heads,
            num_key_value_heads: self
                .meta_u64(&format!("{a}.attention.head_count_kv"))?
                .map(|v| v as usize)
                .unwrap_or(heads),
            head_dim: self
                .meta_u64(&format!("{a}.attention.key_length"))?
                .map(|v| v as usize),
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
        };
        config
            .validate()
            .map_err(|e| ModelError::invalid(&self.path, e))?;
        Ok(config)
    }

    /// Every EOS-like id the metadata declares (`eos`, `eot`, `eom`).
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
        Ok(ids)
    }

    /// The tokenizer rebuilt from `tokenizer.ggml.*` (byte-level BPE only).
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        let model = self
            .file
            .get_metadata_string("tokenizer.ggml.model")
            .ok()
            .flatten();
        if model.as_deref() != Some("gpt2") {
            return Err(ModelError::invalid(
                &self.path,
                format!(
                    "tokenizer model {model:?} is not supported (supported: gpt2 byte-level BPE)"
                ),
            ));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            self.file
                .get_metadata_strings(key)
                .ok()
                .flatten()
                .ok_or_else(|| ModelError::invalid(&self.path, format!("missing metadata `{key}`")))
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i32> = match self.file.get_metadata("tokenizer.ggml.token_type") {
            Ok(Some(GgufMetadataValue::Array(a))) => a
                .as_dtype(mlx_rs::Dtype::Int32)?
                .try_as_slice::<i32>()
                .map(|s| s.to_vec())
                .unwrap_or_default(),
            _ => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::invalid(
                &self.path,
                format!(
                    "`tokenizer.ggml.token_type` has {} entries for {} tokens",
                    types.len(),
                    tokens.len()
                ),
            ));
        }
        TextTokenizer::from_gguf_bpe(&tokens, &merges, &types)
    }

    /// `tokenizer.chat_template`, if present.
    pub fn chat_template(&self) -> Option<String> {
        self.file
            .get_metadata_string("tokenizer.chat_template")
            .ok()
            .flatten()
    }

    /// All tensors, renamed to MLX naming, q/k rows un-permuted for half-split
    /// RoPE.
    pub fn tensors(&self, config: &ModelConfig) -> Result<TensorMap> {
        let mut map = TensorMap::new();
        let raw = self
            .file
            .arrays()
            .map_err(|e| ModelError::invalid(&self.path, e))?;
        for (name, array) in raw {
            let Some(mlx_name) = gguf_to_mlx_name(&name) else {
                continue;
            };
            let array = if mlx_name.contains(".self_attn.q_proj.") {
                unpermute_rope_rows(&array, config.num_attention_heads)?
            } else if mlx_name.contains(".self_attn.k_proj.") {
                unpermute_rope_rows(&array, config.num_key_value_heads)?
            } else {
                array
            };
            map.insert(mlx_name, array);
        }
        Ok(map)
    }

    /// The path this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads a GGUF array-valued metadata entry as an [`Array`] (for callers that
/// need raw access).
pub fn metadata_array(g: &Gguf, key: &str) -> Option<Array> {
    g.file.get_metadata_array(key).ok().flatten()
}

/// Checks the magic and version, then walks the header (metadata and tensor
/// infos) to find the data section's required length, failing clearly on a
/// truncated file instead of letting the reader fault.
fn check_header(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.into(),
        source,
    })?;
    let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut r = std::io::BufReader::new(file);
    let bad = |why: String| ModelError::invalid(path, why);
    let trunc = |_: std::io::Error| ModelError::invalid(path, "truncated GGUF header");
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).map_err(trunc)?;
    if &magic != b"GGUF" {
        return Err(bad("not a GGUF file (bad magic)".into()));
    }
    let version = read_u32(&mut r).map_err(trunc)?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!("unsupported GGUF version {version}")));
    }
    let n_tensors = read_u64(&mut r).map_err(trunc)?;
    let n_kv = read_u64(&mut r).map_err(trunc)?;
    let mut alignment = 32u64;
    let mut pos = 24u64;
    for _ in 0..n_kv {
        let key = read_string(&mut r, &mut pos, file_len).map_err(&bad)?;
        let ty = read_u32(&mut r).map_err(trunc)?;
        pos += 4;
        let value = skip_value(&mut r, ty, &mut pos, file_len, 0).map_err(&bad)?;
        if key == "general.alignment" {
            alignment = value.max(1);
        }
    }
    let mut data_needed = 0u64;
    for _ in 0..n_tensors {
        let name = read_string(&mut r, &mut pos, file_len).map_err(&bad)?;
        let n_dims = read_u32(&mut r).map_err(trunc)?;
        pos += 4;
        if n_dims > 8 {
            return Err(bad(format!("tensor `{name}` has {n_dims} dimensions")));
        }
        let mut elems = 1u64;
        for _ in 0..n_dims {
            elems = elems.saturating_mul(read_u64(&mut r).map_err(trunc)?);
            pos += 8;
        }
        let ggml_type = read_u32(&mut r).map_err(trunc)?;
        let offset = read_u64(&mut r).map_err(trunc)?;
        pos += 12;
        let size = ggml_type_size(ggml_type, elems)
            .ok_or_else(|| bad(format!("tensor `{name}` has ggml type {ggml_type}, which MLX cannot load (K-quants and IQ types need conversion)")))?;
        data_needed = data_needed.max(offset.saturating_add(size));
    }
    let data_start = pos.div_ceil(alignment) * alignment;
    if data_start.saturating_add(data_needed) > file_len {
        return Err(bad(format!(
            "truncated: tensor data needs {} bytes, file has {file_len}",
            data_start.saturating_add(data_needed)
        )));
    }
    Ok(())
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_string(
    r: &mut impl Read,
    pos: &mut u64,
    file_len: u64,
) -> std::result::Result<String, String> {
    let len = read_u64(r).map_err(|_| "truncated GGUF header".to_string())?;
    *pos += 8;
    if len > file_len.saturating_sub(*pos) {
        return Err("truncated GGUF header (string runs past the end)".into());
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)
        .map_err(|_| "truncated GGUF header".to_string())?;
    *pos += len;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Skips one metadata value of GGUF type `ty`; returns it when it is an
/// unsigned integer (for `general.alignment`), else 0.
fn skip_value(
    r: &mut impl Read,
    ty: u32,
    pos: &mut u64,
    file_len: u64,
    depth: u32,
) -> std::result::Result<u64, String> {
    if depth > 4 {
        return Err("GGUF metadata arrays nested too deeply".into());
    }
    let trunc = |_| "truncated GGUF header".to_string();
    let fixed = |ty: u32| -> Option<u64> {
        match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    };
    match ty {
        8 => {
            read_string(r, pos, file_len)?;
            Ok(0)
        }
        9 => {
            let elem_ty = read_u32(r).map_err(trunc)?;
            let n = read_u64(r).map_err(trunc)?;
            *pos += 12;
            if let Some(size) = fixed(elem_ty) {
                let bytes = n.saturating_mul(size);
                if bytes > file_len.saturating_sub(*pos) {
                    return Err("truncated GGUF header (array runs past the end)".into());
                }
                std::io::copy(&mut r.take(bytes), &mut std::io::sink()).map_err(trunc)?;
                *pos += bytes;
            } else {
                for _ in 0..n {
                    skip_value(r, elem_ty, pos, file_len, depth + 1)?;
                }
            }
            Ok(0)
        }
        t => {
            let size = fixed(t).ok_or_else(|| format!("unknown GGUF metadata type {t}"))?;
            let mut b = [0u8; 8];
            r.read_exact(&mut b[..size as usize]).map_err(trunc)?;
            *pos += size;
            Ok(u64::from_le_bytes(b))
        }
    }
}

/// Bytes of `elems` elements of the ggml types MLX's reader handles
/// (F32, F16, Q4_0, Q4_1, Q8_0, BF16); `None` for the others.
fn ggml_type_size(ty: u32, elems: u64) -> Option<u64> {
    let blocks = elems.div_ceil(32);
    match ty {
        0 => elems.checked_mul(4),
        1 | 30 => elems.checked_mul(2),
        2 => blocks.checked_mul(18),
        3 => blocks.checked_mul(20),
        8 => blocks.checked_mul(34),
        _ => None,
    }
}
