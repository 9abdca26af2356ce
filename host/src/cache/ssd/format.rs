//! The SSD cache file format, version 4: one file per cache entry (the KV
//! of one token sequence), laid out so a restore can `mmap` it and hand
//! each tensor's bytes to MLX without a copy.
//!
//! ```text
//! offset  size  field
//! 0       8     magic  b"MLXHKV\r\n" (the CR-LF catches text-mode mangling, as PNG's does)
//! 8       4     format version, u32 little-endian (this build writes 4, reads 1 to 4)
//! 12      4     header length H in bytes, u32 little-endian
//! 16      16    XXH3-128 of the header bytes, little-endian
//! 32      H     header: UTF-8 JSON (see [`Header`])
//! ...           zero padding to the first tensor
//! t.offset      tensor bytes, row-major, each tensor starting on a 16384-byte boundary
//! ```
//!
//! The header names the cache key (model fingerprint, KV scheme, tokenizer
//! hash, namespace), the cache kind (`"full"`: every layer holds every
//! position; `"sliding"`, new in version 2: some layers are sliding-window
//! layers that dropped their oldest positions, `layer_starts` says from
//! where each layer's tensors start and `resume_from` how short a restore
//! may trim the entry; `"hybrid"`, new in version 3: some layers are
//! recurrent-state layers (gated DeltaNet), stored as their states at each
//! of `state_positions`, the only lengths a restore may trim the entry
//! to); version 4 adds quantized entries (`--kv-bits`, `cache::quant`):
//! the full-attention layers' tensors are `uint32` packed rows `[1, H_kv,
//! T, P]` and the key's `kv_scheme` names the scheme (`q8g64`), so an entry
//! of one scheme never restores under another), the token ids the KV holds, the file's total
//! length (a truncated file never passes), and per tensor its dtype, shape,
//! offset, length and XXH3-128 hash. The header is always verified; tensor
//! hashes only when asked (`--ssd-cache-verify`), since that reads every
//! byte before the restore can use it.

use std::fs::File;
use std::io::{Read, Write};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// The first eight bytes of every cache file.
pub const MAGIC: [u8; 8] = *b"MLXHKV\r\n";
/// The format version this build writes (3: `hybrid` entries and
/// `state_positions`; 4: quantized KV, `uint32` tensors).
pub const VERSION: u32 = 4;
/// The oldest format version this build still reads (version 1: full
/// caches only, no `layer_starts`; its files load unchanged).
pub const OLDEST_READABLE: u32 = 1;
/// Every tensor starts on a multiple of this: 16 KiB, a page on Apple
/// Silicon as well as on x86 (4 KiB pages), so a backend that can adopt
/// page-aligned host memory may use the mapping in place.
pub const ALIGN: u64 = 16384;
/// Bytes before the header: magic, version, header length, header hash.
const PREFIX_LEN: u64 = 32;
/// A header longer than this is corrupt (a 128k-token entry needs < 1 MiB).
const MAX_HEADER_LEN: u32 = 16 << 20;

/// What a cache entry's KV was computed under. Two entries are
/// interchangeable only when every field is equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryKey {
    /// Model identity: config and weights content (`model::fingerprint`).
    pub model: String,
    /// KV scheme: cache kind and dtype, e.g. `full/float32`.
    pub kv_scheme: String,
    /// Tokenizer identity (`TextTokenizer::fingerprint`).
    pub tokenizer: String,
    /// Prompt-cache namespace (compute path; later the LoRA adapter set).
    pub namespace: String,
}

/// One tensor's place in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// E.g. `layers.3.keys`.
    pub name: String,
    /// `float32`, `float16` or `bfloat16`.
    pub dtype: String,
    /// Row-major shape, e.g. `[1, H_kv, T, D]`.
    pub shape: Vec<u64>,
    /// Byte offset from the start of the file (a multiple of [`ALIGN`]).
    pub offset: u64,
    /// Length in bytes.
    pub nbytes: u64,
    /// XXH3-128 of the bytes, 32 lowercase hex digits.
    pub xxh3: String,
}

