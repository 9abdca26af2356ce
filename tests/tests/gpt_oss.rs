//! The gpt-oss graph (`gpt_oss`: attention sinks, alternating sliding and
//! full layers, q/k/v/o biases, YaRN RoPE, a biased router's top-4 of 8
//! experts softmaxed, biased experts through `swiglu_oai`, mxfp4 expert
//! weights) against mlx-lm 0.32.2 on small random-weight models that
//! mlx-lm built and saved itself (tests/fixtures/models/gpt-oss-tiny and
//! gpt-oss-tiny-mxfp4, made by benches/make_gpt_oss_tiny.py, with mlx-lm's
//! teacher-forced scores). Rows cross the 16-token window; one 300-token
//! row crosses it and the sliding caches' rollback margin. The prompt
//! cache over the same model is in `gpt_oss_cache.rs`.

use mlx_rs::{ops, Array};
use mlxhost_e2e::tiny_fixture::{
    self, assert_batched_equals_alone, assert_matches_mlx_lm, edited_copy, fixture, load_error,
    reference, EVERY_PATH,
};

/// Both sides compute in float32 on the same weights (the mxfp4 fixture's
/// affine scales are float32, so every path runs float32 activations),
/// measured within 2e-5 nats on every path; semantics.md's 0.05 would let
/// a wrong sink, bias or clip pass.
const TOL: f32 = 1e-4;

/// Every model here, the mxfp4 fixture and edited copies too, scores the
/// float32 fixture's rows.
const ROWS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/models/gpt-oss-tiny/rows.jsonl"
);

fn score(model: &str, extra: &[&str]) -> Vec<mlxhost::score::ScoreOutput> {
    tiny_fixture::score(model, ROWS, extra)
}

#[test]
fn gpt_oss_scores_match_mlx_lm() {
    let names = ["gpt-oss-tiny", "gpt-oss-tiny-mxfp4"];
    assert_matches_mlx_lm(&names, |_| ROWS.to_string(), &EVERY_PATH, TOL);
}

/// Rows scored together (one forward per step: a row's prompt chunks beside
/// other rows' decode tokens, their tokens routed to different experts in
/// the same layers, each row's sliding layers over its own cache) equal
/// each row scored alone.
#[test]
fn batched_rows_equal_rows_alone() {
    for name in ["gpt-oss-tiny", "gpt-oss-tiny-mxfp4"] {
        assert_batched_equals_alone(&fixture(name), ROWS, "4");
    }
}

fn path(dir: &tempfile::TempDir) -> &str {
    dir.path().to_str().expect("utf-8 path")
}

/// The sinks are read and used: zeroed, the scores move by whole nats
/// (the fixture's sinks are large enough to matter, as trained ones are).
#[test]
fn the_attention_sinks_change_the_scores() {
    let dir = edited_copy(
        "gpt-oss-tiny",
        |t| {
            let names: Vec<String> = t
                .keys()
                .filter(|k| k.ends_with(".sinks"))
                .cloned()
                .collect();
            assert_eq!(names.len(), 4);
            for name in names {
                let zeros = ops::zeros_like(&t[&name]).expect("zeros");
                t.insert(name, zeros);
            }
        },
        |_| {},
    );
    let without = score(path(&dir), &["--dtype", "float32"]);
    let with = reference("gpt-oss-tiny");
    let moved = with
        .iter()
        .zip(&without)
        .flat_map(|(a, b)| a.steps.iter().zip(&b.steps))
        .map(|(a, b)| (a.logprob - b.logprob).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1.0, "zeroing the sinks moved the scores by {moved}");
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    for (name, tensor, edit) in [
        ("gpt-oss-tiny", "model.layers.1.self_attn.sinks", "remove"),
        ("gpt-oss-tiny", "model.layers.2.self_attn.sinks", "shorten"),
        ("gpt-oss-tiny", "model.layers.0.mlp.router.bias", "remove"),
        (
            "gpt-oss-tiny",
            "model.layers.3.self_attn.o_proj.bias",
            "remove",
        ),
        (
            "gpt-oss-tiny",
            "model.layers.3.mlp.experts.down_proj.bias",
            "remove",
        ),
        (
            "gpt-oss-tiny",
            "model.layers.1.mlp.experts.up_proj.weight",
            "shorten",
        ),
        (
            "gpt-oss-tiny-mxfp4",
            "model.layers.0.mlp.experts.gate_proj.scales",
            "remove",
        ),
        (
            "gpt-oss-tiny-mxfp4",
            "model.layers.2.mlp.experts.down_proj.scales",
            "shorten",
        ),
        (
            "gpt-oss-tiny-mxfp4",
            "model.layers.1.self_attn.q_proj.scales",
            "shorten",
        ),
    ] {
        let dir = edited_copy(
            name,
            |t| match edit {
                "remove" => {
                    t.remove(tensor).expect("the tensor exists");
                }
                _ => {
                    // Drop the last entry of the last axis.
                    let a = &t[tensor];
                    let last = a.ndim() - 1;
                    let keep = a.shape()[last] - 1;
                    let idx = Array::from_slice(&(0..keep).collect::<Vec<i32>>(), &[keep]);
                    let short = a.take_axis(&idx, last as i32).expect("take");
                    t.insert(tensor.to_string(), short);
                }
            },
            |_| {},
        );
        let err = load_error(dir.path(), ROWS);
        // Scales are checked against their weight, which the error names
        // (without its scales, a packed weight reads as a dense one of the
        // wrong width).
        let named = tensor.replace(".scales", ".weight");
        assert!(err.contains(&named), "{name}: {edit} {tensor}: {err}");
    }
}

/// Hugging Face's original layout (experts' gate and up fused in
/// `gate_up_proj`, mxfp4 `_blocks`) is refused with a pointer to
/// `mlx_lm.convert`; a config whose expert count disagrees with the weights
/// names the tensor.
#[test]
fn other_layouts_and_inconsistent_configs_are_refused_by_name() {
    let fused = "model.layers.0.mlp.experts.gate_up_proj_blocks";
    let dir = edited_copy(
        "gpt-oss-tiny",
        |t| {
            let w = t["model.layers.0.mlp.experts.gate_proj.weight"].clone();
            t.insert(fused.into(), w);
        },
        |_| {},
    );
    let err = load_error(dir.path(), ROWS);
    assert!(
        err.contains(fused) && err.contains("mlx_lm.convert"),
        "{err}"
    );

    let dir = edited_copy(
        "gpt-oss-tiny",
        |_| {},
        |c| c["num_local_experts"] = 6.into(),
    );
    let err = load_error(dir.path(), ROWS);
    assert!(
        err.contains("model.layers.0.mlp.router.weight") && err.contains("6 rows"),
        "{err}"
    );

    let dir = edited_copy(
        "gpt-oss-tiny",
        |_| {},
        |c| c["layer_types"] = serde_json::json!(["full_attention"]),
    );
    let err = load_error(dir.path(), ROWS);
    assert!(err.contains("layer_types"), "{err}");
}
