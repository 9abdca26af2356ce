//! Streaming equals parsing the whole text, on generated inputs: random
//! sequences of the fragments the formats care about (markers, JSON and
//! Python punctuation, names, whitespace, multi-byte chars), fed whole,
//! char by char, and in random pieces.

use crate::formats::{Format, ToolParser};
use crate::harmony::Harmony;
use crate::segment::Parser;
use crate::stream::{Event, Stream};
use crate::think::Think;
use crate::tools::Tools;

const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "{",
    "}",
    "{\"name\": \"f\", \"arguments\": ",
    "{\"name\": \"g\", \"parameters\": ",
    "\"a\"",
    ": ",
    "1",
    ", ",
    "\"x\"",
    "\n",
    " ",
    "é",
    "😀",
    "[",
    "]",
    "```",
    "```json\n",
    ";",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "f",
    "[ARGS]",
    "[CALL_ID]",
    "<function=f>",
    "<function=",
    ">",
    "<parameter=a>",
    "</parameter>",
    "</function>",
    "(",
    ")",
    "f(",
    "a=",
    "'",
    "\"",
    "\\",
    "True",
    "<think>",
    "</think>",
    "<|python_start|>",
    "<|python_end|>",
    "text",
    "<",
    "<|start|>",
    "<|start|>assistant",
    "<|channel|>",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=browser.search",
    " <|constrain|>json",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|",
];

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn events<P: Parser + Clone>(parser: &P, pieces: &[&str]) -> Vec<Event> {
    let mut s = Stream::new(parser.clone(), "salt");
    let mut out = Vec::new();
    for p in pieces {
        out.extend(s.feed(p));
    }
    out.extend(s.finish());
    merge(out)
}