/// The JSON header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// What the KV was computed under.
    pub key: EntryKey,
    /// Cache kind: `full` (per-layer keys and values `[1, H_kv, T, D]`)
    /// or `sliding` (layer `l`'s are `[1, H_kv, T - layer_starts[l], D]`).
    pub kind: String,
    /// The token ids whose KV the file holds (`T`).
    pub tokens: Vec<u32>,
    /// Per layer, the first position its tensors hold (version 2, `sliding`
    /// kind; absent: all 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_starts: Vec<u64>,
    /// The fewest leading tokens a restore may keep (`KvCache::min_resume`;
    /// version 2; absent: 0, any prefix).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub resume_from: u64,
    /// `hybrid` kind (version 3): the positions the recurrent layers'
    /// states are stored at, ascending, the last one the entry's length;
    /// a restore keeps exactly one of these many tokens (absent: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_positions: Vec<u64>,
    /// Milliseconds since the Unix epoch when it was written.
    pub created_unix_ms: u64,
    /// Total file length, bytes.
    pub file_len: u64,
    /// Tensors in file order.
    pub tensors: Vec<TensorRecord>,
}

/// Why a file cannot be used. Every variant means "quarantine it"; none is
/// fatal to the server.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The magic is wrong: not one of our files.
    #[error("not an mlxhost KV cache file (bad magic)")]
    Foreign,
    /// Written by another format version.
    #[error("format version {found}; this build reads versions {OLDEST_READABLE} to {VERSION}")]
    Version {
        /// The version in the file.
        found: u32,
    },
    /// Truncated, checksum mismatch, malformed header, tensors out of bounds.
    #[error("corrupt: {0}")]
    Corrupt(String),
    /// Reading failed.
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Bytes per element of a dtype name; `None` for dtypes the KV never uses.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    match dtype {
        // uint32: quantized KV's packed rows (version 4).
        "float32" | "uint32" => Some(4),
        "float16" | "bfloat16" => Some(2),
        _ => None,
    }
}

/// A tensor to write: its bytes may come in several runs (e.g. the valid
/// prefix of each head of a preallocated KV buffer), concatenated in order.
pub struct TensorSource<'a> {
    /// E.g. `layers.3.keys`.
    pub name: String,
    /// `float32`, `float16` or `bfloat16`.
    pub dtype: String,
    /// Row-major shape.
    pub shape: Vec<u64>,
    /// The bytes, in runs.
    pub runs: Vec<&'a [u8]>,
}

fn hex128(v: u128) -> String {
    format!("{v:032x}")
}

fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// What a cache entry's layers hold beyond their tensors: the kind and,
/// for sliding-window layers, where each starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryLayout {
    /// `full` or `sliding`.
    pub kind: String,
    /// Per layer, the first position held (empty: all 0).
    pub layer_starts: Vec<u64>,
    /// The fewest leading tokens a restore may keep.
    pub resume_from: u64,
    /// Where recurrent layers' states are stored (empty: no such layers).
    pub state_positions: Vec<u64>,
}

impl EntryLayout {
    /// Whether an entry with this layout can be trimmed to `n` tokens.
    pub fn resumes_at(&self, n: usize) -> bool {
        resumes_at(self.resume_from, &self.state_positions, n)
    }
}

/// Whether an entry that must keep `resume_from` tokens and holds
/// recurrent states at `state_positions` (empty: none) can be trimmed to
/// `n` tokens.
pub fn resumes_at(resume_from: u64, state_positions: &[u64], n: usize) -> bool {
    n as u64 >= resume_from && (state_positions.is_empty() || state_positions.contains(&(n as u64)))
}

