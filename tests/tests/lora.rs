//! LoRA adapters on SmolLM2-135M-Instruct (the installed Q4_1 GGUF), with
//! the random adapters of `tests/fixtures/lora` (`benches/make_lora.py`:
//! `alpha` rank 8 on q/v of the last 8 layers, `beta` rank 4 on every
//! projection of the last 4, each in mlx-lm's and PEFT's format from the
//! same tensors) and mlx-lm's teacher-forced scores with them.
//!
//! - scores with an adapter match mlx-lm's `load(..., adapter_path=...)`
//!   within `semantics.md`'s thresholds, and the two formats agree;
//! - rows of two adapters and of the base scored in one batch equal each
//!   row alone, through `score` and through the engine's scheduler;
//! - the prompt cache never lets KV made under one adapter seed another's
//!   or the base's prefill, in RAM and on the SSD tier after a restart;
//! - a reload of the adapter folder while rows run changes no running row.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use mlx_rs::Array;
use mlxhost::cache::{PrefixCache, PromptCache};
use mlxhost::engine::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use mlxhost::engine::GenerateRequest;
use mlxhost::model::lora::LoraSet;
use mlxhost::score::ScoreOutput;
use mlxhost_e2e::requests::greedy_request;
use mlxhost_e2e::sliding_cache::{Fixture, Record, Sink};
use mlxhost_e2e::tiny_fixture::{assert_matches, read_scores};
use mlxhost_e2e::{
    assert_scores_close, mlxhost, mlxhost_ok, mlxhost_ok_env, model_path, parse_score,
};

/// Our float32 path against mlx-lm's float32 scores (the fixtures'
/// reference, `benches/make_lora.py`): the same numerics, so far inside
/// `semantics.md`'s 0.1 nats (measured 2.3e-5).
const F32_TOL: f32 = 1e-3;
/// The native path (float16 activations) against the same float32 scores:
/// `semantics.md`'s tolerance for a float16/float32 pair (measured 0.018 on
/// chosen tokens, 0.059 on a top-5 entry).
const NATIVE_TOL: f32 = 0.1;
/// How far an adapter must move mlx-lm's own scores for a test to tell it
/// from the base.
const MOVED: f32 = 0.5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/lora")
}

fn adapter(name: &str) -> String {
    fixtures().join(name).display().to_string()
}

fn rows() -> String {
    fixtures().join("rows.jsonl").display().to_string()
}

fn model() -> String {
    model_path().display().to_string()
}

fn score(extra: &[&str]) -> Vec<ScoreOutput> {
    let (model, rows) = (model(), rows());
    let mut args = vec!["score", "--model", &model, "--input", &rows];
    args.extend(extra);
    parse_score(&mlxhost_ok(&args))
}

fn reference(name: &str) -> Vec<ScoreOutput> {
    read_scores(
        &fixtures()
            .join(format!("mlx-lm-scores.{name}.jsonl"))
            .display()
            .to_string(),
    )
}

/// The largest gap between two score sets' chosen-token logprobs.
fn largest_gap(a: &[ScoreOutput], b: &[ScoreOutput]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.steps.iter().zip(&y.steps))
        .map(|(s, t)| (s.logprob - t.logprob).abs())
        .fold(0.0, f32::max)
}

#[test]
fn adapters_match_mlx_lm() {
    let base = score(&[]);
    assert_matches("base", &base, &reference("base"), F32_TOL);
    for name in ["alpha", "beta"] {
        let theirs = reference(name);
        // Not vacuous: the adapter moves mlx-lm's own scores well past the
        // tolerance.
        let moved = largest_gap(&theirs, &reference("base"));
        assert!(
            moved > MOVED,
            "{name} moves mlx-lm's scores by only {moved}"
        );
        for format in ["mlx", "peft"] {
            let dir = adapter(&format!("{name}-{format}"));
            let ours = score(&["--lora", &dir]);
            assert_matches(&format!("{name} ({format})"), &ours, &theirs, F32_TOL);
        }
    }
}

