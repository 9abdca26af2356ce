//! `mlxhost generate`: every token chosen by a WASM plugin.

use mlxhost_e2e::*;

fn generate(plugins: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "generate",
        "--plugins",
        plugins.to_str().expect("path"),
        "--prompt",
        "What is the capital of France?",
    ];
    args.extend(extra);
    mlxhost(&args)
}

fn generate_ok(plugins: &std::path::Path, extra: &[&str]) -> String {
    let out = generate(plugins, extra);
    assert!(
        out.status.success(),
        "generate {extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn generate_err(plugins: &std::path::Path, extra: &[&str]) -> String {
    let out = generate(plugins, extra);
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected a clean failure: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The reference greedy text up to (not including) the first near-tie step
/// (top-2 margin below twice the path's tolerance), without EOS.
fn reference_prefix(case: &ReferenceCase, tol: f32, tokens: &[String]) -> String {
    let cut = case
        .step_margins
        .iter()
        .position(|&m| m < 2.0 * tol)
        .unwrap_or(case.greedy_ids.len());
    tokens[..cut]
        .iter()
        .filter(|t| t.as_str() != "<|im_end|>")
        .cloned()
        .collect()
}

#[test]
fn greedy_generation_equals_the_reference_until_the_first_near_tie() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2-greedy.json"),
    )
    .expect("fixture");
    let raw: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
    let plugins = plugins_dir();
    for (case, raw) in reference().iter().zip(&raw) {
        let tokens: Vec<String> =
            serde_json::from_value(raw["greedy_token_texts"].clone()).expect("texts");
        let user = case
            .messages
            .last()
            .expect("a user message")
            .content
            .clone();
        let system = case
            .messages
            .iter()
            .find(|m| m.role == "system")
            .map(|m| m.content.clone());
        for (dtype, tol) in [("native", 0.05f32), ("auto", 0.1)] {
            let expected = reference_prefix(case, tol, &tokens);
            let max = case.greedy_ids.len().to_string();
            let mut args = vec![
                "generate",
                "--plugins",
                plugins.to_str().expect("p"),
                "--dtype",
                dtype,
                "--prompt",
                &user,
                "--max-tokens",
                &max,
            ];
            if let Some(system) = &system {
                args.extend(["--system", system.as_str()]);
            }
            let out = mlxhost(&args);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let got = String::from_utf8(out.stdout).expect("utf-8");
            assert!(
                got.starts_with(&expected),
                "{dtype}: got {got:?}, expected prefix {expected:?}"
            );
        }
    }
}

#[test]
fn a_logits_processor_plugin_changes_the_output() {
    let dir = plugin_folder_with(&["standard", "ban-token"]);
    let plain = generate_ok(dir.path(), &["--max-tokens", "8"]);
    assert!(plain.contains("Paris"), "{plain}");
    // ban-token's default parameter bans id 7042 (" Paris").
    let banned = generate_ok(
        dir.path(),
        &["--max-tokens", "8", "--logits-processor", "ban-token"],
    );
    assert!(!banned.contains(" Paris"), "{banned}");
    assert_ne!(plain, banned);
    // Plugin parameters pass through: banning another id leaves Paris in.
    let other = generate_ok(
        dir.path(),
        &[
            "--max-tokens",
            "8",
            "--logits-processor",
            "ban-token",
            "--plugin-params",
            r#"{"ban-token": {"id": 4649}}"#,
        ],
    );
    assert!(!other.contains(" France"), "{other}");
}

#[test]
fn same_seed_same_text_and_different_seeds_differ() {
    let dir = plugins_dir();
    let run =
        |seed: &str| generate_ok(&dir, &["--max-tokens", "24", "--temp", "1", "--seed", seed]);
    let a = run("7");
    assert_eq!(a, run("7"));
    let others: Vec<String> = ["8", "9", "10"].iter().map(|s| run(s)).collect();
    assert!(
        others.iter().any(|o| o != &a),
        "three other seeds all gave {a:?}"
    );
}

#[test]
fn replacing_the_sampler_folder_changes_the_output_without_a_rebuild() {
    let dir = plugin_folder_with(&["standard"]);
    let greedy = generate_ok(dir.path(), &["--max-tokens", "6"]);
    // Swap the folder's component for the trivial lowest-allowed-id sampler, same name.
    let lowest = plugin_folder_with(&["lowest-id"]);
    std::fs::copy(
        lowest.path().join("lowest-id/lowest-id.wasm"),
        dir.path().join("standard/standard.wasm"),
    )
    .expect("swap");
    let swapped = generate_ok(dir.path(), &["--max-tokens", "6"]);
    assert_ne!(greedy, swapped);
    // Token id 0 is `<|endoftext|>` (special, not printed), so the text is empty.
    assert!(swapped.trim().is_empty(), "{swapped:?}");
}

#[test]
fn no_sampler_plugin_is_a_clear_error() {
    let empty = tempfile::tempdir().expect("tempdir");
    let err = generate_err(empty.path(), &["--max-tokens", "4"]);
    assert!(err.contains("no sampler plugin named `standard`"), "{err}");
    let dir = plugin_folder_with(&["ban-token"]);
    let err = generate_err(dir.path(), &["--max-tokens", "4", "--sampler", "ban-token"]);
    assert!(err.contains("no sampler plugin named `ban-token`"), "{err}");
}

#[test]
fn a_trapping_plugin_fails_the_generation_with_its_name() {
    let dir = plugin_folder_with(&["trap"]);
    let err = generate_err(dir.path(), &["--max-tokens", "8", "--sampler", "trap"]);
    assert!(
        err.contains("plugin `trap` failed") && err.contains("trapped"),
        "{err}"
    );
}

#[test]
fn missing_plugins_dir_and_corrupt_components() {
    let err = generate_err(
        std::path::Path::new("/nonexistent/plugins"),
        &["--max-tokens", "4"],
    );
    assert!(err.contains("/nonexistent/plugins"), "{err}");
    let dir = plugin_folder_with(&["standard", "lowest-id"]);
    std::fs::write(
        dir.path().join("lowest-id/lowest-id.wasm"),
        b"\0asm garbage",
    )
    .expect("corrupt");
    let listing = mlxhost_ok(&["plugins", "list", dir.path().to_str().expect("p")]);
    assert!(listing.contains("ok       standard"), "{listing}");
    assert!(
        listing.contains("skipped")
            && listing.contains("lowest-id")
            && listing.contains("not a valid component"),
        "{listing}"
    );
    // The good plugin still serves.
    assert!(generate_ok(dir.path(), &["--max-tokens", "4"]).contains("The"));
}