/// Writes a complete entry to `out` (the caller renames it into place
/// after `sync_all`, so a reader never sees a partial file).
///
/// Errors: I/O errors from `out`.
pub fn write_entry(
    out: &mut File,
    key: &EntryKey,
    layout: &EntryLayout,
    tokens: &[u32],
    tensors: &[TensorSource<'_>],
) -> std::io::Result<u64> {
    // Hash each tensor first: the header (which names the hashes) comes
    // before the data.
    let hashes: Vec<String> = tensors
        .iter()
        .map(|t| {
            let mut h = Xxh3::new();
            for r in &t.runs {
                h.update(r);
            }
            hex128(h.digest128())
        })
        .collect();
    let sizes: Vec<u64> = tensors
        .iter()
        .map(|t| t.runs.iter().map(|r| r.len() as u64).sum())
        .collect();
    let created_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    // The header's length depends on the offsets, which depend on the
    // header's length: iterate until the layout is stable (twice at most in
    // practice, since offsets only grow in page steps).
    let mut data_start = align_up(PREFIX_LEN + 1024);
    let (header, header_bytes) = loop {
        let mut offset = data_start;
        let mut records = Vec::with_capacity(tensors.len());
        for ((t, hash), &nbytes) in tensors.iter().zip(&hashes).zip(&sizes) {
            records.push(TensorRecord {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                offset,
                nbytes,
                xxh3: hash.clone(),
            });
            offset = align_up(offset + nbytes);
        }
        let file_len = records
            .last()
            .map(|r| r.offset + r.nbytes)
            .unwrap_or(data_start);
        let header = Header {
            key: key.clone(),
            kind: layout.kind.clone(),
            tokens: tokens.to_vec(),
            layer_starts: layout.layer_starts.clone(),
            resume_from: layout.resume_from,
            state_positions: layout.state_positions.clone(),
            created_unix_ms,
            file_len,
            tensors: records,
        };
        let bytes = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        if bytes.len() > MAX_HEADER_LEN as usize {
            return Err(std::io::Error::other(format!(
                "the header would be {} bytes, over the format's {MAX_HEADER_LEN}",
                bytes.len()
            )));
        }
        let needed = align_up(PREFIX_LEN + bytes.len() as u64);
        if needed <= data_start {
            break (header, bytes);
        }
        data_start = needed;
    };
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut *out);
    w.write_all(&MAGIC)?;
    w.write_all(&VERSION.to_le_bytes())?;
    w.write_all(&(header_bytes.len() as u32).to_le_bytes())?;
    w.write_all(&xxh3_128(&header_bytes).to_le_bytes())?;
    w.write_all(&header_bytes)?;
    let mut pos = PREFIX_LEN + header_bytes.len() as u64;
    for (t, rec) in tensors.iter().zip(&header.tensors) {
        write_zeros(&mut w, rec.offset - pos)?;
        for r in &t.runs {
            w.write_all(r)?;
        }
        pos = rec.offset + rec.nbytes;
    }
    w.flush()?;
    Ok(header.file_len)
}

