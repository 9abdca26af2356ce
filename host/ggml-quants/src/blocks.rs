//! One decoder per block layout (ggml-common.h), each writing the block's
//! weights as affine groups: `w = code * scale + bias`.

use half::{bf16, f16};

use super::{check_len, parallel_rows, Error, GgmlType};

/// A tensor's weights as affine groups of `group` consecutive weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    /// Weights per group (16 or 32).
    pub group: usize,
    /// Bits a code needs (2 to 8).
    pub code_bits: u32,
    /// One unsigned code per weight, in order.
    pub codes: Vec<u8>,
    /// One scale per group.
    pub scales: Vec<f32>,
    /// One bias per group.
    pub biases: Vec<f32>,
}

impl Affine {
    /// The weights as float32 (`code * scale + bias`, ggml's arithmetic).
    pub fn values(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.codes.len());
        for ((codes, &s), &b) in self
            .codes
            .chunks(self.group)
            .zip(&self.scales)
            .zip(&self.biases)
        {
            out.extend(codes.iter().map(|&c| c as f32 * s + b));
        }
        out
    }
}

/// The group size and code width of a quantized type.
fn layout(ty: GgmlType) -> Result<(usize, u32), Error> {
    Ok(match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => (32, 4),
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => (32, 5),
        GgmlType::Q8_0 => (32, 8),
        GgmlType::Q2K => (16, 2),
        GgmlType::Q3K => (16, 3),
        GgmlType::Q6K => (16, 6),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            return Err(Error::NotQuantized(ty.name()))
        }
    })
}

/// Decodes `elems` weights of quantized type `ty` from `data` (whole
/// blocks; any bytes past them are ignored).
///
/// Errors: a float type, a partial block, or data shorter than `elems`
/// need.
pub fn decode_affine(ty: GgmlType, data: &[u8], elems: usize) -> Result<Affine, Error> {
    let (group, code_bits) = layout(ty)?;
    check_len(ty, data, elems)?;
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let blocks = elems / be;
    // Rows for the parallel split: runs of blocks.
    let parts = parallel_rows(blocks, bb, data, |_, chunk| {
        let n = chunk.len() / bb;
        let mut codes = vec![0u8; n * be];
        let mut scales = vec![0f32; n * be / group];
        let mut biases = vec![0f32; n * be / group];
        let g = be / group;
        for (i, block) in chunk.chunks_exact(bb).enumerate() {
            decode_block(
                ty,
                block,
                &mut codes[i * be..(i + 1) * be],
                &mut scales[i * g..(i + 1) * g],
                &mut biases[i * g..(i + 1) * g],
            );
        }
        (codes, scales, biases)
    });
    let mut out = Affine {
        group,
        code_bits,
        codes: Vec::with_capacity(elems),
        scales: Vec::with_capacity(elems / group),
        biases: Vec::with_capacity(elems / group),
    };
    for (c, s, b) in parts {
        out.codes.extend(c);
        out.scales.extend(s);
        out.biases.extend(b);
    }
    Ok(out)
}

