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
use mlxhost_e2e::*;

/// Both sides compute in float32 on the same weights (the 4-bit
/// fixture's scales are float32, so every path runs float32 activations),
/// measured within 6e-6 nats on every path; semantics.md's 0.05 would let
/// a wrong norm or scale pass.
const TOL: f32 = 1e-4;

fn fixture(name: &str) -> String {
    format!("{}/fixtures/models/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn score(dir: &str, extra: &[&str]) -> Vec<mlxhost::score::ScoreOutput> {
    let rows = format!("{}/rows.jsonl", fixture("gemma4-tiny"));
    let mut args = vec!["score", "--model", dir, "--input", rows.as_str()];
    args.extend(extra);
    parse_score(&mlxhost_ok(&args))
}

fn reference(name: &str) -> Vec<mlxhost::score::ScoreOutput> {
    let path = format!("{}/mlx-lm-scores.jsonl", fixture(name));
    parse_score(&std::fs::read_to_string(path).expect("scores"))
}

/// Asserts every step of `ours` is within [`TOL`] of `theirs` (chosen
/// token and shared top-5) and returns the largest chosen-token gap.
fn assert_matches(
    label: &str,
    ours: &[mlxhost::score::ScoreOutput],
    theirs: &[mlxhost::score::ScoreOutput],
) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{label}");
    let mut worst = 0f32;
    for (r, (o, t)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(o.steps.len(), t.steps.len(), "{label}: row {r}");
        for (s, (so, st)) in o.steps.iter().zip(&t.steps).enumerate() {
            let gap = (so.logprob - st.logprob).abs();
            worst = worst.max(gap);
            assert!(
                gap <= TOL,
                "{label}: row {r} step {s}: {} vs {}",
                so.logprob,
                st.logprob
            );
            if let Err(e) = check_top(&so.top, &st.top, TOL) {
                panic!("{label}: row {r} step {s}: {e}");
            }
        }
    }
    worst
}

#[test]
fn gemma4_scores_match_mlx_lm() {
    for name in ["gemma4-tiny", "gemma4-tiny-4bit"] {
        let dir = fixture(name);
        let theirs = reference(name);
        for extra in [
            &["--dtype", "float32"][..],
            &["--dtype", "auto"],
            &["--dtype", "native"],
            &["--dtype", "float32", "--decode"],
            &["--dtype", "auto", "--decode"],
            // Prefill chunks that start inside the window and past it.
            &["--dtype", "auto", "--prefill-chunk", "7"],
        ] {
            let label = format!("{name} {extra:?}");
            let worst = assert_matches(&label, &score(&dir, extra), &theirs);
            eprintln!("{label}: largest chosen-token gap {worst:.2e} nats");
        }
    }
}

/// Rows scored together (one forward per step: a row's prompt chunks beside
/// other rows' decode tokens, each row's sliding and shared layers over its
/// own cache) equal each row scored alone.
#[test]
fn batched_rows_equal_rows_alone() {
    for name in ["gemma4-tiny", "gemma4-tiny-4bit"] {
        let dir = fixture(name);
        let alone = score(&dir, &["--decode"]);
        let batched = score(
            &dir,
            &["--decode", "--batch-size", "4", "--prefill-chunk", "7"],
        );
        assert_scores_close(&batched, &alone, 1e-4);
        let prefilled_together = score(&dir, &["--batch-size", "4"]);
        assert_scores_close(&prefilled_together, &alone, 1e-4);
    }
}

/// A copy of a fixture's directory with its tensors and config edited.
fn edited_copy(
    name: &str,
    edit_tensors: impl FnOnce(&mut HashMap<String, Array>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let src = fixture(name);
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(format!("{src}/{f}"), dir.path().join(f)).expect("copy");
    }
    let mut tensors =
        Array::load_safetensors(format!("{src}/model.safetensors")).expect("load tensors");
    edit_tensors(&mut tensors);
    let meta = HashMap::from([("format".to_string(), "mlx".to_string())]);
    Array::save_safetensors(
        tensors.iter().map(|(k, v)| (k.as_str(), v)),
        &meta,
        dir.path().join("model.safetensors"),
    )
    .expect("save tensors");
    let text = std::fs::read_to_string(format!("{src}/config.json")).expect("config");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("config json");
    edit_config(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");
    dir
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
        let worst = assert_matches(label, &score(path, &["--dtype", "float32"]), &theirs);
        eprintln!("{label}: largest chosen-token gap {worst:.2e} nats");
    }
}

fn load_error(dir: &tempfile::TempDir) -> String {
    let path = dir.path().to_str().expect("utf-8 path");
    let rows = format!("{}/rows.jsonl", fixture("gemma4-tiny"));
    let out = mlxhost(&["score", "--model", path, "--input", &rows]);
    // An error exit (1), never a panic or an abort.
    assert_eq!(
        out.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
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
    let err = load_error(&dir);
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
    let err = load_error(&dir);
    assert!(err.contains(k) && err.contains("64 rows"), "{err}");

    // Without `attention_k_eq_v`, full layers take `num_key_value_heads`
    // (1, as mlx-lm reads it), so the checkpoint's 2-head keys are named.
    let dir = edited_copy(
        "gemma4-tiny",
        |_| {},
        |c| c["text_config"]["attention_k_eq_v"] = false.into(),
    );
    let err = load_error(&dir);
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
    let err = load_error(&dir);
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
    let err = load_error(&dir);
    assert!(err.contains("enable_moe_block"), "{err}");
}
