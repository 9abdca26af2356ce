//! Continuous batching over a hybrid model (tests/fixtures/models/qwen3.5-tiny):
//! rows joining and leaving a running batch, in several orders, greedy and
//! seeded-sampled, with and without decode lookahead, give each row's
//! output alone. The decoding rows' DeltaNet states are one `[B, ...]`
//! stack per layer that rows join (appended), leave (the rest gathered) and
//! keep (taken as it is); a row prefilling chunks beside them runs the
//! chunked rule on its own state. Drives the engine's scheduler directly
//! with the real `standard` sampler plugin.

use std::cell::RefCell;
use std::rc::Rc;

use mlxhost::engine::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use mlxhost::engine::{
    GenerateError, GenerateEvent, GenerateRequest, GenerateSummary, SequenceSink,
};
use mlxhost::plugin::SamplingParams;
use mlxhost_e2e::requests::greedy_request;
use mlxhost_e2e::sliding_cache::{fixture, Fixture};

/// Batched and alone compute the same float32 graph on different row
/// groupings: logprobs agree within this.
const TOL: f32 = 1e-4;

#[derive(Debug, Default)]
struct Record {
    /// (id, logprob).
    tokens: Vec<(u32, f32)>,
    result: Option<Result<GenerateSummary, String>>,
}

struct Sink(Rc<RefCell<Record>>);

impl SequenceSink for Sink {
    fn event(&mut self, event: GenerateEvent) {
        if let GenerateEvent::Token(t) = event {
            self.0.borrow_mut().tokens.push((t.id, t.logprob));
        }
    }
    fn cancelled(&self) -> bool {
        false
    }
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        self.0.borrow_mut().result = Some(result.map_err(|e| e.to_string()));
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, seed: Option<u64>) -> GenerateRequest {
    let params = match seed {
        None => SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        Some(seed) => SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(seed),
            ..Default::default()
        },
    };
    GenerateRequest {
        params,
        ..greedy_request(&prompt, max_tokens, 0)
    }
}

/// Runs `reqs`, each submitted before the step its number names, and
/// returns each one's record.
fn run(f: &Fixture, config: SchedulerConfig, reqs: &[(GenerateRequest, usize)]) -> Vec<Record> {
    let records: Vec<Rc<RefCell<Record>>> = reqs.iter().map(|_| Rc::default()).collect();
    let mut scheduler = Scheduler::new(config);
    let (mut step, mut submitted) = (0, 0);
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
        scheduler.step(&f.model, None);
        step += 1;
        assert!(step < 10_000, "the scheduler never drained");
    }
    records.into_iter().map(|r| r.take()).collect()
}

/// The rows: prompts over the 64-token DeltaNet blocks and short ones,
/// two sampled with their own seeds, lengths that make them leave at
/// different steps.
fn rows() -> Vec<GenerateRequest> {
    let p = |n: u32, k: u32| {
        (0..n)
            .map(|i| (i * 37 + 11 * k) % 256)
            .collect::<Vec<u32>>()
    };
    vec![
        request(p(150, 1), 12, None),
        request(p(5, 2), 4, Some(7)),
        request(p(70, 3), 10, None),
        request(p(1, 4), 8, Some(11)),
        request(p(40, 5), 6, None),
    ]
}

#[test]
fn rows_joining_and_leaving_in_any_order_equal_rows_alone() {
    let f = fixture("qwen3.5-tiny");
    let reqs = rows();
    let config = |lookahead: bool| SchedulerConfig {
        max_batch: 8,
        prefill_chunk: 16,
        prefill_budget: 16,
        decode_lookahead: lookahead.into(),
        ..Default::default()
    };
    let alone: Vec<Record> = reqs
        .iter()
        .map(|r| {
            let solo = SchedulerConfig {
                max_batch: 1,
                ..config(false)
            };
            run(&f, solo, &[(r.clone(), 0)]).remove(0)
        })
        .collect();
    // Join steps per row: all at once, staggered forwards, staggered
    // backwards, interleaved with leaves.
    let orders: [[usize; 5]; 4] = [
        [0, 0, 0, 0, 0],
        [0, 2, 4, 6, 8],
        [8, 6, 4, 2, 0],
        [0, 12, 1, 3, 9],
    ];
    for lookahead in [false, true] {
        for order in &orders {
            let batch: Vec<(GenerateRequest, usize)> =
                reqs.iter().cloned().zip(order.iter().copied()).collect();
            let batched = run(&f, config(lookahead), &batch);
            for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
                let label = format!("row {i}, joins {order:?}, lookahead {lookahead}");
                assert!(matches!(b.result, Some(Ok(_))), "{label}: {:?}", b.result);
                assert_eq!(b.tokens.len(), a.tokens.len(), "{label}");
                for (s, (x, y)) in b.tokens.iter().zip(&a.tokens).enumerate() {
                    assert_eq!(x.0, y.0, "{label}: token {s}");
                    assert!(
                        (x.1 - y.1).abs() <= TOL,
                        "{label}: step {s}: {} vs {}",
                        x.1,
                        y.1
                    );
                }
            }
        }
    }
}
