//! The Gemma 4 graph (`gemma4` / `gemma4_text`: per-layer inputs, KV
//! sharing, sliding and full layers with their own head sizes and RoPE,
//! `attention_k_eq_v`, softcapping) against mlx-lm 0.32.2 on small
//! random-weight models that mlx-lm built and saved itself
//! (tests/fixtures/models/gemma4-tiny and gemma4-tiny-4bit, made by
//! benches/make_gemma4_tiny.py, with mlx-lm's teacher-forced scores). Rows
//! cross the 16-token window; one 300-token row crosses it and the
//! sliding caches' rollback margin. The prompt cache over the same model is
//! in `gemma4_cache.rs`.

use std::collections::HashMap;

use mlx_rs::{ops::indexing::IndexOp, Array};
use mlxhost_e2e::tiny_fixture::{
    self, assert_batched_equals_alone, assert_matches, assert_matches_mlx_lm, edited_copy, fixture,
    load_error, reference, EVERY_PATH,
};

/// Both sides compute in float32 on the same weights (the 4-bit
/// fixture's scales are float32, so every path runs float32 activations),
/// measured within 6e-6 nats on every path; semantics.md's 0.05 would let
/// a wrong norm or scale pass.
const TOL: f32 = 1e-4;

/// Every model here, the 4-bit fixture and edited copies too, scores the
/// float32 fixture's rows.
const ROWS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/models/gemma4-tiny/rows.jsonl"
);

fn score(model: &str, extra: &[&str]) -> Vec<mlxhost::score::ScoreOutput> {
    tiny_fixture::score(model, ROWS, extra)
}

#[test]
fn gemma4_scores_match_mlx_lm() {
    let names = ["gemma4-tiny", "gemma4-tiny-4bit"];
    assert_matches_mlx_lm(&names, |_| ROWS.to_string(), &EVERY_PATH, TOL);
}

/// Rows scored together (one forward per step: a row's prompt chunks beside
/// other rows' decode tokens, each row's sliding and shared layers over its
/// own cache) equal each row scored alone.
#[test]
fn batched_rows_equal_rows_alone() {
    for name in ["gemma4-tiny", "gemma4-tiny-4bit"] {
        assert_batched_equals_alone(&fixture(name), ROWS, "4");
    }
}

/// Renames every tensor whose name starts with `from` to start with `to`.
fn rename_prefix(t: &mut HashMap<String, Array>, from: &str, to: &str) {
    let names: Vec<String> = t.keys().filter(|k| k.starts_with(from)).cloned().collect();
    for name in names {
        if let Some(a) = t.remove(&name) {
            t.insert(format!("{to}{}", &name[from.len()..]), a);
        }
    }
}

/// The same weights as a flat `gemma4_text` checkpoint (`model.*` names,
/// the decoder's fields at the top of config.json) and as Hugging Face
/// ships a `gemma4` one (`model.language_model.*`, with a vision tower and
/// the key/value projections of KV-shared layers that mlx-lm drops) give
/// mlx-lm's scores.
#[test]
fn every_checkpoint_layout_gives_the_same_scores() {
    let theirs = reference("gemma4-tiny");
    let text = edited_copy(
        "gemma4-tiny",
        |t| rename_prefix(t, "language_model.model.", "model."),
        |c| {
            let mut flat = c["text_config"].clone();
            flat["model_type"] = "gemma4_text".into();
            flat["eos_token_id"] = c["eos_token_id"].clone();
            *c = flat;
        },
    );
    let hf = edited_copy(
        "gemma4-tiny",
        |t| {
            rename_prefix(t, "language_model.model.", "model.language_model.");
            let unused = Array::from_slice(&[0.5f32; 16 * 32], &[16, 32]);
            t.insert(
                "model.language_model.layers.4.self_attn.k_proj.weight".into(),
                unused.clone(),
            );
            t.insert("model.vision_tower.patch_embedder.weight".into(), unused);
        },
        |_| {},
    );
    for (label, dir) in [("gemma4_text", &text), ("Hugging Face gemma4", &hf)] {
        let path = dir.path().to_str().expect("utf-8 path");
        assert_matches(label, &score(path, &["--dtype", "float32"]), &theirs, TOL);
    }
}

#[test]
fn missing_or_misshaped_tensors_and_unsupported_fields_are_named() {
    let gate = "language_model.model.layers.1.per_layer_input_gate.weight";
    let dir = edited_copy(
        "gemma4-tiny",
        |t| {
            t.remove(gate);
        },
        |_| {},
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains(gate) && err.contains("missing"), "{err}");

    // A full layer's key projection with the sliding layers' width.
    let k = "language_model.model.layers.2.self_attn.k_proj.weight";
    let dir = edited_copy(
        "gemma4-tiny-4bit",
        |t| {
            let narrow = t[k].index(0..32);
            t.insert(k.into(), narrow);
        },
        |_| {},
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains(k) && err.contains("64 rows"), "{err}");

    // Without `attention_k_eq_v`, full layers take `num_key_value_heads`
    // (1, as mlx-lm reads it), so the checkpoint's 2-head keys are named.
    let dir = edited_copy(
        "gemma4-tiny",
        |_| {},
        |c| c["text_config"]["attention_k_eq_v"] = false.into(),
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains(k) && err.contains("32 rows"), "{err}");
    // With it, a full layer reads no `v_proj`; a sliding one must have its
    // own.
    let v = "language_model.model.layers.0.self_attn.v_proj.weight";
    let dir = edited_copy(
        "gemma4-tiny",
        |t| {
            t.remove(v);
        },
        |_| {},
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains(v) && err.contains("missing"), "{err}");

    // The mixture-of-experts block (26B-A4B) is refused by name.
    let dir = edited_copy(
        "gemma4-tiny",
        |_| {},
        |c| {
            let t = &mut c["text_config"];
            t["enable_moe_block"] = true.into();
            t["num_experts"] = 4.into();
            t["top_k_experts"] = 2.into();
            t["moe_intermediate_size"] = 16.into();
        },
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains("enable_moe_block"), "{err}");
}
