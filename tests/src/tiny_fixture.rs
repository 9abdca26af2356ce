//! The tiny random-weight model fixtures (`tests/fixtures/models/*-tiny*`,
//! written by mlx-lm through `benches/make_*_tiny*.py`) and how the
//! architecture tests check them: score a fixture with `mlxhost score`,
//! compare with mlx-lm's teacher-forced scores (`mlx-lm-scores.jsonl`), and
//! load edited copies whose errors must name what is wrong.
//!
//! ```no_run
//! use mlxhost_e2e::tiny_fixture::{assert_matches, fixture, reference, score};
//!
//! let dir = fixture("qwen3-moe-tiny");
//! let rows = format!("{dir}/rows.jsonl");
//! let ours = score(&dir, &rows, &["--dtype", "float32"]);
//! assert_matches("qwen3-moe-tiny float32", &ours, &reference("qwen3-moe-tiny"), 1e-3);
//! ```

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;
use mlxhost::score::ScoreOutput;

use crate::{assert_scores_close, check_top, mlxhost, mlxhost_ok, parse_score};

/// The path of `tests/fixtures/models/<name>` (a directory or a file).
pub fn fixture(name: &str) -> String {
    format!("{}/fixtures/models/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `mlxhost score --model <model> --input <rows> <extra…>`, parsed.
pub fn score(model: &str, rows: &str, extra: &[&str]) -> Vec<ScoreOutput> {
    let mut args = vec!["score", "--model", model, "--input", rows];
    args.extend(extra);
    parse_score(&mlxhost_ok(&args))
}

/// A score file (`mlxhost score`'s format), parsed.
pub fn read_scores(path: &str) -> Vec<ScoreOutput> {
    parse_score(&std::fs::read_to_string(path).expect("scores"))
}

/// mlx-lm's teacher-forced scores of fixture `name` (its
/// `mlx-lm-scores.jsonl`).
pub fn reference(name: &str) -> Vec<ScoreOutput> {
    read_scores(&format!("{}/mlx-lm-scores.jsonl", fixture(name)))
}

/// Asserts every step of `ours` is within `tol` nats of `theirs`: the chosen
/// token's logprob, and the top-5 by [`check_top`]. Prints and returns the
/// largest chosen-token gap; `label` names the case in both.
pub fn assert_matches(label: &str, ours: &[ScoreOutput], theirs: &[ScoreOutput], tol: f32) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{label}");
    let mut worst = 0f32;
    for (r, (o, t)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(o.steps.len(), t.steps.len(), "{label}: row {r}");
        for (s, (so, st)) in o.steps.iter().zip(&t.steps).enumerate() {
            let gap = (so.logprob - st.logprob).abs();
            worst = worst.max(gap);
            assert!(
                gap <= tol,
                "{label}: row {r} step {s}: {} vs {}",
                so.logprob,
                st.logprob
            );
            if let Err(e) = check_top(&so.top, &st.top, tol) {
                panic!("{label}: row {r} step {s}: {e}");
            }
        }
    }
    eprintln!("{label}: largest chosen-token gap {worst:.2e} nats");
    worst
}

/// The compute paths each architecture's parity test scores: float32,
/// `auto`, `native`, token-by-token decode on float32 and `auto`, and
/// 7-token prefill chunks (which start inside and past a sliding window,
/// and inside a DeltaNet block).
pub const EVERY_PATH: [&[&str]; 6] = [
    &["--dtype", "float32"],
    &["--dtype", "auto"],
    &["--dtype", "native"],
    &["--dtype", "float32", "--decode"],
    &["--dtype", "auto", "--decode"],
    &["--dtype", "auto", "--prefill-chunk", "7"],
];

/// A fixture directory's own rows (`<dir>/rows.jsonl`; edited copies carry
/// them).
pub fn own_rows(dir: &str) -> String {
    format!("{dir}/rows.jsonl")
}

/// Asserts each fixture of `names`, scoring `rows(its dir)` on each of
/// `paths`, is within `tol` nats of mlx-lm's reference ([`assert_matches`]).
pub fn assert_matches_mlx_lm(
    names: &[&str],
    rows: impl Fn(&str) -> String,
    paths: &[&[&str]],
    tol: f32,
) {
    for name in names {
        let dir = fixture(name);
        let theirs = reference(name);
        for extra in paths {
            let label = format!("{name} {extra:?}");
            assert_matches(&label, &score(&dir, &rows(&dir), extra), &theirs, tol);
        }
    }
}

/// Asserts `model`'s rows scored together, `batch_size` at a time (one
/// forward per step: a row's prompt chunks of 7 beside other rows' decode
/// tokens, and separately the prompts prefilled together), equal each row
/// scored alone (`--decode`), within 1e-4 nats.
pub fn assert_batched_equals_alone(model: &str, rows: &str, batch_size: &str) {
    assert_batched_equals_alone_within(model, rows, batch_size, 1e-4);
}

/// [`assert_batched_equals_alone`] within `tol` nats.
pub fn assert_batched_equals_alone_within(model: &str, rows: &str, batch_size: &str, tol: f32) {
    let alone = score(model, rows, &["--decode"]);
    let batched = score(
        model,
        rows,
        &[
            "--decode",
            "--batch-size",
            batch_size,
            "--prefill-chunk",
            "7",
        ],
    );
    assert_scores_close(&batched, &alone, tol);
    let prefilled_together = score(model, rows, &["--batch-size", batch_size]);
    assert_scores_close(&prefilled_together, &alone, tol);
}

/// A copy of fixture directory `name` (its tokenizer files and rows.jsonl)
/// with its tensors and config.json edited; tensors are saved as mlx-lm
/// saves them (`format: mlx`).
pub fn edited_copy(
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

/// Scores `rows` with a model that must fail to load: asserts an error exit
/// (1), never a panic or an abort, and returns its stderr.
pub fn load_error(model: &Path, rows: &str) -> String {
    let model = model.to_str().expect("utf-8 path");
    let out = mlxhost(&["score", "--model", model, "--input", rows]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}
