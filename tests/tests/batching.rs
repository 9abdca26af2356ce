//! Continuous batching: rows run together in one step give the same output
//! as each row run alone (`semantics.md`'s "same": tokens equal until a
//! near-tie, logprobs within the float32 path's 0.1 nats), with mixed
//! prompts and parameters, rows joining and leaving mid-batch, a cancelled
//! row, rows whose plugin traps or returns a bad token, and prompt-cache
//! hits beside misses. Drives the engine's scheduler directly with the real
//! model and real plugins.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use mlxhost::cache::{PrefixCache, PromptCache};
use mlxhost::engine::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use mlxhost::engine::SchedulerStats;
use mlxhost::engine::{
    FinishReason, GenerateError, GenerateEvent, GenerateRequest, GenerateSummary, SequenceSink,
};
use mlxhost::model::LoadedModel;
use mlxhost::plugin::{PluginHost, PluginLimits, SamplingParams, VocabView};
use mlxhost_e2e::{model_path, plugin_folder_with};

/// The float32 path's tolerance (`semantics.md`).
const TOL: f32 = 0.1;

#[derive(Debug, Default)]
struct Record {
    /// (id, raw logprob, top-2 margin of the raw distribution).
    tokens: Vec<(u32, f32, f32)>,
    text: String,
    started: bool,
    result: Option<Result<GenerateSummary, String>>,
}

struct Sink {
    record: Rc<RefCell<Record>>,
    /// Cancel once this many tokens arrived.
    cancel_after: Option<usize>,
}

impl SequenceSink for Sink {
    fn event(&mut self, event: GenerateEvent) {
        let mut r = self.record.borrow_mut();
        match event {
            GenerateEvent::Started { .. } => r.started = true,
            GenerateEvent::Text(t) => r.text.push_str(&t),
            GenerateEvent::Token(t) => {
                let margin = match t.top.as_slice() {
                    [a, b, ..] => a.1 - b.1,
                    _ => f32::INFINITY,
                };
                r.tokens.push((t.id, t.logprob, margin));
            }
        }
    }
    fn cancelled(&self) -> bool {
        self.cancel_after
            .is_some_and(|n| self.record.borrow().tokens.len() >= n)
    }
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        self.record.borrow_mut().result = Some(result.map_err(|e| e.to_string()));
    }
}

struct Fixture {
    model: LoadedModel,
    plugins: Arc<PluginHost>,
    _dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let dir = plugin_folder_with(&[
        "standard",
        "mirostat",
        "repetition-penalty",
        "presence-penalty",
        "logit-bias",
        "dry",
        "ban-token",
        "trap",
        "bad-token",
    ]);
    let model = mlxhost::model::load(&model_path(), &Default::default()).expect("model loads");
    let plugins = PluginHost::load_dir(dir.path(), PluginLimits::default()).expect("plugins load");
    plugins.set_vocab(Arc::new(VocabView::new(model.tokenizer.clone())));
    Fixture {
        model,
        plugins: Arc::new(plugins),
        _dir: dir,
    }
}

/// A request over `prompt` with `params`, the named sampler and processors.
fn request(
    prompt: &[u32],
    max_tokens: usize,
    sampler: &str,
    processors: &[&str],
    params: SamplingParams,
    plugin_params: serde_json::Value,
) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens,
        stop: Vec::new(),
        keep_special: false,
        forced_choices: Vec::new(),
        params,
        sampler: sampler.into(),
        processors: processors.iter().map(|s| s.to_string()).collect(),
        plugin_params,
        top_logprobs: 2,
        speculative: Default::default(),
        lora: None,
    }
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

const QUESTIONS: [&str; 6] = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2? Answer with a number and explain how you added the numbers together.",
    "Say hello in Spanish.",
    "List two fruits.",
];

/// The chat-templated prompt ids of `QUESTIONS[i]`.
fn prompt(f: &Fixture, i: usize) -> Vec<u32> {
    let template = f.model.template.as_ref().expect("a chat template");
    let text = template
        .render(
            &[mlxhost::model::ChatMessage {
                role: "user".into(),
                content: QUESTIONS[i % QUESTIONS.len()].into(),
            }],
            true,
        )
        .expect("renders");
    f.model.tokenizer.encode(&text).expect("encodes")
}

