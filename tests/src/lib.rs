//! Helpers for the end-to-end tests: locating the binary and the installed
//! model, running commands, and the parity comparison `semantics.md` defines.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::Deserialize;

pub mod requests;
pub mod sliding_cache;
pub mod tiny_fixture;

/// One case of `fixtures/smollm2-greedy.json` (mlx-lm reference outputs).
#[derive(Debug, Clone, Deserialize)]
pub struct ReferenceCase {
    /// Chat messages.
    pub messages: Vec<mlxhost::model::ChatMessage>,
    /// Prompt ids after the chat template.
    pub prompt_ids: Vec<u32>,
    /// mlx-lm's greedy continuation.
    pub greedy_ids: Vec<u32>,
    /// Teacher-forced top-5 per step.
    pub teacher_forced_top5: Vec<ReferenceStep>,
    /// Top-1/top-2 margin per step, in nats.
    pub step_margins: Vec<f32>,
}

/// One teacher-forced step of the reference.
#[derive(Debug, Clone, Deserialize)]
pub struct ReferenceStep {
    /// The reference token at this step.
    pub token: u32,
    /// `[id, logprob]`, descending.
    pub top5: Vec<(u32, f32)>,
}

/// The reference cases.
pub fn reference() -> Vec<ReferenceCase> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2-greedy.json");
    let text = std::fs::read_to_string(&path).expect("fixture present");
    serde_json::from_str(&text).expect("fixture parses")
}

/// The `mlxhost` binary: `$MLXHOST_BIN`, else the workspace target dir's
/// release build if newer, else its debug build.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MLXHOST_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let candidates = [target.join("release/mlxhost"), target.join("debug/mlxhost")];
    let newest = candidates
        .iter()
        .filter_map(|p| Some((std::fs::metadata(p).ok()?.modified().ok()?, p.clone())))
        .max()
        .map(|(_, p)| p);
    newest.unwrap_or_else(|| {
        panic!(
            "no mlxhost binary under {}: run `cargo build` first (or set MLXHOST_BIN)",
            target.display()
        )
    })
}

/// The installed default model (scripts/setup.sh).
pub fn model_path() -> PathBuf {
    let p = mlxhost::model::default_model_path();
    assert!(
        p.is_file(),
        "model not installed at {}: run scripts/setup.sh",
        p.display()
    );
    p
}

/// Runs `mlxhost <args>` and returns its output.
pub fn mlxhost(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("run mlxhost")
}

/// Runs `mlxhost <args>`, asserting success, and returns stdout.
pub fn mlxhost_ok(args: &[&str]) -> String {
    let out = mlxhost(args);
    assert!(
        out.status.success(),
        "mlxhost {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// As [`mlxhost_ok`], with extra environment variables.
pub fn mlxhost_ok_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(binary())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run mlxhost");
    assert!(
        out.status.success(),
        "mlxhost {args:?} ({env:?}) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Parsed `mlxhost score` output: per line, per step `(token, logprob, top)`.
pub fn parse_score(stdout: &str) -> Vec<mlxhost::score::ScoreOutput> {
    stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("score output line"))
        .collect()
}

/// `semantics.md`'s top-5 parity check of one step against a reference
/// top-5 (`ref_top`) with tolerance `tol` nats: every reference id in our top
/// agrees within `tol`; a reference id may be missing from ours only when its
/// value is within `tol` of our last value. Returns a description of the
/// first violation.
pub fn check_top(ours: &[(u32, f32)], ref_top: &[(u32, f32)], tol: f32) -> Result<(), String> {
    let last = ours.last().map(|x| x.1).unwrap_or(f32::NEG_INFINITY);
    for &(id, v) in ref_top {
        match ours.iter().find(|x| x.0 == id) {
            Some(&(_, o)) if (o - v).abs() <= tol => {}
            Some(&(_, o)) => return Err(format!("id {id}: ours {o:.4}, reference {v:.4}")),
            None if (v - last).abs() <= tol || v < last => {}
            None => {
                return Err(format!(
                    "id {id} ({v:.4}) missing from our top (last {last:.4})"
                ))
            }
        }
    }
    Ok(())
}

/// Asserts two score outputs are "the same" (`semantics.md`): chosen-token
/// logprobs and shared top entries within `tol`.
pub fn assert_scores_close(
    a: &[mlxhost::score::ScoreOutput],
    b: &[mlxhost::score::ScoreOutput],
    tol: f32,
) {
    assert_eq!(a.len(), b.len(), "row counts differ");
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.steps.len(), y.steps.len(), "row {r}: step counts differ");
        for (s, (p, q)) in x.steps.iter().zip(&y.steps).enumerate() {
            assert_eq!(p.token, q.token);
            assert!(
                (p.logprob - q.logprob).abs() <= tol,
                "row {r} step {s}: {} vs {}",
                p.logprob,
                q.logprob
            );
            if let Err(e) = check_top(&p.top, &q.top, tol) {
                panic!("row {r} step {s}: {e}");
            }
        }
    }
}