/// Adjacent text (and reasoning) joined, as the host merges them.
fn merge(events: Vec<Event>) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(Event::Text(a)), Event::Text(b)) => a.push_str(&b),
            (Some(Event::Reasoning(a)), Event::Reasoning(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn check<P: Parser + Clone>(parser: &P, text: &str, rng: &mut Rng, label: &str) {
    let whole = events(parser, &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        events(parser, &refs),
        whole,
        "{label}: char by char on {text:?}"
    );
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    for _ in 0..4 {
        let mut cuts: Vec<usize> = (0..rng.below(5))
            .map(|_| bounds[rng.below(bounds.len())])
            .collect();
        cuts.extend([0, text.len()]);
        cuts.sort();
        let pieces: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        assert_eq!(events(parser, &pieces), whole, "{label}: pieces {pieces:?}");
    }
}

/// A JSON value for arguments, with the characters that matter inside
/// strings (close tags, brackets, quotes, escapes, multi-byte chars).
fn json_value(rng: &mut Rng, depth: usize) -> String {
    match rng.below(if depth > 2 { 5 } else { 7 }) {
        0 => "1".into(),
        1 => "\"x\"".into(),
        2 => "\"</tool_call> [TOOL_CALLS] <|python_end|> ]})\"".into(),
        3 => "\"é😀 \\\" \\u00e9\"".into(),
        4 => "true".into(),
        5 => format!(
            "[{}, {}]",
            json_value(rng, depth + 1),
            json_value(rng, depth + 1)
        ),
        _ => json_object(rng, depth + 1),
    }
}

fn json_object(rng: &mut Rng, depth: usize) -> String {
    let n = rng.below(3);
    let fields: Vec<String> = (0..n)
        .map(|k| format!("\"k{k}\": {}", json_value(rng, depth)))
        .collect();
    format!("{{{}}}", fields.join(", "))
}

fn py_value(rng: &mut Rng, depth: usize) -> String {
    match rng.below(if depth > 2 { 5 } else { 7 }) {
        0 => "-1.5".into(),
        1 => "'it\\'s'".into(),
        2 => "\"<|python_end|> ])\"".into(),
        3 => "None".into(),
        4 => "True".into(),
        5 => format!(
            "[{}, ({},)]",
            py_value(rng, depth + 1),
            py_value(rng, depth + 1)
        ),
        _ => format!("{{'k': {}}}", py_value(rng, depth + 1)),
    }
}

fn name(rng: &mut Rng) -> &'static str {
    ["f", "f", "f", "g"][rng.below(4)]
}

/// One call in `format`'s syntax (sometimes a bare form).
fn call(rng: &mut Rng, format: Format) -> String {
    let n = name(rng);
    let args = json_object(rng, 0);
    match format {
        Format::Hermes => match rng.below(4) {
            0 => format!("{{\"name\": \"{n}\", \"arguments\": {args}}}"),
            1 => format!("```json\n{{\"name\": \"{n}\", \"arguments\": {args}}}\n```"),
            _ => format!("<tool_call>\n{{\"name\": \"{n}\", \"arguments\": {args}}}\n</tool_call>"),
        },
        Format::Llama3Json => {
            let one = |rng: &mut Rng| format!("{{\"name\": \"{}\", \"parameters\": {}}}", name(rng), json_object(rng, 0));
            let list = if rng.below(2) == 0 { one(rng) } else { format!("{}; {}", one(rng), one(rng)) };
            if rng.below(3) == 0 { list } else { format!("<|python_tag|>{list}") }
        }
        Format::Mistral => match rng.below(2) {
            0 => format!("[TOOL_CALLS][{{\"name\": \"{n}\", \"arguments\": {args}}}, {{\"name\": \"f\", \"arguments\": {{}}}}]"),
            _ => format!("[TOOL_CALLS]{n}[ARGS]{args}"),
        },
        Format::Qwen3Coder => {
            let params: String = (0..rng.below(3))
                .map(|k| format!("<parameter=p{k}>\n{}\n</parameter>\n", [args.as_str(), "Paris", "3", "a </tool_call> b"][rng.below(4)]))
                .collect();
            format!("<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
        }
        Format::Pythonic => {
            let one = |rng: &mut Rng| format!("{}(a={}, b={})", name(rng), py_value(rng, 0), py_value(rng, 0));
            let list = format!("[{}, {}]", one(rng), one(rng));
            if rng.below(2) == 0 { list } else { format!("<|python_start|>{list}<|python_end|>") }
        }
        Format::Harmony => {
            let analysis = ["", "<|channel|>analysis<|message|>Think é.<|end|><|start|>assistant"][rng.below(2)];
            let end = ["<|call|>", "", "<|end|>"][rng.below(3)];
            match rng.below(3) {
                0 => format!("{analysis}<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{args}{end}"),
                1 => format!("{analysis}<|start|>assistant to=functions.{n}<|channel|>commentary json<|message|>{args}{end}"),
                _ => format!("{analysis}<|channel|>final<|message|>Done 😀.<|return|>"),
            }
        }
    }
}

/// A plausible output with perhaps a mutation (cut short, a span deleted,
/// a fragment inserted).
fn output(rng: &mut Rng, format: Format) -> String {
    let texts = [
        "",
        "",
        "Sure.\n",
        "ok ",
        "\n\n",
        "é😀 text",
        "<think>\nhm\n</think>\n\n",
    ];
    let mut s = String::new();
    for _ in 0..1 + rng.below(3) {
        s.push_str(texts[rng.below(texts.len())]);
        s.push_str(&call(rng, format));
    }
    s.push_str(texts[rng.below(texts.len())]);
    let bounds: Vec<usize> = s.char_indices().map(|(i, _)| i).chain([s.len()]).collect();
    let at = bounds[rng.below(bounds.len())];
    match rng.below(5) {
        0 => s.truncate(at),
        1 => {
            // At most 8 bytes, ending on a char boundary.
            let to = bounds[rng.below(bounds.len())].max(at).min(at + 8);
            let to = bounds
                .iter()
                .rev()
                .find(|&&b| b <= to)
                .copied()
                .unwrap_or(at);
            s.replace_range(at..to, "");
        }
        2 => s.insert_str(at, FRAGMENTS[rng.below(FRAGMENTS.len())]),
        _ => {}
    }
    s
}

#[test]
fn generated_calls_stream_the_same_in_every_format() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let declared = Tools::new([("f".to_string(), "{}".to_string())]);
    let mut calls = 0;
    for round in 0..1500 {
        let (_, source) = Format::ALL[round % Format::ALL.len()];
        let text = output(&mut rng, source);
        for (name, format) in Format::ALL {
            let tools = if round % 4 == 0 {
                Tools::default()
            } else {
                declared.clone()
            };
            let parser = ToolParser { format, tools };
            calls += events(&parser, &[&text])
                .iter()
                .filter(|e| matches!(e, Event::CallEnd(_)))
                .count();
            check(&parser, &text, &mut rng, name);
        }
        check(&Think::new(""), &text, &mut rng, "think");
        check(
            &Harmony::reasoning("<|start|>assistant"),
            &text,
            &mut rng,
            "harmony reasoning",
        );
    }
    // The generator must actually exercise calls.
    assert!(calls > 1000, "only {calls} calls parsed");
}

#[test]
fn random_outputs_stream_the_same_in_every_format() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let declared = Tools::new([("f".to_string(), "{}".to_string())]);
    for round in 0..3000 {
        let n = 1 + rng.below(24);
        let text: String = (0..n)
            .map(|_| FRAGMENTS[rng.below(FRAGMENTS.len())])
            .collect();
        for (name, format) in Format::ALL {
            let tools = if round % 3 == 0 {
                Tools::default()
            } else {
                declared.clone()
            };
            check(&ToolParser { format, tools }, &text, &mut rng, name);
        }
        for tail in ["", "<think>", "<think>\n"] {
            check(&Think::new(tail), &text, &mut rng, "think");
        }
        for tail in ["<|start|>assistant", "<|channel|>analysis<|message|>"] {
            check(
                &Harmony::reasoning(tail),
                &text,
                &mut rng,
                "harmony reasoning",
            );
        }
    }
}

/// Long outputs cost linear time: each delta re-parses only from the last
/// safe point (a quadratic parser would take minutes here).
#[test]
fn long_outputs_are_parsed_incrementally() {
    let sentence = "Some prose with <angle> brackets, [squares] and {braces}. ";
    let long: String = sentence.repeat(2000);
    let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
    let text = format!("{long}{call}{long}");
    let declared = Tools::new([("f".to_string(), "{}".to_string())]);
    let start = std::time::Instant::now();
    for (_, format) in Format::ALL {
        let mut s = Stream::new(
            ToolParser {
                format,
                tools: declared.clone(),
            },
            "",
        );
        let mut n = 0;
        for piece in text.as_bytes().chunks(4) {
            n += s.feed(std::str::from_utf8(piece).unwrap_or("")).len();
        }
        n += s.finish().len();
        assert!(n > 0);
    }
    let think = format!("<think>\n{long}\n</think>\n\n{long}");
    let mut s = Stream::new(Think::new(""), "");
    for piece in think.as_bytes().chunks(4) {
        s.feed(std::str::from_utf8(piece).unwrap_or(""));
    }
    s.finish();
    assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
}