/// `elems` weights of any type as float32.
///
/// Errors: as [`decode_affine`].
pub fn dequantize(ty: GgmlType, data: &[u8], elems: usize) -> Result<Vec<f32>, Error> {
    let needed = check_len(ty, data, elems)?;
    let data = &data[..needed];
    Ok(match ty {
        GgmlType::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GgmlType::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => decode_affine(ty, data, elems)?.values(),
    })
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// ggml-quants.c `get_scale_min_k4`: the 6-bit scale and min of sub-block
/// `j` (0..8) from a K-quant's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// One block of `ty` into `codes` (block_elems), `scales` and `biases`
/// (one per group).
fn decode_block(ty: GgmlType, b: &[u8], codes: &mut [u8], scales: &mut [f32], biases: &mut [f32]) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let d = half_at(b, 0);
            let (qs, bias) = if ty == GgmlType::Q4_0 {
                (&b[2..18], -8.0 * d)
            } else {
                (&b[4..20], half_at(b, 2))
            };
            for j in 0..16 {
                codes[j] = qs[j] & 0xF;
                codes[j + 16] = qs[j] >> 4;
            }
            scales[0] = d;
            biases[0] = bias;
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let d = half_at(b, 0);
            let (qh_at, bias) = if ty == GgmlType::Q5_0 {
                (2, -16.0 * d)
            } else {
                (4, half_at(b, 2))
            };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            let qs = &b[qh_at + 4..qh_at + 20];
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                codes[j] = (qs[j] & 0xF) | h0;
                codes[j + 16] = (qs[j] >> 4) | h1;
            }
            scales[0] = d;
            biases[0] = bias;
        }
        GgmlType::Q8_0 => {
            let d = half_at(b, 0);
            for j in 0..32 {
                codes[j] = (b[2 + j] as i8 as i16 + 128) as u8;
            }
            scales[0] = d;
            biases[0] = -128.0 * d;
        }
        GgmlType::Q2K => {
            // scales[16], qs[64], d, dmin
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            let mut y = 0;
            let mut is = 0;
            for n in 0..2 {
                let q = &qs[n * 32..n * 32 + 32];
                for shift in [0u32, 2, 4, 6] {
                    for half in 0..2 {
                        let s = sc[is];
                        scales[is] = d * (s & 0xF) as f32;
                        biases[is] = -(dmin * (s >> 4) as f32);
                        for l in 0..16 {
                            codes[y] = (q[l + 16 * half] >> shift) & 3;
                            y += 1;
                        }
                        is += 1;
                    }
                }
            }
        }
        GgmlType::Q3K => {
            // hmask[32], qs[64], scales[12], d
            let (hm, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = half_at(b, 108);
            let mut aux = [0u32; 4];
            for (i, a) in aux.iter_mut().take(3).enumerate() {
                *a = u32::from_le_bytes([
                    packed[4 * i],
                    packed[4 * i + 1],
                    packed[4 * i + 2],
                    packed[4 * i + 3],
                ]);
            }
            const KMASK1: u32 = 0x0303_0303;
            const KMASK2: u32 = 0x0f0f_0f0f;
            let tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
            aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
            aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
            aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
            let sc: Vec<i8> = aux
                .iter()
                .flat_map(|a| a.to_le_bytes())
                .map(|x| x as i8)
                .collect();
            let (mut y, mut is, mut m) = (0, 0, 1u8);
            for n in 0..2 {
                let q = &qs[n * 32..n * 32 + 32];
                for shift in [0u32, 2, 4, 6] {
                    for half in 0..2 {
                        let dl = d * (sc[is] as i32 - 32) as f32;
                        scales[is] = dl;
                        biases[is] = -4.0 * dl;
                        for l in 0..16 {
                            let i = l + 16 * half;
                            let low = (q[i] >> shift) & 3;
                            // The high bit set means +0, clear means -4:
                            // code = low + 4 * bit, value = code - 4.
                            codes[y] = low | if hm[i] & m != 0 { 4 } else { 0 };
                            y += 1;
                        }
                        is += 1;
                    }
                    m <<= 1;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let packed = &b[4..16];
            let (qh, ql) = if ty == GgmlType::Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            let (mut u1, mut u2) = (1u8, 2u8);
            for j in 0..4 {
                let q = &ql[j * 32..j * 32 + 32];
                for (half, u) in [(0usize, u1), (1, u2)] {
                    let g = 2 * j + half;
                    let (s, m) = scale_min_k4(g, packed);
                    scales[g] = d * s as f32;
                    biases[g] = -(dmin * m as f32);
                    for l in 0..32 {
                        let low = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                        let high = match qh {
                            Some(qh) if qh[l] & u != 0 => 16,
                            _ => 0,
                        };
                        codes[g * 32 + l] = low + high;
                    }
                }
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        GgmlType::Q6K => {
            // ql[128], qh[64], scales[16] (int8), d
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = half_at(b, 208);
            for n in 0..2 {
                let (ql, qh) = (&ql[n * 64..n * 64 + 64], &qh[n * 32..n * 32 + 32]);
                let sc = &sc[n * 8..n * 8 + 8];
                let base = n * 128;
                for l in 0..32 {
                    codes[base + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    codes[base + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    codes[base + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    codes[base + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
                // Groups of 16 in order: sub-block is = l / 16 + 2k for the
                // k-th quarter.
                for k in 0..4 {
                    for h in 0..2 {
                        let s = d * sc[h + 2 * k] as i8 as f32;
                        let g = n * 8 + k * 2 + h;
                        scales[g] = s;
                        biases[g] = -32.0 * s;
                    }
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {}
    }
}