/// Mixed rows: prompts of different lengths, every kind of parameter.
fn mixed_requests(f: &Fixture) -> Vec<GenerateRequest> {
    let p = |i: usize| prompt(f, i);
    let first_greedy = |i: usize| {
        solo(
            f,
            &request(&p(i), 1, "standard", &[], greedy(), serde_json::json!({})),
        )
        .tokens[0]
            .0
    };
    // Longer than one prefill chunk at the small budget, shorter than the context.
    let long: Vec<u32> = (0..6).flat_map(p).collect();
    vec![
        request(&p(0), 12, "standard", &[], greedy(), serde_json::json!({})),
        request(
            &p(1),
            20,
            "standard",
            &[],
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(7),
                ..Default::default()
            },
            serde_json::json!({}),
        ),
        request(
            &p(2),
            16,
            "standard",
            &["repetition-penalty", "presence-penalty"],
            SamplingParams {
                temperature: 0.0,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                ..Default::default()
            },
            serde_json::json!({}),
        ),
        request(
            &p(3),
            10,
            "standard",
            &["logit-bias"],
            SamplingParams {
                temperature: 0.0,
                logit_bias: vec![(first_greedy(3), -100.0)],
                ..Default::default()
            },
            serde_json::json!({}),
        ),
        request(
            &p(4),
            18,
            "mirostat",
            &[],
            SamplingParams {
                temperature: 1.0,
                seed: Some(11),
                ..Default::default()
            },
            serde_json::json!({"mirostat": {"tau": 3.0}}),
        ),
        request(
            &p(5),
            14,
            "standard",
            &["dry"],
            greedy(),
            serde_json::json!({"dry": {"multiplier": 0.8}}),
        ),
        request(
            &p(0),
            8,
            "standard",
            &["ban-token"],
            greedy(),
            serde_json::json!({"ban-token": {"id": first_greedy(0)}}),
        ),
        request(&long, 9, "standard", &[], greedy(), serde_json::json!({})),
    ]
}

/// Runs `reqs` through one scheduler: `joins[i]` is the step at which
/// request `i` is submitted (rows join mid-batch). Returns each record.
fn run(
    f: &Fixture,
    config: SchedulerConfig,
    reqs: &[(GenerateRequest, usize, Option<usize>)],
    caches: Option<&mut PrefixCache>,
) -> Vec<Rc<RefCell<Record>>> {
    run_with_stats(f, config, reqs, caches).0
}

/// [`run`], also returning the scheduler's counters at the end.
fn run_with_stats(
    f: &Fixture,
    config: SchedulerConfig,
    reqs: &[(GenerateRequest, usize, Option<usize>)],
    mut caches: Option<&mut PrefixCache>,
) -> (Vec<Rc<RefCell<Record>>>, SchedulerStats) {
    let records: Vec<_> = reqs.iter().map(|_| Rc::default()).collect();
    let mut scheduler = Scheduler::new(config);
    let mut step = 0usize;
    let mut submitted = 0;
    while submitted < reqs.len() || !scheduler.is_idle() {
        for (i, (req, join, cancel_after)) in reqs.iter().enumerate() {
            if *join == step {
                scheduler.submit(Pending {
                    request: req.clone(),
                    chain: ChainSource::Plugins(f.plugins.clone()),
                    sink: Box::new(Sink {
                        record: Rc::clone(&records[i]),
                        cancel_after: *cancel_after,
                    }),
                });
                submitted += 1;
            }
        }
        scheduler.step(&f.model, caches.as_deref_mut());
        step += 1;
        assert!(step < 10_000, "the scheduler never drained");
    }
    (records, scheduler.stats())
}

fn solo(f: &Fixture, req: &GenerateRequest) -> Record {
    let records = run(
        f,
        SchedulerConfig {
            max_batch: 1,
            ..Default::default()
        },
        &[(req.clone(), 0, None)],
        None,
    );
    Rc::try_unwrap(records.into_iter().next().expect("one"))
        .expect("sole owner")
        .into_inner()
}

/// `semantics.md`'s "same": tokens equal until the first step whose top-2
/// margin (of the solo run) is below twice the tolerance; logprobs within
/// the tolerance up to there.
fn assert_same(label: &str, batched: &Record, alone: &Record) {
    for (s, (b, a)) in batched.tokens.iter().zip(&alone.tokens).enumerate() {
        if a.2 < 2.0 * TOL {
            return;
        }
        assert_eq!(b.0, a.0, "{label}: token {s} differs (batched vs alone)");
        assert!(
            (b.1 - a.1).abs() <= TOL,
            "{label}: step {s} logprob {} vs {}",
            b.1,
            a.1
        );
    }
    assert_eq!(
        batched.tokens.len(),
        alone.tokens.len(),
        "{label}: lengths differ with no near-tie"
    );
    assert_eq!(batched.text, alone.text, "{label}: texts differ");
}

