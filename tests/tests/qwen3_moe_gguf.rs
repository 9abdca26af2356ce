//! Qwen3-MoE from GGUF (llama.cpp's `qwen3moe`: `qwen3moe.expert_*`
//! metadata, the router `blk.N.ffn_gate_inp` and the stacked experts
//! `blk.N.ffn_{gate,up,down}_exps`) against mlx-lm 0.32.2 on the same
//! random weights: tests/fixtures/models/qwen3-moe-tiny*.gguf, written by
//! gguf-py from the MLX directory qwen3-moe-tiny
//! (benches/make_qwen3_moe_tiny_gguf.py). The F32 file's reference is the
//! directory's mlx-lm scores; the Q8_0 and Q4_0 files' are mlx-lm's on the
//! weights gguf-py dequantizes from them, in float32.

use mlxhost_e2e::tiny_fixture::{self, assert_matches, fixture, read_scores};
use mlxhost_e2e::*;

/// Float32 activations on weights both sides hold exactly (measured within
/// 2e-5 nats): a token sent to a wrong expert moves a logprob by more.
const FLOAT32_TOL: f32 = 1e-4;

/// `--dtype native` on a legacy-quantized GGUF computes in float16
/// (semantics.md's native bound; measured 0.02 chosen, 0.034 top-5).
const NATIVE_TOL: f32 = 0.05;

fn rows() -> String {
    fixture("qwen3-moe-tiny/rows.jsonl")
}

fn score(model: &str, extra: &[&str]) -> Vec<mlxhost::score::ScoreOutput> {
    tiny_fixture::score(model, &rows(), extra)
}

#[test]
fn qwen3_moe_gguf_scores_match_mlx_lm() {
    let cases = [
        (
            "qwen3-moe-tiny.gguf",
            fixture("qwen3-moe-tiny/mlx-lm-scores.jsonl"),
        ),
        (
            "qwen3-moe-tiny.q8_0.gguf",
            fixture("qwen3-moe-tiny.q8_0.mlx-lm-scores.jsonl"),
        ),
        (
            "qwen3-moe-tiny.q4_0.gguf",
            fixture("qwen3-moe-tiny.q4_0.mlx-lm-scores.jsonl"),
        ),
    ];
    for (name, reference) in &cases {
        let model = fixture(name);
        let f32_file = *name == "qwen3-moe-tiny.gguf";
        for extra in [
            &["--dtype", "float32"][..],
            &["--dtype", "auto"],
            &["--dtype", "float32", "--decode"],
            &["--dtype", "auto", "--decode"],
            &["--dtype", "native"],
        ] {
            // An F32 file computes in float32 on every path.
            let tol = if extra.contains(&"native") && !f32_file {
                NATIVE_TOL
            } else {
                FLOAT32_TOL
            };
            let label = format!("{name} {extra:?}");
            assert_matches(&label, &score(&model, extra), &read_scores(reference), tol);
        }
    }
}

/// The GGUF and the MLX directory it was written from give the same scores
/// (float32: the same weights, the same graph).
#[test]
fn gguf_equals_the_mlx_directory() {
    let gguf = score(&fixture("qwen3-moe-tiny.gguf"), &["--dtype", "float32"]);
    let dir = score(&fixture("qwen3-moe-tiny"), &["--dtype", "float32"]);
    assert_scores_close(&gguf, &dir, 1e-5);
}

/// `mlxhost convert` writes a `qwen3_moe` directory (stacked experts as
/// `switch_mlp`, 3-D quantized tensors with per-expert scales) that loads
/// and scores as the GGUF does. Unquantized tensors (norms, the router) are
/// stored in float16 by `convert`, hence the looser bound.
#[test]
fn converted_directory_scores_as_the_gguf() {
    let out = tempfile::tempdir().expect("tempdir");
    for name in ["qwen3-moe-tiny.q8_0.gguf", "qwen3-moe-tiny.q4_0.gguf"] {
        let dir = out.path().join(name);
        let dir_s = dir.to_str().expect("utf-8 path");
        mlxhost_ok(&["convert", &fixture(name), dir_s]);
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).expect("config"),
        )
        .expect("config json");
        assert_eq!(config["model_type"], "qwen3_moe");
        assert_eq!(config["num_experts"], 8);
        assert_eq!(config["mlp_only_layers"], serde_json::json!([1]));
        let converted = score(dir_s, &["--dtype", "float32"]);
        let gguf = score(&fixture(name), &["--dtype", "float32"]);
        assert_scores_close(&converted, &gguf, 0.02);
    }
}

/// A copy of the F32 fixture with `from` replaced by `to` (same length) in
/// its header.
fn patched(from: &[u8], to: &[u8]) -> tempfile::NamedTempFile {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(fixture("qwen3-moe-tiny.gguf")).expect("fixture");
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in the header");
    bytes[at..at + to.len()].copy_from_slice(to);
    let file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("tempfile");
    std::fs::write(file.path(), bytes).expect("write");
    file
}

/// `key`'s u32 value replaced by `value`.
fn patched_u32(key: &str, value: u32) -> tempfile::NamedTempFile {
    let mut bytes = std::fs::read(fixture("qwen3-moe-tiny.gguf")).expect("fixture");
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .expect("key in the header")
        + key.len();
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes(), "{key} is a u32");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    let file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("tempfile");
    std::fs::write(file.path(), bytes).expect("write");
    file
}

fn load_error(file: &tempfile::NamedTempFile) -> String {
    tiny_fixture::load_error(file.path(), &rows())
}

#[test]
fn missing_expert_tensors_and_inconsistent_counts_are_named() {
    let file = patched(b"blk.2.ffn_up_exps.weight", b"blk.2.ffn_up_expX.weight");
    let err = load_error(&file);
    assert!(
        err.contains("`blk.2.ffn_up_exps.weight` is missing"),
        "{err}"
    );

    let file = patched(b"blk.0.ffn_gate_inp.weight", b"blk.0.ffn_gate_inX.weight");
    let err = load_error(&file);
    assert!(
        err.contains("`blk.0.ffn_gate_inp.weight`") && err.contains("missing"),
        "{err}"
    );

    let file = patched_u32("qwen3moe.expert_count", 6);
    let err = load_error(&file);
    assert!(
        err.contains("blk.0.ffn_gate_inp.weight") && err.contains("qwen3moe.expert_count"),
        "{err}"
    );

    let file = patched_u32("qwen3moe.expert_feed_forward_length", 16);
    let err = load_error(&file);
    assert!(err.contains("blk.0.ffn_gate_exps.weight"), "{err}");

    let file = patched_u32("qwen3moe.expert_used_count", 9);
    let err = load_error(&file);
    assert!(
        err.contains("qwen3moe.expert_used_count") && err.contains("qwen3moe.expert_count"),
        "{err}"
    );
}
