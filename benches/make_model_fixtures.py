"""Makes tests/fixtures/models/<name>.llama-cpp.json: what llama.cpp itself (llama-cpp-python
0.3.16, which vendors it) does with a GGUF, for mlxhost's model tests:

* "tokenize": a corpus of texts (unicode, emoji, digits, runs of spaces and newlines, special
  tokens) and llama.cpp's ids for each (`tokenize(add_bos=False, special=True)`);
* "cases": prompts rendered with the GGUF's own chat template (jinja2, as llama-cpp-python
  renders it; with `tools` for the tool-calling case), their ids, llama.cpp's greedy
  continuation (argmax of its logits, step by step), and teacher-forced top-5 logprobs (natural
  log, log-softmax of its float32 logits) at every step of that continuation.

llama.cpp computes quantized products with activations rounded to 8 bits (Q8_K / Q8_0), so its
logprobs differ from a float32 path by more than float rounding.

Run (benches/llama_cpp_env.sh builds the venv):
  source benches/llama_cpp_env.sh
  $LLAMA_VENV/bin/python benches/make_model_fixtures.py GGUF NAME > tests/fixtures/models/NAME.llama-cpp.json
"""
import json
import sys

import jinja2
import numpy as np
from llama_cpp import Llama

path, name = sys.argv[1], sys.argv[2]
STEPS = 24

llm = Llama(model_path=path, n_ctx=4096, logits_all=True, verbose=False, n_threads=2, seed=0)
template_src = llm.metadata.get("tokenizer.chat_template")

CORPUS = [
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

def tokenize(text):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

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
        if nxt in (llm.token_eos(),):
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

cases = []
for case in CASES:
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
    "tokenize": [{"text": t, "ids": tokenize(t)} for t in CORPUS],
    "cases": cases,
}, ensure_ascii=False, indent=1))
