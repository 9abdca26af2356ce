//! The `qwen3_5` graph (Qwen3.5's hybrid: gated-DeltaNet linear attention
//! with its causal conv1d and recurrent state in three of every four
//! layers, gated full attention with per-head q/k norms and partial RoPE in
//! the rest) against mlx-lm 0.32.2 on small random-weight models that
//! mlx-lm built and saved itself (tests/fixtures/models/qwen3.5-tiny and
//! qwen3.5-tiny-4bit, made by benches/make_qwen3_5_tiny.py, with mlx-lm's
//! teacher-forced scores). Rows of 150 and 70 tokens cross the 64-token
//! blocks of the chunked DeltaNet prefill. The prompt cache over the same
//! model (recurrent-state checkpoints) is in `qwen3_5_cache.rs`.

use mlx_rs::ops::indexing::IndexOp;
use mlxhost_e2e::tiny_fixture::{
    self, assert_batched_equals_alone_within, assert_matches_mlx_lm, edited_copy, fixture,
    own_rows, EVERY_PATH,
};

/// Both sides compute in float32 on the same weights (the 4-bit fixture's
/// scales are float32, so every path runs float32 activations), measured
/// within 5e-5 nats on every path; semantics.md's 0.05 would let a wrong
/// gate or decay pass.
const TOL: f32 = 1e-3;

/// Teacher-forced top-5 against mlx-lm with the prompt prefilled in one
/// pass (the chunked rule over 64-token blocks), in 7-token chunks (the
/// state carried between forwards) and token by token (the recurrent
/// form), on every compute path.
#[test]
fn qwen3_5_scores_match_mlx_lm() {
    let names = ["qwen3.5-tiny", "qwen3.5-tiny-4bit"];
    assert_matches_mlx_lm(&names, own_rows, &EVERY_PATH, TOL);
}

/// Rows scored together (one forward per step: a row's prompt chunks
/// beside other rows' decode tokens, the decoding rows' recurrent states
/// stepped as one `[B, ...]` batch that rows join and leave) equal each row
/// scored alone.
///
/// The 4-bit fixture runs the CPU's packed integer kernel where one row
/// decodes alone and the dequantized tiles where several rows share a
/// product; the two round differently (measured 1.4e-4 nats at 4 rows,
/// 7e-5 with `MLXHOST_QUANTIZED_LAYOUT=mlx`), hence its wider bound.
#[test]
fn batched_rows_equal_rows_alone() {
    for (name, tol) in [("qwen3.5-tiny", 1e-4), ("qwen3.5-tiny-4bit", 5e-4)] {
        let dir = fixture(name);
        for batch in ["2", "4"] {
            assert_batched_equals_alone_within(&dir, &own_rows(&dir), batch, tol);
        }
    }
}

/// The load error of an edited copy, scoring the rows it carries.
fn load_error(dir: &tempfile::TempDir) -> String {
    let path = dir.path().to_str().expect("utf-8 path");
    tiny_fixture::load_error(dir.path(), &own_rows(path))
}

#[test]
fn missing_misshaped_or_unconverted_weights_are_named() {
    let a_log = "language_model.model.layers.0.linear_attn.A_log";
    let dir = edited_copy(
        "qwen3.5-tiny",
        |t| {
            t.remove(a_log);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(a_log) && err.contains("missing"), "{err}");

    // Hugging Face's conv layout `[C, 1, K]`: convert with mlx-lm.
    let conv = "language_model.model.layers.1.linear_attn.conv1d.weight";
    let dir = edited_copy(
        "qwen3.5-tiny",
        |t| {
            let w = t[conv].swap_axes(1, 2).expect("swap");
            t.insert(conv.into(), w);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(
        err.contains(conv) && err.contains("mlx_lm.convert"),
        "{err}"
    );

    // A config whose value heads disagree with the weights.
    let dir = edited_copy(
        "qwen3.5-tiny",
        |_| {},
        |c| c["text_config"]["linear_num_value_heads"] = 2.into(),
    );
    let err = load_error(&dir);
    assert!(err.contains("linear_attn"), "{err}");

    // The 4-bit checkpoint's scales cut short.
    let scales = "language_model.model.layers.2.linear_attn.in_proj_qkv.scales";
    let dir = edited_copy(
        "qwen3.5-tiny-4bit",
        |t| {
            let s = t[scales].index(0..4);
            t.insert(scales.into(), s);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(scales), "{err}");

    // Qwen3.5's mixture of experts is another architecture.
    let dir = edited_copy(
        "qwen3.5-tiny",
        |_| {},
        |c| c["text_config"]["num_experts"] = 4.into(),
    );
    let err = load_error(&dir);
    assert!(err.contains("num_experts"), "{err}");
}