fn summary(r: &Record) -> &GenerateSummary {
    match &r.result {
        Some(Ok(s)) => s,
        other => panic!("expected a summary, got {other:?}"),
    }
}

#[test]
fn batched_rows_equal_solo_rows_with_joins_leaves_cancel_and_failures() {
    let f = fixture();
    let reqs = mixed_requests(&f);
    let alone: Vec<Record> = reqs.iter().map(|r| solo(&f, r)).collect();
    for (i, a) in alone.iter().enumerate() {
        assert!(!a.tokens.is_empty(), "request {i} generated nothing alone");
        summary(a);
    }
    // Everything at once, then the same with staggered joins, a cancelled
    // row, a trapping row and a bad-token row beside them.
    let mut staggered: Vec<(GenerateRequest, usize, Option<usize>)> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| (r.clone(), i * 3, None))
        .collect();
    let cancelled = staggered.len();
    staggered.push((reqs[1].clone(), 2, Some(4)));
    let trapping = staggered.len();
    staggered.push((
        request(
            &prompt(&f, 2),
            10,
            "trap",
            &[],
            greedy(),
            serde_json::json!({}),
        ),
        1,
        None,
    ));
    let bad = staggered.len();
    staggered.push((
        request(
            &prompt(&f, 3),
            10,
            "bad-token",
            &[],
            greedy(),
            serde_json::json!({}),
        ),
        4,
        None,
    ));
    let together: Vec<_> = reqs.iter().map(|r| (r.clone(), 0, None)).collect();
    for (label, plan, batch, budget) in [
        ("together", &together, 8, 256),
        ("staggered, small budget", &staggered, 4, 16),
    ] {
        let config = SchedulerConfig {
            max_batch: batch,
            prefill_budget: budget,
            ..Default::default()
        };
        let records = run(&f, config, plan, None);
        for (i, a) in alone.iter().enumerate() {
            assert_same(&format!("{label} row {i}"), &records[i].borrow(), a);
            let s = summary(&records[i].borrow()).clone();
            assert_eq!(s.finish_reason, summary(a).finish_reason, "{label} row {i}");
            assert_eq!(s.prompt_tokens, reqs[i].prompt_ids.len());
        }
        if plan.len() > reqs.len() {
            let c = records[cancelled].borrow();
            assert_eq!(summary(&c).finish_reason, FinishReason::Cancelled);
            assert_eq!(c.tokens.len(), 4, "cancelled after its fourth token");
            assert_eq!(
                c.tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
                alone[1].tokens[..4].iter().map(|t| t.0).collect::<Vec<_>>()
            );
            for (row, name) in [(trapping, "trap"), (bad, "bad-token")] {
                let r = records[row].borrow();
                match &r.result {
                    Some(Err(e)) => assert!(e.contains(name), "{label}: {e}"),
                    other => panic!("{label}: the {name} row should fail, got {other:?}"),
                }
            }
        }
    }
}

