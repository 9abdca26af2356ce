"""Makes tests/fixtures/models/<name>.llama-cpp.json: what llama.cpp itself (llama-cpp-python
0.3.16, which vendors it) does with a GGUF, for mlxhost's model tests:

* "tokenize": a corpus of texts (unicode, emoji, digits, runs of spaces and newlines, special
  tokens) and llama.cpp's ids for each (`tokenize(add_bos=False, special=True)`), with the text
  llama.cpp decodes those ids to (`detokenize(special=True)`);
* "cases": prompts rendered with the GGUF's own chat template (jinja2, as llama-cpp-python
  renders it; with `tools` for the tool-calling case), their ids, llama.cpp's greedy
  continuation (argmax of its logits, step by step), and teacher-forced top-5 logprobs (natural
  log, log-softmax of its float32 logits) at every step of that continuation.

llama.cpp computes quantized products with activations rounded to 8 bits (Q8_K / Q8_0), so its
logprobs differ from a float32 path by more than float rounding.

A GGUF without a chat template (a base model such as Gemma 3 270M) gets plain-text cases instead:
the text as is, tokenized the way llama.cpp tokenizes a prompt (`tokenize(add_bos=True,
special=True)`: BOS first when the GGUF's tokenizer.ggml.add_bos_token says so, which it does for
Gemma 3), among them a multi-turn Gemma-style chat text of over 650 tokens (past Gemma 3's
512-token sliding window). "prompt_text" is the text without BOS; "prompt_ids" are what was
evaluated. The greedy continuation stops at an end-of-generation token (EOS, EOT, and whatever
llama.cpp's vocabulary marks as end-of-generation, e.g. Gemma's <end_of_turn>).

Top level also: "add_bos" (llama.cpp put BOS first in a prompt), "bos_id", "stop_ids" (the
end-of-generation ids the greedy loop stopped on). n_ctx is 4096, 1024 for a vocabulary over
200k (llama-cpp-python keeps n_ctx x n_vocab float32 logits).

The tokenizer corpus is the common entries plus entries for the model's family (Gemma: its turn
markers, <bos>, runs of spaces/tabs/newlines that are pieces of their own, "▁", byte-fallback
characters, ...).

Run (benches/llama_cpp_env.sh builds the venv):
  source benches/llama_cpp_env.sh
  $LLAMA_VENV/bin/python benches/make_model_fixtures.py GGUF NAME > tests/fixtures/models/NAME.llama-cpp.json
Made this way (n_threads=2, CPU):
  qwen2.5-coder-0.5b-instruct  from qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (`mlxhost models pull qwen2.5-coder-0.5b`)
  gemma3-270m                  from gemma-3-270m-q4_k_m.gguf (`mlxhost models pull gemma3-270m`)
  smollm2-135m                 from SmolLM2-135M-Instruct.Q4_1.gguf (scripts/setup.sh)
"""
import json
import sys

import jinja2
import numpy as np
import llama_cpp
from llama_cpp import Llama

path, name = sys.argv[1], sys.argv[2]
STEPS = 24

# llama-cpp-python keeps an n_ctx x n_vocab float32 array of logits: 4096 x 262k (Gemma) would
# be 4 GiB, and the longest prompt here is under 1024 tokens.
probe = Llama(model_path=path, vocab_only=True, verbose=False)
n_ctx = 4096 if probe.n_vocab() < 200_000 else 1024
del probe
llm = Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0)
template_src = llm.metadata.get("tokenizer.chat_template")
arch = llm.metadata.get("general.architecture", "")

COMMON_CORPUS = [
    "Hello, world!",
    "  two leading spaces and    four inside",
    "tabs\tand\nnewlines\n\n\nthree",
    "digits 1234567890 and 3.14159, 1,000,000",
    "unicode: naïve café, Ärger, 東京タワー, Привет мир, مرحبا",
    "emoji: 🙂🚀👩‍💻 and flags 🇫🇷",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "don't won't I'm we'll they've she'd IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<|endoftext|>text after a special token",
    "   \n\t  \r\n mixed whitespace   ",
]

