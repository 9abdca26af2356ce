//! ggml's tensor block formats, as GGUF files store them, decoded into
//! per-group affine form, float32, or MLX's affine quantized layout.
//!
//! Source: ggml `src/ggml-common.h` (block layouts) and
//! `src/ggml-quants.c` (`dequantize_row_*`). Every quantized type in this
//! crate is affine within groups of 16 or 32 weights: `w = code * scale +
//! bias` with an unsigned integer `code`, which is how [`decode_affine`]
//! returns it. [`dequantize`] evaluates that; [`to_mlx_affine`] repacks it
//! into MLX's `mx.quantize` layout (groups of 32, 4 or 8 bits, low bits
//! first in each `uint32`), exactly where the code fits and by
//! requantization to 8 bits otherwise (the group-16 K-quants).
//!
//! Work is split over rows across the machine's cores (`std::thread`).

mod blocks;
mod mlx;

pub use blocks::{decode_affine, dequantize, Affine};
pub use mlx::{to_mlx_affine, MlxAffine};

/// The ggml tensor types this crate reads (ggml.h `enum ggml_type`, ids as
/// stored in GGUF tensor infos).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit, one f16 scale per 32: `d * (q - 8)`.
    Q4_0,
    /// 4-bit, f16 scale and min per 32: `d * q + m`.
    Q4_1,
    /// 5-bit, one f16 scale per 32: `d * (q - 16)`.
    Q5_0,
    /// 5-bit, f16 scale and min per 32: `d * q + m`.
    Q5_1,
    /// 8-bit signed, one f16 scale per 32: `d * q`.
    Q8_0,
    /// 2-bit super-blocks of 256: 4-bit scale and min per 16.
    Q2K,
    /// 3-bit super-blocks of 256: 6-bit signed scale per 16.
    Q3K,
    /// 4-bit super-blocks of 256: 6-bit scale and min per 32.
    Q4K,
    /// 5-bit super-blocks of 256: 6-bit scale and min per 32.
    Q5K,
    /// 6-bit super-blocks of 256: 8-bit signed scale per 16.
    Q6K,
}

impl GgmlType {
    /// The type for a GGUF tensor-info type id; `None` for ids this crate
    /// does not decode (IQ*, TQ*, Q8_1, Q8_K, integer types, ...).
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's name for a type id (also for ids this crate does not decode,
    /// for error messages).
    pub fn name_of_id(id: u32) -> &'static str {
        const NAMES: [&str; 42] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
            "?",
            "?",
        ];
        NAMES.get(id as usize).copied().unwrap_or("?")
    }

    /// ggml's name (`Q4_K`, `F16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Weights per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            _ => 256,
        }
    }

    /// Bytes per block (ggml-common.h `block_*` sizes).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Whether this is a float type (stored unquantized).
    pub fn is_float(self) -> bool {
        self.block_elems() == 1
    }

    /// Bytes of `elems` weights; errors when `elems` is not a whole number
    /// of blocks.
    pub fn bytes_for(self, elems: usize) -> Result<usize, Error> {
        let be = self.block_elems();
        if !elems.is_multiple_of(be) {
            return Err(Error::PartialBlock {
                ty: self.name(),
                elems,
                block: be,
            });
        }
        (elems / be)
            .checked_mul(self.block_bytes())
            .ok_or(Error::TooLarge)
    }
}

/// Why a tensor could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The row width is not a whole number of the type's blocks.
    #[error("{elems} weights are not a whole number of {ty} blocks of {block}")]
    PartialBlock {
        /// Type name.
        ty: &'static str,
        /// Weights asked for.
        elems: usize,
        /// Weights per block.
        block: usize,
    },
    /// The data is shorter than the shape needs (a truncated file).
    #[error("truncated: {needed} bytes needed, {found} present")]
    Truncated {
        /// Bytes the shape needs.
        needed: usize,
        /// Bytes given.
        found: usize,
    },
    /// The shape overflows `usize`.
    #[error("tensor size overflows")]
    TooLarge,
    /// A float type was given where a quantized one is needed.
    #[error("{0} is not a quantized type")]
    NotQuantized(&'static str),
}

/// Checks `data` holds `elems` weights of `ty`; returns the byte count.
fn check_len(ty: GgmlType, data: &[u8], elems: usize) -> Result<usize, Error> {
    let needed = ty.bytes_for(elems)?;
    if data.len() < needed {
        return Err(Error::Truncated {
            needed,
            found: data.len(),
        });
    }
    Ok(needed)
}

/// Runs `f(first_row, rows_chunk_input, outputs...)` over row ranges on the
/// machine's cores: `rows` rows, each `in_row` input bytes; `f` gets the
/// index of its first row and its slice of the input.
fn parallel_rows<T: Send>(
    rows: usize,
    in_row: usize,
    data: &[u8],
    f: impl Fn(usize, &[u8]) -> T + Sync,
) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(rows.max(1));
    // Small tensors: not worth a thread.
    if threads <= 1 || rows * in_row < (1 << 20) {
        return vec![f(0, &data[..rows * in_row])];
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (lo, hi) = (t * per, ((t + 1) * per).min(rows));
                let f = &f;
                let chunk = &data[lo.min(hi) * in_row..hi * in_row];
                s.spawn(move || f(lo, chunk))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(v) => v,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}
