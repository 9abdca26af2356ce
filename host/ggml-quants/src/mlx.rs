//! Repacking affine groups into MLX's affine quantized layout (`mx.quantize`,
//! mode `affine`): per row, `weight` `uint32` words holding `32 / bits`
//! codes each, lowest bits first; one scale and bias per group of 32
//! (`w = code * scale + bias`).

use super::{decode_affine, parallel_rows, Affine, Error, GgmlType};

/// One 2-D tensor `[rows, cols]` in MLX's layout.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxAffine {
    /// 4 or 8.
    pub bits: u32,
    /// Always 32.
    pub group_size: usize,
    /// `[rows, cols * bits / 32]` packed codes.
    pub weight: Vec<u32>,
    /// `[rows, cols / 32]`.
    pub scales: Vec<f32>,
    /// `[rows, cols / 32]`.
    pub biases: Vec<f32>,
    /// Whether every weight is reproduced exactly (`false`: the group-16
    /// K-quants Q2_K, Q3_K and Q6_K, requantized to 8 bits per group of 32
    /// from their float32 values, which moves each weight by at most half
    /// an 8-bit step of its group's range).
    pub exact: bool,
}

/// `[rows, cols]` weights of quantized type `ty` (rows of whole blocks, as
/// GGUF stores a 2-D tensor with `ne[0] = cols`) in MLX's layout: 4 bits
/// for codes of up to 4 bits (Q4_0, Q4_1, Q4_K), 8 bits for 5- and 8-bit
/// codes (Q5_0, Q5_1, Q5_K, Q8_0; exact), 8 bits requantized for the
/// group-16 types.
///
/// Errors: a float type, `cols` not a whole number of blocks, truncated
/// data.
pub fn to_mlx_affine(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> Result<MlxAffine, Error> {
    let elems = rows.checked_mul(cols).ok_or(Error::TooLarge)?;
    // Row width must hold whole blocks (and so whole groups of 32).
    ty.bytes_for(cols)?;
    let affine = decode_affine(ty, data, elems)?;
    if affine.group == 32 {
        let bits = if affine.code_bits <= 4 { 4 } else { 8 };
        return Ok(MlxAffine {
            bits,
            group_size: 32,
            weight: pack(&affine.codes, bits),
            scales: affine.scales,
            biases: affine.biases,
            exact: true,
        });
    }
    Ok(requantize_8bit(&affine))
}

/// Packs codes (each `< 2^bits`) into little-endian-first `uint32` words.
fn pack(codes: &[u8], bits: u32) -> Vec<u32> {
    let per = (32 / bits) as usize;
    codes
        .chunks(per)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (k, &q)| w | (q as u32) << (k as u32 * bits))
        })
        .collect()
}

/// Min/max 8-bit affine quantization of each group of 32 of the affine
/// tensor's float values: `scale = (max - min) / 255`, `bias = min`, codes
/// rounded to nearest.
fn requantize_8bit(affine: &Affine) -> MlxAffine {
    let values = affine.values();
    let groups = values.len() / 32;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let parts = parallel_rows(groups, 32 * 4, &bytes, |_, chunk| {
        let n = chunk.len() / (32 * 4);
        let mut codes = vec![0u8; n * 32];
        let mut scales = vec![0f32; n];
        let mut biases = vec![0f32; n];
        for (g, raw) in chunk.chunks_exact(32 * 4).enumerate() {
            let w: Vec<f32> = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let scale = (hi - lo) / 255.0;
            for (k, &x) in w.iter().enumerate() {
                codes[g * 32 + k] = if scale > 0.0 {
                    ((x - lo) / scale).round().clamp(0.0, 255.0) as u8
                } else {
                    0
                };
            }
            scales[g] = scale;
            biases[g] = lo;
        }
        (codes, scales, biases)
    });
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    for (c, s, b) in parts {
        codes.extend(c);
        scales.extend(s);
        biases.extend(b);
    }
    MlxAffine {
        bits: 8,
        group_size: 32,
        weight: pack(&codes, 8),
        scales,
        biases,
        exact: false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn unpack(w: &[u32], bits: u32, n: usize) -> Vec<u8> {
        let per = 32 / bits;
        (0..n)
            .map(|i| ((w[i / per as usize] >> ((i as u32 % per) * bits)) & ((1 << bits) - 1)) as u8)
            .collect()
    }

    #[test]
    fn packs_low_bits_first() {
        assert_eq!(pack(&[1, 2, 3, 4, 5, 6, 7, 8], 4), vec![0x8765_4321]);
        assert_eq!(pack(&[1, 2, 3, 4], 8), vec![0x0403_0201]);
    }

    #[test]
    fn requantized_values_stay_within_half_a_step() {
        // Two Q6_K-like groups of 16 with different scales in one group of 32.
        let affine = Affine {
            group: 16,
            code_bits: 6,
            codes: (0..32).map(|i| (i * 7 % 64) as u8).collect(),
            scales: vec![0.01, 0.03],
            biases: vec![-0.32, -0.96],
        };
        let out = requantize_8bit(&affine);
        let codes = unpack(&out.weight, 8, 32);
        for (k, want) in affine.values().iter().enumerate() {
            let got = codes[k] as f32 * out.scales[0] + out.biases[0];
            assert!(
                (got - want).abs() <= out.scales[0] / 2.0 + 1e-6,
                "{k}: {got} vs {want}"
            );
        }
        assert!(!out.exact);
    }

    #[test]
    fn rejects_rows_of_partial_blocks() {
        let err = to_mlx_affine(GgmlType::Q4K, &[0; 144], 1, 128).unwrap_err();
        assert!(matches!(err, Error::PartialBlock { .. }), "{err}");
    }
}