# Gemma (SentencePiece, 262k pieces, byte fallback; newline, space and tab runs are pieces of
# their own, "user-defined", matched before the rest of the text).
GEMMA_CORPUS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text",
    "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n<eos>",
    "a  b   c    d     e      f       g        h",
    "  leading spaces",
    "trailing spaces  ",
    "x\n\n\n\ny",
    "\n\n\n\n",
    "\ttab\t\ttwo\t\t\tthree",
    "\u2581",
    "word\u2581word \u2581\u2581 x",
    "中文分词测试：我们今天去北京大学。日本語のテキストです。한국어 텍스트",
    "emoji ZWJ: 👨‍👩‍👧‍👦 👩🏽‍🚀 🏳️‍🌈 ❤️‍🔥",
    "rare: 𠀀𪚥 🫨 🪿 and control \u0007 char",
    "numbers 12345678901234567890 3.14159265358979 -0.000001 1e-9",
    "<table><tr><td>cell</td></tr></table> <strong>bold</strong>",
    "<unused0> <mask> [multimodal] <start_of_image>",
    "ALL CAPS, Title Case, camelCaseIdentifier, snake_case_identifier",
]

CORPUS = COMMON_CORPUS + (GEMMA_CORPUS if arch.startswith("gemma") else [])

def tokenize(text):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

def tokenize_prompt(text):
    """As llama.cpp tokenizes a prompt: BOS first when the GGUF says add_bos_token."""
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

# End of generation: EOS, EOT, and what llama.cpp's vocabulary marks as such (Gemma's
# <end_of_turn>, Qwen's <|im_end|>, ...).
_vocab = llama_cpp.llama_model_get_vocab(llm.model)
STOP_IDS = sorted({t for t in (llm.token_eos(), llama_cpp.llama_vocab_eot(_vocab)) if t >= 0}
                  | {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(_vocab, t)})

def render(messages, tools=None):
    env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    tmpl = env.from_string(template_src)
    return tmpl.render(messages=messages, tools=tools, add_generation_prompt=True,
                       bos_token="", eos_token="")

def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())

def greedy_and_scores(prompt_ids):
    llm.reset()
    llm.eval(prompt_ids)
    out = []
    for _ in range(STEPS):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        if nxt in STOP_IDS:
            break
        llm.eval([nxt])
    steps = []
    for i, tok in enumerate(out):
        lp = log_softmax(llm.scores[len(prompt_ids) - 1 + i])
        top = np.argsort(-lp)[:5]
        steps.append({"token": tok, "logprob": float(lp[tok]),
                      "top5": [[int(t), float(lp[t])] for t in top]})
    return out, steps

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a timezone",
        "parameters": {"type": "object",
                       "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"]},
    },
}

CASES = [
    {"messages": [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "What is the capital of France? Answer in one word."}]},
    {"messages": [{"role": "user", "content": "What is the weather like in Paris right now?"}],
     "tools": [WEATHER, TIME]},
]