fn write_zeros(w: &mut impl Write, mut n: u64) -> std::io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Reads and verifies a file's header: magic, version, header checksum,
/// JSON, the file's length, and that every tensor is aligned, in bounds,
/// sized by its dtype and shape, and disjoint from the others.
///
/// Errors: [`FormatError::Foreign`], [`FormatError::Version`],
/// [`FormatError::Corrupt`], [`FormatError::Io`].
pub fn read_header(file: &File) -> Result<Header, FormatError> {
    let actual_len = file.metadata()?.len();
    if actual_len < PREFIX_LEN {
        return Err(FormatError::Corrupt(format!(
            "truncated: {actual_len} bytes is shorter than the fixed prefix"
        )));
    }
    let mut prefix = [0u8; PREFIX_LEN as usize];
    (&*file).read_exact(&mut prefix)?;
    if prefix[..8] != MAGIC {
        return Err(FormatError::Foreign);
    }
    let version = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    if !(OLDEST_READABLE..=VERSION).contains(&version) {
        return Err(FormatError::Version { found: version });
    }
    let header_len = u32::from_le_bytes([prefix[12], prefix[13], prefix[14], prefix[15]]);
    if header_len == 0 || header_len > MAX_HEADER_LEN {
        return Err(FormatError::Corrupt(format!(
            "header length {header_len} out of range"
        )));
    }
    if PREFIX_LEN + header_len as u64 > actual_len {
        return Err(FormatError::Corrupt(format!(
            "truncated: the header needs {} bytes, the file has {actual_len}",
            PREFIX_LEN + header_len as u64
        )));
    }
    let mut want = [0u8; 16];
    want.copy_from_slice(&prefix[16..32]);
    let mut header_bytes = vec![0u8; header_len as usize];
    (&*file).read_exact(&mut header_bytes)?;
    if xxh3_128(&header_bytes) != u128::from_le_bytes(want) {
        return Err(FormatError::Corrupt("header checksum mismatch".into()));
    }
    let header: Header = serde_json::from_slice(&header_bytes)
        .map_err(|e| FormatError::Corrupt(format!("header: {e}")))?;
    if header.file_len != actual_len {
        return Err(FormatError::Corrupt(format!(
            "truncated or extended: the header says {} bytes, the file has {actual_len}",
            header.file_len
        )));
    }
    let mut end_of_previous = PREFIX_LEN + header_len as u64;
    for t in &header.tensors {
        let Some(item) = dtype_size(&t.dtype) else {
            return Err(FormatError::Corrupt(format!(
                "tensor {}: unknown dtype {:?}",
                t.name, t.dtype
            )));
        };
        let elems = t
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(item));
        let in_bounds = t
            .offset
            .checked_add(t.nbytes)
            .is_some_and(|end| end <= actual_len);
        if elems != Some(t.nbytes)
            || !t.offset.is_multiple_of(ALIGN)
            || t.offset < end_of_previous
            || !in_bounds
        {
            return Err(FormatError::Corrupt(format!(
                "tensor {}: bad layout (offset {}, {} bytes, shape {:?})",
                t.name, t.offset, t.nbytes, t.shape
            )));
        }
        end_of_previous = t.offset + t.nbytes;
    }
    Ok(header)
}