/// Writes score input lines (prompt ids + continuation ids) to a temp file.
pub fn score_input(rows: &[(Vec<u32>, Vec<u32>)]) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    for (p, c) in rows {
        let line = serde_json::json!({ "prompt_ids": p, "continuation_ids": c });
        writeln!(f, "{line}").expect("write input");
    }
    f
}

/// The repository's `plugins/` folder (built by scripts/build-plugins.sh).
pub fn plugins_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins");
    assert!(
        dir.join("standard/standard.wasm").is_file(),
        "plugins are not built: run scripts/build-plugins.sh"
    );
    dir
}

/// A temporary plugins folder holding copies of the named plugin folders
/// (from `plugins/` or `plugins/testing/`).
pub fn plugin_folder_with(names: &[&str]) -> tempfile::TempDir {
    let root = plugins_dir();
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in names {
        let src = [root.join(name), root.join("testing").join(name)]
            .into_iter()
            .find(|p| p.join("plugin.toml").is_file())
            .unwrap_or_else(|| panic!("no plugin folder `{name}`"));
        let dst = tmp.path().join(name);
        std::fs::create_dir_all(&dst).expect("mkdir");
        {
            let f = "plugin.toml";
            std::fs::copy(src.join(f), dst.join(f)).expect("copy manifest");
        }
        for entry in std::fs::read_dir(&src).expect("read plugin dir").flatten() {
            if entry.path().extension().is_some_and(|e| e == "wasm") {
                std::fs::copy(entry.path(), dst.join(entry.file_name())).expect("copy component");
            }
        }
    }
    tmp
}

/// llama.cpp rounds activations to 8 bits in its quantized products; the
/// bound for its top token on our float32 and default paths.
pub const LLAMA_CPP_TOL: f32 = 0.15;

/// `tests/fixtures/models/<name>.llama-cpp.json`: what llama.cpp itself
/// did with a GGUF (benches/make_model_fixtures.py).
pub fn llama_cpp_fixture(name: &str) -> serde_json::Value {
    model_fixture(&format!("{name}.llama-cpp.json"))
}

/// `tests/fixtures/models/<file>` parsed.
pub fn model_fixture(file: &str) -> serde_json::Value {
    let path = format!("{}/fixtures/models/{file}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("json")
}

/// A JSON array of token ids.
pub fn fixture_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Scores every fixture case (prompt, then llama.cpp's greedy continuation)
/// with `mlxhost score --dtype dtype` and checks our logprob of llama.cpp's
/// top token at every step is within `tol` ([`LLAMA_CPP_TOL`] unless a
/// model's own measurement says otherwise); returns the largest difference.
pub fn top_token_gap_to_llama_cpp(
    model: &Path,
    fx: &serde_json::Value,
    dtype: &str,
    tol: f32,
) -> f32 {
    let ids = fixture_ids;
    let cases = fx["cases"].as_array().expect("cases");
    let rows: Vec<(Vec<u32>, Vec<u32>)> = cases
        .iter()
        .map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"])))
        .collect();
    let input = score_input(&rows);
    let out = parse_score(&mlxhost_ok(&[
        "score",
        "--model",
        model.to_str().expect("path"),
        "--dtype",
        dtype,
        "--input",
        input.path().to_str().expect("path"),
    ]));
    let mut worst = 0f32;
    for (c, (case, ours)) in cases.iter().zip(&out).enumerate() {
        let steps = case["teacher_forced_top5"].as_array().expect("steps");
        assert_eq!(ours.steps.len(), steps.len());
        for (s, (theirs, mine)) in steps.iter().zip(&ours.steps).enumerate() {
            let top = &theirs["top5"][0];
            let (id, lp) = (
                top[0].as_u64().expect("id") as u32,
                top[1].as_f64().expect("lp") as f32,
            );
            let ours_lp = mine
                .top
                .iter()
                .find(|t| t.0 == id)
                .map(|t| t.1)
                .unwrap_or_else(|| {
                    panic!("{dtype}: case {c} step {s}: llama.cpp's top {id} not in our top 5")
                });
            let gap = (ours_lp - lp).abs();
            assert!(
                gap <= tol,
                "{dtype}: case {c} step {s}: token {id} ours {ours_lp:.4}, llama.cpp {lp:.4}"
            );
            worst = worst.max(gap);
        }
    }
    eprintln!("{dtype}: largest top-token gap to llama.cpp {worst:.4} nats");
    worst
}

/// The GGUF path of catalog model `name` (`mlxhost models`), which must be
/// installed (`mlxhost models pull NAME`; scripts/test.sh does it).
pub fn installed_model(name: &str) -> PathBuf {
    let m = mlxhost::model::catalog::find(name).expect("in the catalog");
    assert!(
        m.is_installed(),
        "{name} not installed at {}: run `mlxhost models pull {name}`",
        m.path().display()
    );
    m.path()
}
