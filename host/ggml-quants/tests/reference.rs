//! Every type against gguf-py's `dequantize` on random blocks
//! (tests/fixtures/ggml_blocks.json, made by benches/make_ggml_block_fixtures.py),
//! and the MLX layout against the float values.

use ggml_quants::{dequantize, to_mlx_affine, GgmlType};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn cases() -> Vec<(GgmlType, Vec<u8>, Vec<f32>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/ggml_blocks.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("json");
    doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let id = c["id"].as_u64().expect("id") as u32;
            let ty = GgmlType::from_id(id).expect("known type");
            assert_eq!(ty.name(), c["type"].as_str().expect("name"));
            let values = hex(c["values"].as_str().expect("values"))
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (ty, hex(c["blocks"].as_str().expect("blocks")), values)
        })
        .collect()
}

#[test]
fn dequantize_matches_gguf_py_for_every_type() {
    let cases = cases();
    assert_eq!(cases.len(), 13);
    for (ty, blocks, want) in cases {
        let got = dequantize(ty, &blocks, want.len()).expect("decodes");
        assert_eq!(got.len(), want.len(), "{}", ty.name());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // ggml evaluates `d * q - m` in float32; ours is `q * d + (-m)`,
            // which can differ in the last bit.
            assert!(
                (g - w).abs() <= w.abs() * 2e-7 + 1e-9,
                "{} value {i}: {g} vs {w}",
                ty.name()
            );
        }
    }
}

#[test]
fn mlx_layout_reproduces_the_values() {
    for (ty, blocks, want) in cases() {
        if ty.is_float() {
            continue;
        }
        let cols = ty.block_elems();
        let rows = want.len() / cols;
        let m = to_mlx_affine(ty, &blocks, rows, cols).expect("converts");
        let per = 32 / m.bits as usize;
        assert_eq!(m.weight.len(), want.len() / per);
        for (i, w) in want.iter().enumerate() {
            let code = (m.weight[i / per] >> ((i % per) as u32 * m.bits)) & ((1 << m.bits) - 1);
            let got = code as f32 * m.scales[i / 32] + m.biases[i / 32];
            let tol = if m.exact {
                w.abs() * 2e-7 + 1e-9
            } else {
                // Half a step, plus float32 rounding at the tie.
                m.scales[i / 32] / 2.0 * (1.0 + 1e-5) + w.abs() * 1e-6
            };
            assert!(
                (got - w).abs() <= tol,
                "{} value {i}: {got} vs {w} (scale {}, bias {})",
                ty.name(),
                m.scales[i / 32],
                m.biases[i / 32]
            );
        }
        let exact = !matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K);
        assert_eq!(m.exact, exact, "{}", ty.name());
        assert_eq!(
            m.bits,
            if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K) {
                4
            } else {
                8
            }
        );
    }
}

#[test]
fn truncated_data_is_an_error() {
    let err = dequantize(GgmlType::Q8_0, &[0; 33], 32).expect_err("33 bytes hold no Q8_0 block");
    assert_eq!(err.to_string(), "truncated: 34 bytes needed, 33 present");
}