/// Checks a tensor's bytes against its recorded hash.
///
/// Errors: [`FormatError::Corrupt`] naming the tensor.
pub fn verify_tensor(record: &TensorRecord, bytes: &[u8]) -> Result<(), FormatError> {
    if hex128(xxh3_128(bytes)) == record.xxh3 {
        Ok(())
    } else {
        Err(FormatError::Corrupt(format!(
            "tensor {}: checksum mismatch",
            record.name
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom};

    fn key() -> EntryKey {
        EntryKey {
            model: "m".into(),
            kv_scheme: "full/float32".into(),
            tokenizer: "t".into(),
            namespace: "Float32".into(),
        }
    }

    /// A hybrid entry (recurrent states stored at some positions) trims
    /// only to those; a full one to any length, a sliding one from
    /// `resume_from` on; the header keeps the positions.
    #[test]
    fn hybrid_entries_resume_only_at_their_state_positions() {
        let hybrid = EntryLayout {
            kind: "hybrid".into(),
            layer_starts: Vec::new(),
            resume_from: 0,
            state_positions: vec![512, 2560, 3899, 3900],
        };
        for (n, ok) in [
            (512, true),
            (513, false),
            (3899, true),
            (3900, true),
            (0, false),
        ] {
            assert_eq!(hybrid.resumes_at(n), ok, "{n}");
        }
        assert!(resumes_at(0, &[], 7));
        assert!(!resumes_at(300, &[], 299) && resumes_at(300, &[], 300));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.kv");
        let mut f = File::create(&path).unwrap();
        let bytes = [0u8; 16];
        let tensors = vec![TensorSource {
            name: "layers.0.ssm@3".into(),
            dtype: "float32".into(),
            shape: vec![1, 1, 2, 2],
            runs: vec![&bytes[..]],
        }];
        let layout = EntryLayout {
            state_positions: vec![2, 3],
            ..hybrid
        };
        write_entry(&mut f, &key(), &layout, &[1, 2, 3], &tensors).unwrap();
        let h = read_header(&File::open(&path).unwrap()).unwrap();
        assert_eq!(h.kind, "hybrid");
        assert_eq!(h.state_positions, vec![2, 3]);
    }

    fn write_sample(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..10_000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let path = dir.join("e.kv");
        let mut f = File::create(&path).unwrap();
        let sources = vec![
            TensorSource {
                name: "layers.0.keys".into(),
                dtype: "float32".into(),
                shape: vec![1, 2, 10, 500],
                runs: vec![&data[..20_000], &data[20_000..]],
            },
            TensorSource {
                name: "layers.0.values".into(),
                dtype: "float32".into(),
                shape: vec![1, 2, 10, 500],
                runs: vec![&data],
            },
        ];
        let layout = EntryLayout {
            kind: "full".into(),
            ..EntryLayout::default()
        };
        write_entry(&mut f, &key(), &layout, &[1, 2, 3, 4, 5], &sources).unwrap();
        (path, data)
    }

    #[test]
    fn round_trips_with_aligned_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_sample(dir.path());
        let file = File::open(&path).unwrap();
        let h = read_header(&file).unwrap();
        assert_eq!(h.key, key());
        assert_eq!(h.tokens, vec![1, 2, 3, 4, 5]);
        let bytes = std::fs::read(&path).unwrap();
        for t in &h.tensors {
            assert_eq!(t.offset % ALIGN, 0);
            let got = &bytes[t.offset as usize..(t.offset + t.nbytes) as usize];
            assert_eq!(got, &data[..]);
            verify_tensor(t, got).unwrap();
        }
    }

    #[test]
    fn version_1_files_still_read_and_version_0_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_sample(dir.path());
        let set_version = |v: u32| {
            let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.seek(SeekFrom::Start(8)).unwrap();
            f.write_all(&v.to_le_bytes()).unwrap();
        };
        // A version-1 file is this layout without `layer_starts`.
        set_version(1);
        let h = read_header(&File::open(&path).unwrap()).unwrap();
        assert!(h.layer_starts.is_empty() && h.resume_from == 0);
        set_version(0);
        let r = read_header(&File::open(&path).unwrap());
        assert!(matches!(r, Err(FormatError::Version { found: 0 })));
    }

    #[test]
    fn truncated_files_fail_the_header_check() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_sample(dir.path());
        let len = std::fs::metadata(&path).unwrap().len();
        for cut in [0, 7, 31, 100, len / 2, len - 1] {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(cut).unwrap();
            let r = read_header(&File::open(&path).unwrap());
            assert!(
                matches!(r, Err(FormatError::Corrupt(_) | FormatError::Foreign)),
                "cut at {cut}: {r:?}"
            );
        }
    }

    #[test]
    fn a_flipped_header_bit_always_fails_and_a_flipped_data_bit_fails_verification() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_sample(dir.path());
        let flip = |at: u64| {
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut b = [0u8; 1];
            f.seek(SeekFrom::Start(at)).unwrap();
            f.read_exact(&mut b).unwrap();
            b[0] ^= 0x10;
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&b).unwrap();
        };
        flip(40);
        assert!(matches!(
            read_header(&File::open(&path).unwrap()),
            Err(FormatError::Corrupt(_))
        ));
        flip(40);
        let h = read_header(&File::open(&path).unwrap()).unwrap();
        let t = &h.tensors[1];
        flip(t.offset + 123);
        let bytes = std::fs::read(&path).unwrap();
        let r = verify_tensor(t, &bytes[t.offset as usize..(t.offset + t.nbytes) as usize]);
        assert!(matches!(r, Err(FormatError::Corrupt(_))));
    }

    #[test]
    fn other_versions_and_foreign_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_sample(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8] = VERSION as u8 + 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_header(&File::open(&path).unwrap()),
            Err(FormatError::Version { found }) if found == VERSION + 1
        ));
        std::fs::write(&path, b"GGUF and then some other bytes, not ours at all").unwrap();
        assert!(matches!(
            read_header(&File::open(&path).unwrap()),
            Err(FormatError::Foreign)
        ));
    }
}