#[test]
fn prompt_cache_hits_beside_misses_equal_cold_runs() {
    let f = fixture();
    let first = request(
        &prompt(&f, 0),
        6,
        "standard",
        &[],
        greedy(),
        serde_json::json!({}),
    );
    let mut caches = PrefixCache::new(PromptCache::new(1 << 30), None);
    run(
        &f,
        SchedulerConfig::default(),
        &[(first.clone(), 0, None)],
        Some(&mut caches),
    );
    // The same conversation resent with more text (a hit), beside two
    // requests the cache has never seen (misses).
    let mut longer = prompt(&f, 0);
    longer.extend_from_slice(&prompt(&f, 1));
    let reqs = [longer, prompt(&f, 2), prompt(&f, 3)]
        .map(|p| request(&p, 10, "standard", &[], greedy(), serde_json::json!({})));
    let alone: Vec<Record> = reqs.iter().map(|r| solo(&f, r)).collect();
    let plan: Vec<_> = reqs.iter().map(|r| (r.clone(), 0, None)).collect();
    let records = run(&f, SchedulerConfig::default(), &plan, Some(&mut caches));
    assert!(
        summary(&records[0].borrow()).cached_tokens >= prompt(&f, 0).len() - 1,
        "the resent conversation reuses its cached prefix"
    );
    for (i, a) in alone.iter().enumerate() {
        assert_same(&format!("cache row {i}"), &records[i].borrow(), a);
    }
    // The rows that reused the entry wrote their own copies: the entry
    // still gives the cold run's tokens (two rows reuse it at once).
    let again = run(
        &f,
        SchedulerConfig::default(),
        &[(first.clone(), 0, None), (first.clone(), 0, None)],
        Some(&mut caches),
    );
    let cold = solo(&f, &first);
    for r in &again {
        assert!(
            summary(&r.borrow()).cached_tokens > 0,
            "the entry is reused"
        );
        assert_same(
            "entry reused after batched rows wrote past it",
            &r.borrow(),
            &cold,
        );
    }
    // The misses share only a prefix (the chat template's system prompt, a
    // few words) with the cached conversation, and reuse no more than that.
    for (row, question) in [(1, 2), (2, 3)] {
        let shared = prompt(&f, 0)
            .iter()
            .zip(&prompt(&f, question))
            .take_while(|(a, b)| a == b)
            .count();
        let cached = summary(&records[row].borrow()).cached_tokens;
        assert!(
            cached <= shared,
            "row {row} reused {cached} > {shared} shared tokens"
        );
    }
}