/// `--lora-merge` against mlx-lm's fused model (`mlx_lm.fuse`'s
/// `LoRALinear.fuse()`: dequantized, the delta added, quantized again;
/// `benches/make_lora.py`): `beta` adapts every projection of its layers,
/// `alpha` only q and v, so its merge must keep the fused q/k/v weight's k
/// rows exactly as stored, as mlx-lm leaves `k_proj` alone (re-quantizing
/// them moved the scores 0.18 nats). The same weights either way, so
/// within the float32 tolerance, while the merge's re-quantization moves
/// them far from the unmerged adapter's scores (not vacuous).
#[test]
fn merged_weights_match_mlx_lm_fused() {
    for name in ["beta", "alpha"] {
        let theirs = reference(&format!("{name}-fused"));
        let ours = score(&["--lora-merge", &adapter(&format!("{name}-mlx"))]);
        assert_matches(&format!("{name} merged"), &ours, &theirs, F32_TOL);
        let rounding = largest_gap(&theirs, &reference(name));
        assert!(
            rounding > 10.0 * F32_TOL,
            "re-quantizing moves mlx-lm's fused {name} scores by only {rounding}"
        );
    }
}

#[test]
fn native_path_matches_mlx_lm() {
    for name in ["alpha", "beta"] {
        let dir = adapter(&format!("{name}-mlx"));
        let ours = score(&["--dtype", "native", "--lora", &dir]);
        assert_matches(
            &format!("{name} native"),
            &ours,
            &reference(name),
            NATIVE_TOL,
        );
    }
}

#[test]
fn both_formats_score_the_same() {
    for name in ["alpha", "beta"] {
        let mlx = score(&["--lora", &adapter(&format!("{name}-mlx"))]);
        let peft = score(&["--lora", &adapter(&format!("{name}-peft"))]);
        assert_scores_close(&peft, &mlx, 1e-5);
    }
}

/// Every row under the base, `alpha` (mlx-lm's files) and `beta` (PEFT's)
/// in one batch, prefilled in chunks of 7 beside other rows' decode
/// tokens, equals each row scored alone.
#[test]
fn a_batch_of_mixed_adapters_scores_each_row_as_alone() {
    let text = std::fs::read_to_string(rows()).expect("rows");
    let mut lines = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let row: serde_json::Value = serde_json::from_str(line).expect("row");
        for lora in [None, Some("alpha-mlx"), Some("beta-peft")] {
            let mut r = row.clone();
            if let Some(l) = lora {
                r["lora"] = l.into();
            }
            lines.push(r.to_string());
        }
    }
    let input = tempfile::NamedTempFile::new().expect("temp");
    std::fs::write(input.path(), lines.join("\n")).expect("write");
    let (model, input, dir) = (
        model(),
        input.path().display().to_string(),
        fixtures().display().to_string(),
    );
    let run = |extra: &[&str]| {
        let mut args = vec![
            "score",
            "--model",
            &model,
            "--input",
            &input,
            "--lora-dir",
            &dir,
            "--decode",
        ];
        args.extend(extra);
        parse_score(&mlxhost_ok(&args))
    };
    let alone = run(&[]);
    let together = run(&["--batch-size", "9", "--prefill-chunk", "7"]);
    assert_scores_close(&together, &alone, 1e-4);
    // The fused CPU decode op (adapters' deltas inside it) against MLX ops.
    let mut args = vec![
        "score",
        "--model",
        &model,
        "--input",
        &input,
        "--lora-dir",
        &dir,
        "--decode",
        "--batch-size",
        "9",
    ];
    args.push("--prefill-chunk");
    args.push("7");
    let per_op = parse_score(&mlxhost_ok_env(&args, &[("MLXHOST_DECODE_LAYER", "mlx")]));
    assert_scores_close(&per_op, &together, 1e-4);
    // Each adapter's rows match mlx-lm's scores for that adapter.
    let pick =
        |k: usize| -> Vec<ScoreOutput> { together.iter().skip(k).step_by(3).cloned().collect() };
    assert_matches("mixed: base rows", &pick(0), &reference("base"), F32_TOL);
    assert_matches("mixed: alpha rows", &pick(1), &reference("alpha"), F32_TOL);
    assert_matches("mixed: beta rows", &pick(2), &reference("beta"), F32_TOL);
}

