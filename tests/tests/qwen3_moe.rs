//! The `qwen3_moe` graph (Qwen3's attention, sparse layers: router, top-2
//! of 8 experts, renormalised scores, gather_mm / gather_qmm; one dense layer
//! through `mlp_only_layers`) against mlx-lm 0.32.2 on small random-weight
//! Qwen3-MoE models that mlx-lm built and saved itself
//! (tests/fixtures/models/qwen3-moe-tiny and qwen3-moe-tiny-4bit, made by
//! benches/make_qwen3_moe_tiny.py, with mlx-lm's teacher-forced scores).

use std::collections::HashMap;

use mlx_rs::{ops::indexing::IndexOp, Array};
use mlxhost_e2e::*;

/// semantics.md's bound for the native path (the float32 path's is 0.1).
const TOL: f32 = 0.05;

/// Both sides compute in float32 on the same weights (the 4-bit fixture's
/// scales are float32, so even `--dtype native` runs float32 activations),
/// measured within 2e-5 nats. A token sent to a wrong expert can move a
/// logprob by less than [`TOL`], so the test holds this tighter bound.
const FLOAT32_TOL: f32 = 1e-3;

fn fixture(name: &str) -> String {
    format!("{}/fixtures/models/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn score(dir: &str, extra: &[&str]) -> Vec<mlxhost::score::ScoreOutput> {
    let rows = format!("{dir}/rows.jsonl");
    let mut args = vec!["score", "--model", dir, "--input", rows.as_str()];
    args.extend(extra);
    parse_score(&mlxhost_ok(&args))
}

#[test]
fn qwen3_moe_scores_match_mlx_lm() {
    for name in ["qwen3-moe-tiny", "qwen3-moe-tiny-4bit"] {
        let dir = fixture(name);
        let reference = parse_score(
            &std::fs::read_to_string(format!("{dir}/mlx-lm-scores.jsonl")).expect("scores"),
        );
        for extra in [
            &["--dtype", "float32"][..],
            &["--dtype", "auto"],
            &["--dtype", "native"],
            &["--dtype", "float32", "--decode"],
            &["--dtype", "auto", "--decode"],
        ] {
            let ours = score(&dir, extra);
            assert_eq!(ours.len(), reference.len());
            let mut worst = 0f32;
            for (r, (o, t)) in ours.iter().zip(&reference).enumerate() {
                assert_eq!(o.steps.len(), t.steps.len());
                for (s, (so, st)) in o.steps.iter().zip(&t.steps).enumerate() {
                    let gap = (so.logprob - st.logprob).abs();
                    worst = worst.max(gap);
                    assert!(
                        gap <= TOL.min(FLOAT32_TOL),
                        "{name} {extra:?}: row {r} step {s}: {} vs {}",
                        so.logprob,
                        st.logprob
                    );
                    if let Err(e) = check_top(&so.top, &st.top, FLOAT32_TOL) {
                        panic!("{name} {extra:?}: row {r} step {s}: {e}");
                    }
                }
            }
            eprintln!("{name} {extra:?}: largest chosen-token gap {worst:.2e} nats");
        }
    }
}

/// Rows scored together (one forward per step: a row's prompt chunks beside
/// other rows' decode tokens, their tokens routed to different experts in
/// the same sparse layers) equal each row scored alone.
#[test]
fn batched_rows_equal_rows_alone() {
    for name in ["qwen3-moe-tiny", "qwen3-moe-tiny-4bit"] {
        let dir = fixture(name);
        let alone = score(&dir, &["--decode"]);
        let batched = score(
            &dir,
            &["--decode", "--batch-size", "3", "--prefill-chunk", "7"],
        );
        assert_scores_close(&batched, &alone, 1e-4);
        let prefilled_together = score(&dir, &["--batch-size", "3"]);
        assert_scores_close(&prefilled_together, &alone, 1e-4);
    }
}

/// Copies a fixture's files into a temporary directory, with `tensors`
/// edited and `config` edited.
fn broken_copy(
    name: &str,
    edit_tensors: impl FnOnce(&mut HashMap<String, Array>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let src = fixture(name);
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["tokenizer.json", "tokenizer_config.json", "rows.jsonl"] {
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

fn load_error(dir: &tempfile::TempDir) -> String {
    let path = dir.path().to_str().expect("utf-8 path");
    let rows = format!("{path}/rows.jsonl");
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
fn missing_or_misshaped_expert_weights_are_named() {
    let up = "model.layers.2.mlp.switch_mlp.up_proj.weight";
    let dir = broken_copy(
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
    let dir = broken_copy(
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
    let dir = broken_copy("qwen3-moe-tiny", |_| {}, |c| c["num_experts"] = 6.into());
    let err = load_error(&dir);
    assert!(
        err.contains("model.layers.0.mlp.gate.weight") && err.contains("6 rows"),
        "{err}"
    );

    let dir = broken_copy(
        "qwen3-moe-tiny",
        |_| {},
        |c| c["num_experts_per_tok"] = 9.into(),
    );
    let err = load_error(&dir);
    assert!(err.contains("num_experts_per_tok"), "{err}");
}
