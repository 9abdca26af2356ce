//! The first-party parser plugins through the real host (wasmtime, the
//! built components, the host's event checks), on the recorded outputs in
//! `tests/fixtures/tool-calls/<format>/<case>.txt` with the expected result
//! in `<case>.json`: for every case, feeding the text whole, one character
//! at a time, and cut into two pieces at every character boundary all give
//! the same merged events, equal to the expected calls and content
//! (`harmony` through both of its parsers, as a gpt-oss request runs them).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlxhost::output::{merge, GenerationEvent, OutputPipeline, ParserSession, ToolDefinition};
use mlxhost::plugin::{PluginHost, PluginLimits};
use serde_json::Value;

fn host() -> Arc<PluginHost> {
    let host =
        PluginHost::load_dir(&mlxhost_e2e::plugins_dir(), PluginLimits::default()).expect("host");
    let tokenizer = mlxhost::model::load_tokenizer(&mlxhost_e2e::model_path()).expect("tokenizer");
    host.set_vocab(Arc::new(mlxhost::plugin::VocabView::new(tokenizer)));
    Arc::new(host)
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("tool-calls")
}

/// What a whole generation amounts to.
#[derive(Debug, PartialEq)]
struct Outcome {
    content: String,
    reasoning: String,
    calls: Vec<(String, Value)>,
    invalid: Vec<String>,
}

fn outcome(events: Vec<GenerationEvent>) -> Outcome {
    let mut o = Outcome {
        content: String::new(),
        reasoning: String::new(),
        calls: Vec::new(),
        invalid: Vec::new(),
    };
    let mut args: Vec<String> = Vec::new();
    for e in merge(events) {
        match e {
            GenerationEvent::Text(t) => o.content.push_str(&t),
            GenerationEvent::Reasoning(t) => o.reasoning.push_str(&t),
            GenerationEvent::ToolCallStart(s) => {
                o.calls.push((s.name, Value::Null));
                args.push(String::new());
            }
            GenerationEvent::ToolCallArgumentsDelta(d) => {
                args[d.index as usize].push_str(&d.arguments)
            }
            GenerationEvent::ToolCallEnd(i) => {
                o.calls[i as usize].1 =
                    serde_json::from_str(&args[i as usize]).expect("arguments are JSON");
            }
            GenerationEvent::InvalidCall(t) => {
                o.content.push_str(&t);
                o.invalid.push(t);
            }
            GenerationEvent::Error(_) => {}
        }
    }
    o
}

fn expected(v: &Value) -> Outcome {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    Outcome {
        content: s("content"),
        reasoning: s("reasoning"),
        calls: v
            .get("calls")
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        (
                            c["name"].as_str().expect("name").to_string(),
                            c["arguments"].clone(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
        invalid: v
            .get("invalid")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Declared tools: the fixture's `tools` list, else every name it calls.
fn tools(v: &Value) -> Vec<ToolDefinition> {
    let names: Vec<String> = match v.get("tools").and_then(Value::as_array) {
        Some(t) => t
            .iter()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect(),
        None => v
            .get("calls")
            .and_then(Value::as_array)
            .map(|c| {
                c.iter()
                    .filter_map(|x| x["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    };
    names
        .into_iter()
        .map(|name| ToolDefinition {
            name,
            parameters_json: "{}".into(),
            description: String::new(),
        })
        .collect()
}

/// A pipeline for `format` (a reasoning parser when it is `think`; both
/// of `harmony`'s parsers, chained, when it is `harmony`).
fn pipeline(host: &Arc<PluginHost>, format: &str, case: &Value) -> OutputPipeline {
    let none = serde_json::json!({});
    if format == "harmony" {
        // gpt-oss's prompt ends with the assistant's role header.
        let tail = case
            .get("prompt_tail")
            .and_then(Value::as_str)
            .unwrap_or("<|start|>assistant");
        let r =
            ParserSession::reasoning_parser(host.clone(), format, tail, &none).expect("session");
        let t = ParserSession::tool_parser(host.clone(), format, &tools(case), true, &none)
            .expect("session");
        OutputPipeline::new(Some(r), Some(t), Vec::new())
    } else if format == "think" {
        let tail = case
            .get("prompt_tail")
            .and_then(Value::as_str)
            .unwrap_or("");
        let r =
            ParserSession::reasoning_parser(host.clone(), format, tail, &none).expect("session");
        OutputPipeline::new(Some(r), None, Vec::new())
    } else {
        let t = ParserSession::tool_parser(host.clone(), format, &tools(case), true, &none)
            .expect("session");
        OutputPipeline::new(None, Some(t), Vec::new())
    }
}

fn run(host: &Arc<PluginHost>, format: &str, case: &Value, pieces: &[&str]) -> Outcome {
    let mut p = pipeline(host, format, case);
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.text(piece).expect("feed"));
    }
    events.extend(p.finish().expect("finish"));
    outcome(events)
}

#[test]
fn every_recorded_output_parses_the_same_however_it_is_streamed() {
    let host = host();
    let mut cases = 0;
    let mut formats: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("fixtures/tool-calls")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    formats.sort();
    for dir in formats {
        let format = dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        let mut texts: Vec<PathBuf> = std::fs::read_dir(&dir)
            .expect("format dir")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        texts.sort();
        for txt in texts {
            let text = std::fs::read_to_string(&txt).expect("text");
            let case: Value = serde_json::from_str(
                &std::fs::read_to_string(txt.with_extension("json")).expect("expected json"),
            )
            .expect("json");
            let want = expected(&case);
            let label = format!("{format}/{}", txt.display());
            let whole = run(&host, &format, &case, &[&text]);
            assert_eq!(whole, want, "{label}: whole text");
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(
                run(&host, &format, &case, &refs),
                want,
                "{label}: char by char"
            );
            for (at, _) in text.char_indices().skip(1) {
                let (a, b) = text.split_at(at);
                assert_eq!(
                    run(&host, &format, &case, &[a, b]),
                    want,
                    "{label}: cut at byte {at}"
                );
            }
            cases += 1;
        }
    }
    assert!(cases >= 44, "only {cases} recorded cases found");
}

#[test]
fn every_tool_parser_can_force_a_call_it_then_parses() {
    let host = host();
    for format in [
        "hermes",
        "llama3-json",
        "mistral",
        "qwen3-coder",
        "pythonic",
        "harmony",
    ] {
        let case = serde_json::json!({"tools": ["get_weather"]});
        let mut p = pipeline(&host, format, &case);
        let prefix = p
            .tool_parser()
            .expect("tool parser")
            .call_prefix("get_weather")
            .expect("call-prefix")
            .expect("a forcible format");
        // What a model writes after the forced prefix, per format.
        let rest = match format {
            "hermes" => "{\"city\": \"Paris\"}}\n</tool_call>",
            "llama3-json" => "{\"city\": \"Paris\"}}",
            "mistral" => "{\"city\": \"Paris\"}}]",
            "qwen3-coder" => "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
            "pythonic" => "city=\"Paris\")]",
            "harmony" => "{\"city\": \"Paris\"}",
            _ => unreachable!(),
        };
        let mut events = p.text(&prefix).expect("prefix");
        events.extend(p.text(rest).expect("rest"));
        events.extend(p.finish().expect("finish"));
        let got = outcome(events);
        assert_eq!(
            got.calls,
            vec![(
                "get_weather".to_string(),
                serde_json::json!({"city": "Paris"})
            )],
            "{format}: {prefix:?} + {rest:?} gave {got:?}"
        );
    }
}