/// A copy of adapter folder `name` with its safetensors edited.
fn edited(
    name: &str,
    file: &str,
    edit: impl FnOnce(&mut HashMap<String, Array>),
) -> tempfile::TempDir {
    let src = fixtures().join(name);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        src.join("adapter_config.json"),
        dir.path().join("adapter_config.json"),
    )
    .expect("copy config");
    let mut t = Array::load_safetensors(src.join(file)).expect("load");
    edit(&mut t);
    let meta = HashMap::new();
    Array::save_safetensors(
        t.iter().map(|(k, v)| (k.as_str(), v)),
        &meta,
        dir.path().join(file),
    )
    .expect("save");
    dir
}

fn load_error(dir: &Path) -> String {
    let (model, rows) = (model(), rows());
    let dir = dir.display().to_string();
    let out = mlxhost(&["score", "--model", &model, "--input", &rows, "--lora", &dir]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn adapters_that_do_not_fit_name_the_tensor() {
    let name = "model.layers.29.self_attn.v_proj.lora_b";
    let dir = edited("alpha-mlx", "adapters.safetensors", |t| {
        t.insert(name.into(), Array::zeros::<f32>(&[8, 576]).expect("zeros"));
    });
    let e = load_error(dir.path());
    assert!(e.contains(name) && e.contains("[8, 192]"), "{e}");
    let name = "base_model.model.model.layers.27.mlp.down_proj.lora_A.weight";
    let dir = edited("beta-peft", "adapter_model.safetensors", |t| {
        t.insert(name.into(), Array::zeros::<f32>(&[4, 576]).expect("zeros"));
    });
    let e = load_error(dir.path());
    assert!(e.contains(name) && e.contains("1536"), "{e}");
    let dir = edited("alpha-mlx", "adapters.safetensors", |t| {
        t.insert(
            "model.layers.40.self_attn.q_proj.lora_a".into(),
            Array::zeros::<f32>(&[576, 8]).expect("zeros"),
        );
        t.insert(
            "model.layers.40.self_attn.q_proj.lora_b".into(),
            Array::zeros::<f32>(&[8, 576]).expect("zeros"),
        );
    });
    let e = load_error(dir.path());
    assert!(
        e.contains("model.layers.40.self_attn.q_proj.lora_a") && e.contains("30 layers"),
        "{e}"
    );
    // An A without its B, in each format (one pairing helper, each
    // format's names).
    let name = "model.layers.29.self_attn.v_proj.lora_a";
    let dir = edited("alpha-mlx", "adapters.safetensors", |t| {
        t.remove("model.layers.29.self_attn.v_proj.lora_b");
    });
    let e = load_error(dir.path());
    assert!(
        e.contains(name) && e.contains("no partner") && e.contains("lora_a and lora_b"),
        "{e}"
    );
    let name = "base_model.model.model.layers.29.mlp.up_proj.lora_B.weight";
    let dir = edited("beta-peft", "adapter_model.safetensors", |t| {
        t.remove("base_model.model.model.layers.29.mlp.up_proj.lora_A.weight");
    });
    let e = load_error(dir.path());
    assert!(
        e.contains(name) && e.contains("no partner") && e.contains("lora_A and lora_B"),
        "{e}"
    );
}

// ---- through the engine's scheduler -------------------------------------

/// The default model serving `dir`'s adapters, with the `standard` sampler.
fn engine_fixture(dir: &Path) -> Fixture {
    let mut model = mlxhost::model::load(&model_path(), &Default::default()).expect("model");
    model.lora = LoraSet::open(dir, model.model.lora_targets()).expect("adapters");
    Fixture::with_standard_sampler(model)
}

fn request(prompt: &[u32], max_tokens: usize, lora: Option<&str>) -> GenerateRequest {
    GenerateRequest {
        lora: lora.map(String::from),
        ..greedy_request(prompt, max_tokens, 2)
    }
}

/// Runs `reqs` together (request `i` submitted at step `joins[i]`) in one
/// scheduler of `max_batch` rows; `between(step)` runs before each step.
fn run(
    f: &Fixture,
    reqs: &[(GenerateRequest, usize)],
    max_batch: usize,
    mut caches: Option<&mut PrefixCache>,
    mut between: impl FnMut(usize),
) -> Vec<Record> {
    let records: Vec<Rc<RefCell<Record>>> = reqs.iter().map(|_| Rc::default()).collect();
    let mut scheduler = Scheduler::new(SchedulerConfig {
        max_batch,
        ..Default::default()
    });
    let (mut step, mut submitted) = (0usize, 0);
    while submitted < reqs.len() || !scheduler.is_idle() {
        for (i, (req, join)) in reqs.iter().enumerate() {
            if *join == step {
                scheduler.submit(Pending {
                    request: req.clone(),
                    chain: ChainSource::Plugins(f.plugins.clone()),
                    sink: Box::new(Sink(Rc::clone(&records[i]))),
                });
                submitted += 1;
            }
        }
        between(step);
        scheduler.step(&f.model, caches.as_deref_mut());
        step += 1;
        assert!(step < 10_000, "the scheduler never drained");
    }
    records.into_iter().map(|r| r.take()).collect()
}

fn ok(label: &str, r: &Record) -> usize {
    match &r.result {
        Some(Ok(s)) => s.cached_tokens,
        other => panic!("{label}: {other:?}"),
    }
}

/// `semantics.md`'s "same": tokens equal until the first step whose top-2
/// margin (of `alone`) is below twice the tolerance; logprobs within it.
fn assert_same(label: &str, got: &Record, alone: &Record, tol: f32) {
    assert!(!alone.tokens.is_empty(), "{label}: no tokens");
    for (s, (g, a)) in got.tokens.iter().zip(&alone.tokens).enumerate() {
        assert!(
            (g.1 - a.1).abs() <= tol,
            "{label}: step {s}: logprob {} vs {} alone",
            g.1,
            a.1
        );
        if a.2 < 2.0 * tol {
            return;
        }
        assert_eq!(g.0, a.0, "{label}: token {s} differs");
    }
}

fn prompts() -> Vec<Vec<u32>> {
    mlxhost_e2e::reference()
        .into_iter()
        .take(3)
        .map(|c| c.prompt_ids)
        .collect()
}

/// Rows of the base, `alpha` and `beta` joining at different steps share
/// every step (prefill chunks beside decode tokens), and each gets the
/// output it gets alone.
#[test]
fn served_rows_of_two_adapters_and_the_base_equal_their_solo_runs() {
    let f = engine_fixture(&fixtures());
    let loras = [None, Some("alpha-mlx"), Some("beta-peft")];
    let mut reqs = Vec::new();
    for (p, prompt) in prompts().iter().enumerate() {
        for (k, lora) in loras.iter().enumerate() {
            reqs.push((request(prompt, 10, *lora), p + k));
        }
    }
    let together = run(&f, &reqs, 9, None, |_| {});
    let mut moved = 0f32;
    for (i, (req, _)) in reqs.iter().enumerate() {
        let alone = run(&f, &[(req.clone(), 0)], 1, None, |_| {}).remove(0);
        let label = format!("row {i} ({:?})", req.lora);
        ok(&label, &together[i]);
        assert_same(&label, &together[i], &alone, 1e-3);
        if req.lora.is_some() {
            let base = &together[i - i % 3];
            moved = moved.max((alone.tokens[0].1 - base.tokens[0].1).abs());
        }
    }
    assert!(
        moved > 0.05,
        "the adapters changed no row's first logprob ({moved})"
    );
    // A name that is not served fails that request only.
    let failed = run(
        &f,
        &[(request(&prompts()[0], 4, Some("nope")), 0)],
        1,
        None,
        |_| {},
    );
    let e = format!("{:?}", failed[0].result);
    assert!(
        e.contains("no LoRA adapter `nope`") && e.contains("alpha-mlx"),
        "{e}"
    );
}

/// KV made under one adapter never seeds another's or the base's prefill:
/// in the RAM tier, and in the SSD tier after it is reopened (a restart).
/// The same adapter reuses its own entry, with a cold run's output.
#[test]
fn the_prompt_cache_is_namespaced_by_adapter_in_both_tiers() {
    let f = engine_fixture(&fixtures());
    let prompt = prompts()[1].clone();
    let cold =
        |lora: Option<&str>| run(&f, &[(request(&prompt, 8, lora), 0)], 1, None, |_| {}).remove(0);
    let once = |lora: Option<&str>, caches: &mut PrefixCache| {
        let r = run(
            &f,
            &[(request(&prompt, 8, lora), 0)],
            1,
            Some(caches),
            |_| {},
        )
        .remove(0);
        let cached = ok(&format!("{lora:?}"), &r);
        (r, cached)
    };
    // RAM.
    let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
    assert_eq!(once(Some("alpha-mlx"), &mut ram).1, 0);
    assert_eq!(once(None, &mut ram).1, 0, "the base reused alpha's KV");
    assert_eq!(
        once(Some("beta-mlx"), &mut ram).1,
        0,
        "beta reused another's KV"
    );
    // alpha's PEFT copy holds the same tensors: the same namespace.
    for lora in ["alpha-mlx", "alpha-peft"] {
        let (warm, cached) = once(Some(lora), &mut ram);
        assert_eq!(
            cached,
            prompt.len() - 1,
            "{lora} did not reuse alpha's entry"
        );
        assert_same(&format!("{lora} from RAM"), &warm, &cold(Some(lora)), 1e-3);
    }
    // SSD, RAM keeping nothing; reopened as after a restart.
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd_dir = dir.path().join("ssd");
    let open = || {
        PrefixCache::new(
            PromptCache::new(0),
            Some(mlxhost_e2e::sliding_cache::open_ssd(&f.model, &ssd_dir)),
        )
    };
    {
        let mut tiers = open();
        assert_eq!(once(Some("beta-peft"), &mut tiers).1, 0);
        assert!(tiers.flush(Duration::from_secs(60)), "written to disk");
    }
    let mut tiers = open();
    assert_eq!(
        once(None, &mut tiers).1,
        0,
        "the base reused beta's KV from disk"
    );
    assert_eq!(
        once(Some("alpha-mlx"), &mut tiers).1,
        0,
        "alpha reused beta's KV from disk"
    );
    let (warm, cached) = once(Some("beta-mlx"), &mut tiers);
    assert_eq!(
        cached,
        prompt.len() - 1,
        "beta did not reuse its entry from disk"
    );
    assert_same("beta from SSD", &warm, &cold(Some("beta-mlx")), 1e-3);
}

/// Adapters added, changed and removed in the folder while rows run: no
/// row fails, a running row keeps the adapter it started with, a changed
/// adapter's new tensors serve the next request (never the old one's KV),
/// a new adapter serves once it settles, and a removed one is refused.
#[test]
fn hot_reload_never_swaps_an_adapter_under_a_running_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = |from: &str, to: &str| {
        let dst = dir.path().join(to);
        std::fs::create_dir_all(&dst).expect("mkdir");
        for e in std::fs::read_dir(fixtures().join(from)).expect("read") {
            let e = e.expect("entry");
            std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy");
        }
    };
    copy("alpha-mlx", "live");
    let f = engine_fixture(dir.path());
    let prompt = prompts()[0].clone();
    let alone = |f: &Fixture, lora: Option<&str>| {
        run(f, &[(request(&prompt, 12, lora), 0)], 1, None, |_| {}).remove(0)
    };
    let alpha = alone(&f, Some("live"));
    // While a row of `live` decodes, `live` becomes beta, `extra` appears
    // and then `live` is removed; the row finishes as alpha.
    let records = run(
        &f,
        &[(request(&prompt, 12, Some("live")), 0)],
        4,
        None,
        |step| {
            match step {
                2 => {
                    std::fs::remove_dir_all(dir.path().join("live")).expect("rm");
                    copy("beta-peft", "live");
                    copy("alpha-peft", "extra");
                }
                5 => std::fs::remove_dir_all(dir.path().join("extra")).expect("rm extra"),
                _ => {}
            }
            std::thread::sleep(mlxhost::model::lora::registry::POLL_INTERVAL);
            f.model.lora.poll(&|_| false);
        },
    );
    ok("running row", &records[0]);
    assert!(
        records[0].tokens.len() > 5,
        "the row ended before the folder changed"
    );
    assert_same(
        "the row that ran across the reload",
        &records[0],
        &alpha,
        1e-3,
    );
    // `live` is beta now.
    let beta = alone(&engine_fixture(&fixtures()), Some("beta-peft"));
    assert_same(
        "live after the change",
        &alone(&f, Some("live")),
        &beta,
        1e-3,
    );
    let names = f.model.lora.names();
    assert_eq!(names, ["live"], "extra was added and removed");
}