/// Decode lookahead (`--decode-lookahead`, on by default with a GPU
/// backend): when every row decodes, each step starts its successor's
/// forward before its tokens are read. The same rows with it off and on
/// give the same output, with rows ending at different steps (by length, by
/// a stop string, cancelled by the client), a row joining mid-batch and a
/// history-free processor (logit_bias); the lookahead really runs, also
/// beside rows whose chain reads the history (repetition_penalty); and the
/// prompt-cache entry a row leaves behind holds exactly its tokens: a
/// follow-up over prompt + output reuses all of it and gives the cold run's
/// output.
#[test]
fn decode_lookahead_gives_the_same_output_and_cache_entries() {
    let f = fixture();
    let json = serde_json::json!({});
    let greedy_row = |i: usize, max: usize| {
        request(&prompt(&f, i), max, "standard", &[], greedy(), json.clone())
    };
    let mut stopped = greedy_row(1, 30);
    let solo_text = solo(&f, &stopped).text;
    let word = solo_text
        .split_whitespace()
        .nth(3)
        .expect("a few words of output")
        .to_string();
    stopped.stop = vec![word];
    let first_greedy = solo(&f, &greedy_row(3, 1)).tokens[0].0;
    let reqs: Vec<(GenerateRequest, usize, Option<usize>)> = vec![
        (greedy_row(0, 12), 0, None),
        (
            request(
                &prompt(&f, 2),
                40,
                "standard",
                &[],
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    seed: Some(3),
                    ..Default::default()
                },
                json.clone(),
            ),
            0,
            None,
        ),
        (stopped, 0, None),
        (
            request(
                &prompt(&f, 3),
                25,
                "standard",
                &["logit-bias"],
                SamplingParams {
                    temperature: 0.0,
                    logit_bias: vec![(first_greedy, -100.0)],
                    ..Default::default()
                },
                json.clone(),
            ),
            3,
            None,
        ),
        (greedy_row(4, 30), 0, Some(5)),
    ];
    let config = |decode_lookahead: bool| SchedulerConfig {
        max_batch: 8,
        decode_lookahead: decode_lookahead.into(),
        ..Default::default()
    };
    let (off, off_stats) = run_with_stats(&f, config(false), &reqs, None);
    let mut caches = PrefixCache::new(PromptCache::new(1 << 30), None);
    let (on, on_stats) = run_with_stats(&f, config(true), &reqs, Some(&mut caches));
    let lookahead_steps =
        |s: &SchedulerStats| -> u64 { s.by_batch_size.iter().map(|b| b.lookahead_steps).sum() };
    assert_eq!(lookahead_steps(&off_stats), 0);
    assert!(
        lookahead_steps(&on_stats) >= 20,
        "the lookahead ran on {} steps",
        lookahead_steps(&on_stats)
    );
    for (i, (a, b)) in off.iter().zip(&on).enumerate() {
        let (a, b) = (a.borrow(), b.borrow());
        assert_same(&format!("lookahead row {i}"), &b, &a);
        assert_eq!(
            summary(&b).finish_reason,
            summary(&a).finish_reason,
            "row {i}"
        );
        assert_eq!(
            summary(&b).completion_tokens,
            summary(&a).completion_tokens,
            "row {i}"
        );
    }
    // A plugin that reads the history (repetition_penalty) cannot choose
    // ahead: its row's forward still runs ahead with the rest and its chain
    // runs on those logits in the next call, once its token is taken. The
    // batch stays in the lookahead and every row's output is unchanged.
    let penalized = request(
        &prompt(&f, 2),
        12,
        "standard",
        &["repetition-penalty"],
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.3,
            ..Default::default()
        },
        json.clone(),
    );
    let pair = [
        (penalized.clone(), 0, None),
        (greedy_row(0, 12), 0, None),
        (penalized, 2, None),
    ];
    let (pair_off, _) = run_with_stats(&f, config(false), &pair, None);
    let rebuilds = mlxhost::cache::slab::DecodeSlab::rebuilds();
    let (pair_on, stats) = run_with_stats(&f, config(true), &pair, None);
    // Through the decode slab (the child run of
    // `batched_rows_equal_solo_rows_through_the_decode_slab`): the rows keep
    // their slots while they decode. Deferred chains choose in an order of
    // their own; the lookahead's forward must not take the rows in that
    // order, which rebuilt the slab (copying every row's KV) at each step:
    // 12 rebuilds in 14 steps then, 5 (the rows' joins and leaves) now.
    if mlxhost::cache::slab::enabled() {
        let rebuilt = mlxhost::cache::slab::DecodeSlab::rebuilds() - rebuilds;
        let steps: u64 = stats.by_batch_size.iter().map(|b| b.steps).sum();
        assert!(
            rebuilt <= 6,
            "the slab was rebuilt {rebuilt} times in {steps} steps of 3 rows"
        );
    }
    let several_running = stats.by_batch_size.iter().filter(|b| b.rows >= 2);
    assert!(
        several_running.map(|b| b.lookahead_steps).sum::<u64>() >= 8,
        "rows with a history-reading chain keep the batch in the lookahead: {:?}",
        stats.by_batch_size
    );
    for (i, (a, b)) in pair_off.iter().zip(&pair_on).enumerate() {
        assert_same(
            &format!("penalized batch row {i}"),
            &b.borrow(),
            &a.borrow(),
        );
    }
    assert_eq!(summary(&on[2].borrow()).finish_reason, FinishReason::Stop);
    assert_eq!(
        summary(&on[4].borrow()).finish_reason,
        FinishReason::Cancelled
    );
    assert_eq!(on[4].borrow().tokens.len(), 5);
    // Row 0's entry (prompt + its tokens) serves a follow-up in full.
    let mut follow = prompt(&f, 0);
    follow.extend(on[0].borrow().tokens.iter().map(|t| t.0));
    follow.extend(prompt(&f, 5));
    let follow_req = request(&follow, 10, "standard", &[], greedy(), json.clone());
    let cold = solo(&f, &follow_req);
    let (hit, _) = run_with_stats(
        &f,
        config(true),
        &[(follow_req, 0, None)],
        Some(&mut caches),
    );
    let hit = hit[0].borrow();
    // Every token of the row but a final EOS was fed, so all are cached.
    let row0 = on[0].borrow();
    let fed = prompt(&f, 0).len() + row0.tokens.len()
        - usize::from(
            row0.tokens
                .last()
                .is_some_and(|t| f.model.eos_ids.contains(&t.0)),
        );
    assert_eq!(
        summary(&hit).cached_tokens,
        fed,
        "the follow-up reuses the row's whole entry"
    );
    assert_same("follow-up after a lookahead row's entry", &hit, &cold);
}

/// Both scenarios above again with decode rows in the batched KV slab (the
/// decode path of GPU backends, `cache::slab`) on the CPU, each in a child
/// process of this test binary: the switch is read once per process.
#[test]
fn batched_rows_equal_solo_rows_through_the_decode_slab() {
    let exe = std::env::current_exe().expect("test binary path");
    for name in [
        "batched_rows_equal_solo_rows_with_joins_leaves_cancel_and_failures",
        "prompt_cache_hits_beside_misses_equal_cold_runs",
        "decode_lookahead_gives_the_same_output_and_cache_entries",
    ] {
        let out = std::process::Command::new(&exe)
            .args([name, "--exact", "--test-threads=1"])
            .env("MLXHOST_DECODE_ATTENTION", "slab")
            .output()
            .expect("run the test binary");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{name} through the decode slab failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
