//! The GGUF container: header, metadata key/values and tensor infos parsed
//! by us, tensor data memory-mapped.
//!
//! Format: ggml `docs/gguf.md`, versions 2 and 3 (little-endian). Every
//! length and offset is checked against the file's size before it is used,
//! so a truncated or corrupt file is an error naming it, never a fault.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::error::{ModelError, Result};

/// One metadata value (`gguf_metadata_value_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Any unsigned integer type (uint8 ... uint64).
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// float32 or float64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string (invalid bytes replaced).
    Str(String),
    /// An array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::Uint(v) => Some(v),
            MetaValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(v) => Some(v),
            MetaValue::Uint(v) => Some(v as f64),
            MetaValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Where one tensor's data lies and how it is encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// GGUF tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// `ne[0], ne[1], ...`: `ne[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    path: PathBuf,
    /// Metadata by key.
    pub metadata: HashMap<String, MetaValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    mmap: memmap2::Mmap,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| format!("truncated GGUF header at byte {}", self.pos))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| "string length overflows".to_string())?;
        Ok(String::from_utf8_lossy(self.take(len)?).into_owned())
    }

    fn value(&mut self, ty: u32, depth: u32) -> std::result::Result<MetaValue, String> {
        let fixed = |c: &mut Self, n: usize| -> std::result::Result<[u8; 8], String> {
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(c.take(n)?);
            Ok(a)
        };
        Ok(match ty {
            0 => MetaValue::Uint(fixed(self, 1)?[0] as u64),
            1 => MetaValue::Int(fixed(self, 1)?[0] as i8 as i64),
            2 => {
                let b = self.take(2)?;
                MetaValue::Uint(u16::from_le_bytes([b[0], b[1]]) as u64)
            }
            3 => {
                let b = self.take(2)?;
                MetaValue::Int(i16::from_le_bytes([b[0], b[1]]) as i64)
            }
            4 => MetaValue::Uint(self.u32()? as u64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_bits(self.u32()?) as f64),
            7 => MetaValue::Bool(fixed(self, 1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 3 {
                    return Err("GGUF metadata arrays nested too deeply".into());
                }
                let elem_ty = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count beyond the
                // rest of the file is corrupt, not an allocation to try.
                if n > (self.bytes.len() - self.pos) as u64 {
                    return Err("truncated GGUF header (array runs past the end)".into());
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::Uint(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64()?)),
            t => return Err(format!("unknown GGUF metadata type {t}")),
        })
    }
}

impl GgufFile {
    /// Maps `path` and parses its header. Errors name the file: not a GGUF
    /// file, an unsupported version, a truncated header, or tensor data
    /// that runs past the end of the file (naming the tensor).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile(path.into()),
            _ => ModelError::Io {
                path: path.into(),
                source,
            },
        })?;
        // SAFETY: a read-only map of a model file we never write; a
        // concurrent writer could change weights under us, as with any
        // mmap-loading runtime (llama.cpp, MLX).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.into(),
            source,
        })?;
        let (metadata, tensors, data_start) =
            parse(&mmap).map_err(|why| ModelError::invalid(path, why))?;
        Ok(GgufFile {
            path: path.into(),
            metadata,
            tensors,
            mmap,
            data_start,
        })
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The info of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor: from its offset to the end of the file
    /// (callers take what its type and shape need; the decoders check the
    /// length).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_start.saturating_add(info.offset as usize);
        self.mmap.get(start..).unwrap_or(&[])
    }

    /// The path this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

type Parsed = (HashMap<String, MetaValue>, Vec<TensorInfo>, usize);

fn parse(bytes: &[u8]) -> std::result::Result<Parsed, String> {
    let mut c = Cursor { bytes, pos: 0 };
    if c.take(4)
        .map_err(|_| "not a GGUF file (too short)".to_string())?
        != b"GGUF"
    {
        return Err("not a GGUF file (bad magic)".into());
    }
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version}"));
    }
    let n_tensors = c.u64()?;
    let n_kv = c.u64()?;
    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let key = c.string()?;
        let ty = c.u32()?;
        let value = c
            .value(ty, 0)
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        metadata.insert(key, value);
    }
    let alignment = metadata
        .get("general.alignment")
        .and_then(MetaValue::as_u64)
        .unwrap_or(32)
        .max(1) as usize;
    if n_tensors > (bytes.len() / 24) as u64 {
        return Err(format!(
            "header claims {n_tensors} tensors, more than the file can hold"
        ));
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = c.string()?;
        let n_dims = c.u32()?;
        if n_dims == 0 || n_dims > 4 {
            return Err(format!("tensor `{name}` has {n_dims} dimensions"));
        }
        let dims = (0..n_dims)
            .map(|_| c.u64())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let type_id = c.u32()?;
        let offset = c.u64()?;
        tensors.push(TensorInfo {
            name,
            dims,
            type_id,
            offset,
        });
    }
    let data_start = c.pos.div_ceil(alignment) * alignment;
    for t in &tensors {
        let Some(ty) = ggml_quants::GgmlType::from_id(t.type_id) else {
            return Err(format!(
                "tensor `{}` has ggml type {} ({}), which mlxhost cannot decode",
                t.name,
                t.type_id,
                ggml_quants::GgmlType::name_of_id(t.type_id)
            ));
        };
        let elems =
            usize::try_from(t.elems()).map_err(|_| format!("tensor `{}` is too large", t.name))?;
        let size = ty
            .bytes_for(elems)
            .map_err(|e| format!("tensor `{}`: {e}", t.name))?;
        let end = data_start
            .checked_add(t.offset as usize)
            .and_then(|s| s.checked_add(size));
        match end {
            Some(end) if end <= bytes.len() => {}
            _ => {
                return Err(format!(
                    "truncated: tensor `{}` needs bytes up to {}, the file has {}",
                    t.name,
                    end.map(|e| e.to_string())
                        .unwrap_or_else(|| "overflow".into()),
                    bytes.len()
                ))
            }
        }
    }
    Ok((metadata, tensors, data_start))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF v3: one string, one u32 array, one F32 tensor [2, 3].
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(2u64.to_le_bytes()); // kv
        let s = |b: &mut Vec<u8>, t: &str| {
            b.extend((t.len() as u64).to_le_bytes());
            b.extend(t.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "ids");
        b.extend(9u32.to_le_bytes());
        b.extend(4u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(7u32.to_le_bytes());
        b.extend(9u32.to_le_bytes());
        s(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for v in 0..6 {
            b.extend((v as f32).to_le_bytes());
        }
        b
    }

    #[test]
    fn parses_metadata_and_tensor_infos() {
        let (meta, tensors, start) = parse(&tiny_gguf()).expect("parses");
        assert_eq!(meta["general.architecture"].as_str(), Some("llama"));
        assert_eq!(
            meta["ids"],
            MetaValue::Array(vec![MetaValue::Uint(7), MetaValue::Uint(9)])
        );
        assert_eq!(tensors[0].dims, vec![3, 2]);
        assert_eq!(start % 32, 0);
    }

    #[test]
    fn truncation_names_the_tensor() {
        let mut b = tiny_gguf();
        b.truncate(b.len() - 4);
        let err = parse(&b).expect_err("truncated");
        assert!(err.contains("tensor `w`"), "{err}");
        let err = parse(&b[..40]).expect_err("truncated header");
        assert!(err.contains("truncated GGUF header"), "{err}");
        assert!(parse(b"GGML....").expect_err("magic").contains("bad magic"));
    }
}
