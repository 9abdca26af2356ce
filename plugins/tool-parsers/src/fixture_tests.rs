//! The outputs in `tests/fixtures/tool-calls/<format>/<case>.txt`
//! (expected results in `<case>.json`, the same files the host's
//! `tests/tests/tool_parsers.rs` runs through the built component): fed
//! whole, one char at a time, and cut in two at every char boundary, each
//! gives the same merged result, equal to the expected one. The `harmony`
//! cases run through both of its parsers chained as the host chains them
//! (reasoning parser, then the tool-call parser on its text).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::formats::{Format, ToolParser};
use crate::options::ReasoningFormat;
use crate::reasoning::Reasoner;
use crate::segment::Parser;
use crate::stream::{Event, Stream};
use crate::think::Think;
use crate::tools::Tools;

/// What a whole generation amounts to (invalid calls are content too, as
/// adapters render them).
#[derive(Debug, PartialEq)]
struct Outcome {
    content: String,
    reasoning: String,
    calls: Vec<(String, Value)>,
    invalid: Vec<String>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tool-calls")
}

/// Merges events, checking the sequence rules the host checks (indices in
/// order, arguments only for the open call, every call ended with a JSON
/// object, well-formed ids). Returns the outcome and the call ids.
fn outcome(events: &[Event]) -> (Outcome, Vec<String>) {
    let mut o = Outcome {
        content: String::new(),
        reasoning: String::new(),
        calls: Vec::new(),
        invalid: Vec::new(),
    };
    let mut ids = Vec::new();
    let mut args: Vec<String> = Vec::new();
    let mut open: Option<u32> = None;
    for e in events {
        match e {
            Event::Text(t) => {
                assert!(!t.is_empty(), "empty text event");
                o.content.push_str(t);
            }
            Event::Reasoning(t) => {
                assert!(!t.is_empty(), "empty reasoning event");
                o.reasoning.push_str(t);
            }
            Event::CallStart { index, id, name } => {
                assert_eq!(*index as usize, o.calls.len(), "call index out of order");
                assert!(open.is_none(), "call started inside call");
                assert!(!name.is_empty());
                assert!(
                    id.starts_with("call_")
                        && id.len() == 29
                        && id[5..].chars().all(|c| c.is_ascii_alphanumeric()),
                    "{id}"
                );
                o.calls.push((name.clone(), Value::Null));
                args.push(String::new());
                ids.push(id.clone());
                open = Some(*index);
            }
            Event::CallArguments { index, arguments } => {
                assert_eq!(open, Some(*index), "arguments for a call that is not open");
                args[*index as usize].push_str(arguments);
            }
            Event::CallEnd(index) => {
                assert_eq!(open.take(), Some(*index), "end of a call that is not open");
                let a = &args[*index as usize];
                let v: Value =
                    serde_json::from_str(a).unwrap_or_else(|e| panic!("arguments {a:?}: {e}"));
                assert!(v.is_object(), "arguments {a:?} are not an object");
                assert_eq!(crate::json::minify(a), *a, "arguments are not compact JSON");
                o.calls[*index as usize].1 = v;
            }
            Event::Invalid(t) => {
                o.content.push_str(t);
                o.invalid.push(t.clone());
            }
        }
    }
    assert!(open.is_none(), "a call was never ended");
    (o, ids)
}