# A long multi-turn chat in Gemma's turn format, as plain text (over 650 tokens: past Gemma 3's
# 512-token sliding window).
TOPICS = [
    ("How do tides work?",
     "Tides are caused mainly by the Moon's gravity pulling on the oceans. The side of the Earth "
     "facing the Moon feels a stronger pull, and the far side a weaker one, so the water bulges in "
     "two places. As the Earth turns, a coastline passes through both bulges, which is why most "
     "places see two high tides and two low tides every day. The Sun adds a smaller effect: when "
     "Sun and Moon line up, at new and full moon, we get larger spring tides."),
    ("Can you explain what a hash table is?",
     "A hash table stores key-value pairs in an array. A hash function turns each key into an "
     "index, so looking a key up takes about constant time on average. When two keys land on the "
     "same index, the table resolves the collision, either by keeping a small list at each slot "
     "or by probing for the next free slot. Good hash functions spread keys evenly, and the table "
     "grows and rehashes its entries when it gets too full."),
    ("What should I pack for a three-day hike in the mountains?",
     "Bring layers: a base layer that wicks sweat, a warm fleece, and a waterproof shell, because "
     "mountain weather changes quickly. Pack a map and compass even if you carry a phone, a "
     "headlamp with spare batteries, a first-aid kit, sun protection, and enough food for an "
     "extra day. Water is heavy, so plan your route around streams and carry a filter. Finally, "
     "tell someone where you are going and when you expect to be back."),
    ("Why is the sky blue?",
     "Sunlight contains every colour, but air molecules scatter short wavelengths much more than "
     "long ones. Blue light is scattered across the whole sky, so wherever you look away from the "
     "Sun you see blue. At sunrise and sunset the light travels through far more air, most of the "
     "blue is scattered away before it reaches you, and the reds and oranges remain."),
    ("Give me a tip for learning a new language.",
     "Practise a little every day rather than a lot once a week. Short daily sessions of reading, "
     "listening and speaking build memory far better than cramming. Try to use the language for "
     "things you already enjoy, such as films, songs or recipes, and do not be afraid of mistakes: "
     "every conversation, even a clumsy one, teaches you something new."),
    ("How does a refrigerator keep food cold?",
     "A refrigerator moves heat rather than making cold. A pump compresses a refrigerant gas, "
     "which heats it up; the hot gas gives its heat to the kitchen through the coils at the back "
     "and condenses into a liquid. The liquid then passes through a narrow valve, expands, and "
     "evaporates inside the fridge, absorbing heat from the food compartment. The gas returns to "
     "the pump and the cycle repeats, steered by a thermostat that switches it on and off. Foam "
     "insulation in the walls and a rubber seal around the door keep the kitchen's heat out."),
]
LONG_CHAT = "".join(
    f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n"
    for q, a in TOPICS
) + "<start_of_turn>user\nThank you! Now summarise our whole conversation in three bullet points.<end_of_turn>\n<start_of_turn>model\n"

PLAIN_CASES = [
    {"prompt": "The capital of France is"},
    {"prompt": "def fibonacci(n):\n"},
    {"prompt": LONG_CHAT},
]

cases = []
if template_src is None:
    # A base model: the text as is, BOS first the way llama.cpp adds it.
    for case in PLAIN_CASES:
        text = case["prompt"]
        ids = tokenize_prompt(text)
        greedy, steps = greedy_and_scores(ids)
        cases.append({"prompt_text": text, "prompt_ids": ids, "greedy_ids": greedy,
                      "greedy_text": llm.detokenize(greedy, special=True).decode("utf-8", "replace"),
                      "greedy_prefix_texts": [llm.detokenize(greedy[:k]).decode("utf-8", "replace")
                                              for k in range(1, len(greedy) + 1)],
                      "teacher_forced_top5": steps})
for case in (CASES if template_src is not None else []):
    text = render(case["messages"], case.get("tools"))
    ids = tokenize(text)
    greedy, steps = greedy_and_scores(ids)
    cases.append({**case, "prompt_text": text, "prompt_ids": ids, "greedy_ids": greedy,
                  "greedy_text": llm.detokenize(greedy, special=True).decode("utf-8", "replace"),
                  # Text of the first k greedy tokens, special tokens left out (what a
                  # server returns), k = 1..n: to compare up to a near-tie.
                  "greedy_prefix_texts": [llm.detokenize(greedy[:k]).decode("utf-8", "replace")
                                          for k in range(1, len(greedy) + 1)],
                  "teacher_forced_top5": steps})

print(json.dumps({
    "source": "llama-cpp-python 0.3.16 (llama.cpp), CPU, n_threads=2",
    "model": name,
    "add_bos": tokenize_prompt("x")[:1] == [llm.token_bos()],
    "bos_id": llm.token_bos(),
    "stop_ids": STOP_IDS,
    # "detokenized": llama.cpp's text back from the ids (special tokens kept); not always the
    # text: SentencePiece reads a literal "\u2581" as a space.
    "tokenize": [{"text": t, "ids": tokenize(t),
                  "detokenized": llm.detokenize(tokenize(t), special=True).decode("utf-8", "replace")}
                 for t in CORPUS],
    "cases": cases,
}, ensure_ascii=False, indent=1))
