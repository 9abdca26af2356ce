//! The `qwen3_moe` graph (Qwen3's attention, sparse layers: router, top-2
//! of 8 experts, renormalised scores, gather_mm / gather_qmm; one dense layer
//! through `mlp_only_layers`) against mlx-lm 0.32.2 on small random-weight
//! Qwen3-MoE models that mlx-lm built and saved itself
//! (tests/fixtures/models/qwen3-moe-tiny and qwen3-moe-tiny-4bit, made by
//! benches/make_qwen3_moe_tiny.py, with mlx-lm's teacher-forced scores).

use mlx_rs::ops::indexing::IndexOp;
use mlxhost_e2e::tiny_fixture::{
    self, assert_batched_equals_alone, assert_matches_mlx_lm, edited_copy, fixture, own_rows,
    EVERY_PATH,
};

/// semantics.md's bound for the native path (the float32 path's is 0.1).
const TOL: f32 = 0.05;

/// Both sides compute in float32 on the same weights (the 4-bit fixture's
/// scales are float32, so even `--dtype native` runs float32 activations),
/// measured within 2e-5 nats. A token sent to a wrong expert can move a
/// logprob by less than [`TOL`], so the test holds this tighter bound.
const FLOAT32_TOL: f32 = 1e-3;

#[test]
fn qwen3_moe_scores_match_mlx_lm() {
    let names = ["qwen3-moe-tiny", "qwen3-moe-tiny-4bit"];
    // The chosen token within both bounds, the top-5 within the float32 one.
    assert_matches_mlx_lm(&names, own_rows, &EVERY_PATH[..5], TOL.min(FLOAT32_TOL));
}

/// Rows scored together (one forward per step: a row's prompt chunks beside
/// other rows' decode tokens, their tokens routed to different experts in
/// the same sparse layers) equal each row scored alone.
#[test]
fn batched_rows_equal_rows_alone() {
    for name in ["qwen3-moe-tiny", "qwen3-moe-tiny-4bit"] {
        let dir = fixture(name);
        assert_batched_equals_alone(&dir, &own_rows(&dir), "3");
    }
}

/// The load error of an edited copy, scoring the rows it carries.
fn load_error(dir: &tempfile::TempDir) -> String {
    let path = dir.path().to_str().expect("utf-8 path");
    tiny_fixture::load_error(dir.path(), &own_rows(path))
}

#[test]
fn missing_or_misshaped_expert_weights_are_named() {
    let up = "model.layers.2.mlp.switch_mlp.up_proj.weight";
    let dir = edited_copy(
        "qwen3-moe-tiny",
        |t| {
            t.remove(up);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(up) && err.contains("missing"), "{err}");

    // The 4-bit checkpoint's scales from another expert count.
    let scales = "model.layers.0.mlp.switch_mlp.down_proj.scales";
    let dir = edited_copy(
        "qwen3-moe-tiny-4bit",
        |t| {
            let s = t[scales].index(0..4);
            t.insert(scales.into(), s);
        },
        |_| {},
    );
    let err = load_error(&dir);
    assert!(err.contains(scales), "{err}");

    // A config whose expert count disagrees with the weights.
    let dir = edited_copy("qwen3-moe-tiny", |_| {}, |c| c["num_experts"] = 6.into());
    let err = load_error(&dir);
    assert!(
        err.contains("model.layers.0.mlp.gate.weight") && err.contains("6 rows"),
        "{err}"
    );

    let dir = edited_copy(
        "qwen3-moe-tiny",
        |_| {},
        |c| c["num_experts_per_tok"] = 9.into(),
    );
    let err = load_error(&dir);
    assert!(err.contains("num_experts_per_tok"), "{err}");
}