fn expected(v: &Value) -> Outcome {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let strings = |k: &str| -> Vec<String> {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let calls = v
        .get("calls")
        .and_then(Value::as_array)
        .map(|c| {
            c.iter()
                .map(|c| {
                    (
                        c["name"].as_str().expect("name").to_string(),
                        c["arguments"].clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Outcome {
        content: s("content"),
        reasoning: s("reasoning"),
        calls,
        invalid: strings("invalid"),
    }
}

/// Declared tools: the case's `tools`, else every name it calls (no schemas,
/// as the host's test declares them).
fn tools(v: &Value) -> Tools {
    let names: Vec<String> = match v.get("tools").and_then(Value::as_array) {
        Some(t) => t
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect(),
        None => v
            .get("calls")
            .and_then(Value::as_array)
            .map(|c| {
                c.iter()
                    .filter_map(|x| x["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
    };
    Tools::new(names.into_iter().map(|n| (n, "{}".to_string())))
}

fn run<P: Parser + Clone>(parser: &P, pieces: &[&str]) -> (Outcome, Vec<String>) {
    let mut s = Stream::new(parser.clone(), "");
    let mut events = Vec::new();
    for p in pieces {
        events.extend(s.feed(p));
    }
    events.extend(s.finish());
    assert!(
        s.feed("more").is_empty() && s.finish().is_empty(),
        "events after finish"
    );
    outcome(&events)
}

/// The harmony reasoning parser, then the harmony tool-call parser on its
/// text events (reasoning passes by), as the host's pipeline runs them.
fn run_harmony(tail: &str, tools: &Tools, pieces: &[&str]) -> (Outcome, Vec<String>) {
    let mut reasoning = Stream::new(Reasoner::new(ReasoningFormat::Harmony, tail), "");
    let mut calls = Stream::new(
        ToolParser {
            format: Format::Harmony,
            tools: tools.clone(),
        },
        "",
    );
    let mut events = Vec::new();
    let mut stage = |first: Vec<Event>, calls: &mut Stream<ToolParser>| {
        for e in first {
            match e {
                Event::Text(t) => events.extend(calls.feed(&t)),
                other => events.push(other),
            }
        }
    };
    for p in pieces {
        let first = reasoning.feed(p);
        stage(first, &mut calls);
    }
    let first = reasoning.finish();
    stage(first, &mut calls);
    events.extend(calls.finish());
    outcome(&events)
}

/// Whole, char by char, and every two-piece cut agree with `want`.
fn check_splits<P: Parser + Clone>(parser: &P, text: &str, want: &Outcome, label: &str) {
    check_splits_with(|pieces| run(parser, pieces), text, want, label);
}

/// [`check_splits`] with any way to run pieces.
fn check_splits_with(
    run: impl Fn(&[&str]) -> (Outcome, Vec<String>),
    text: &str,
    want: &Outcome,
    label: &str,
) {
    let (whole, ids) = run(&[text]);
    assert_eq!(&whole, want, "{label}: whole text");
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    let (by_char, by_char_ids) = run(&refs);
    assert_eq!(&by_char, want, "{label}: char by char");
    assert_eq!(by_char_ids, ids, "{label}: ids differ char by char");
    for (at, _) in text.char_indices().skip(1) {
        let (a, b) = text.split_at(at);
        let (got, got_ids) = run(&[a, b]);
        assert_eq!(&got, want, "{label}: cut at byte {at} ({a:?} | {b:?})");
        assert_eq!(got_ids, ids, "{label}: ids differ when cut at byte {at}");
    }
}

fn sorted(dir: &Path, want_dirs: bool) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            if want_dirs {
                p.is_dir()
            } else {
                p.extension().is_some_and(|x| x == "txt")
            }
        })
        .collect();
    v.sort();
    v
}

#[test]
fn every_recorded_output_parses_the_same_however_it_is_streamed() {
    let mut cases = 0;
    for dir in sorted(&fixtures(), true) {
        let format = dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        for txt in sorted(&dir, false) {
            let text = std::fs::read_to_string(&txt).expect("text");
            let case: Value = serde_json::from_str(
                &std::fs::read_to_string(txt.with_extension("json")).expect("json"),
            )
            .expect("json");
            let want = expected(&case);
            let label = format!(
                "{format}/{}",
                txt.file_name().and_then(|n| n.to_str()).unwrap_or("?")
            );
            if format == "harmony" {
                // gpt-oss's prompt ends with the assistant's role header.
                let tail = case
                    .get("prompt_tail")
                    .and_then(Value::as_str)
                    .unwrap_or("<|start|>assistant");
                let tools = tools(&case);
                check_splits_with(|p| run_harmony(tail, &tools, p), &text, &want, &label);
            } else if format == "think" {
                let tail = case
                    .get("prompt_tail")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                check_splits(&Think::new(tail), &text, &want, &label);
            } else {
                let format = Format::from_name(&format)
                    .unwrap_or_else(|| panic!("{label}: unknown format dir"));
                check_splits(
                    &ToolParser {
                        format,
                        tools: tools(&case),
                    },
                    &text,
                    &want,
                    &label,
                );
            }
            cases += 1;
        }
    }
    assert!(cases >= 44, "only {cases} cases");
}

#[test]
fn every_format_parses_its_own_call_prefix() {
    let rests = [
        (Format::Hermes, "{\"city\": \"Paris\"}}\n</tool_call>"),
        (Format::Llama3Json, "{\"city\": \"Paris\"}}"),
        (Format::Mistral, "{\"city\": \"Paris\"}}]"),
        (
            Format::Qwen3Coder,
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        ),
        (Format::Pythonic, "city=\"Paris\")]"),
        (Format::Harmony, "{\"city\": \"Paris\"}"),
    ];
    for (format, rest) in rests {
        let parser = ToolParser {
            format,
            tools: Tools::new([("get_weather".to_string(), "{}".to_string())]),
        };
        let text = format!("{}{rest}", format.call_prefix("get_weather"));
        let want = Outcome {
            content: String::new(),
            reasoning: String::new(),
            calls: vec![("get_weather".into(), serde_json::json!({"city": "Paris"}))],
            invalid: Vec::new(),
        };
        check_splits(&parser, &text, &want, &format!("{format:?} call-prefix"));
    }
}
