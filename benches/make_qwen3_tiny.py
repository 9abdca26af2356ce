"""Makes tests/fixtures/models/qwen3-tiny/: a Qwen3 model on small random weights, built and
saved by mlx-lm 0.32.2 itself (`mlx_lm.models.qwen3.Model`), with mlx-lm's teacher-forced
top-5 logprobs for a few rows (`mlx-lm-scores.jsonl`, `mlxhost score`'s format), so the test
suite checks our `qwen3` graph (per-head q/k RMSNorm, explicit head_dim, tied head) against
mlx-lm without mlx-lm installed.

Weights are normal with std 0.3 (mlx-lm's default init gives nearly uniform logits, where every
top-5 is a near-tie). The tokenizer is a byte-level BPE with no merges over 512 tokens (only
ids are scored).

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_tiny.py tests/fixtures/models/qwen3-tiny
"""
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
mx.random.seed(7)
config = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 512, "max_position_embeddings": 1024, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}
model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
params = tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters())
# Norm weights around 1, as trained models have them.
params = dict(tree_flatten(params))
for k in params:
    if k.endswith("norm.weight"):
        params[k] = 1.0 + params[k] * 0.3
model.load_weights(list(params.items()))
mx.save_safetensors(os.path.join(out, "model.safetensors"), params, metadata={"format": "mlx"})
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({**config, "architectures": ["Qwen3ForCausalLM"]}, f, indent=1)

# A minimal tokenizer.json: 512 single-character tokens, no merges.
chars = [chr(0x100 + i) for i in range(512)]
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
       "model": {"type": "BPE", "dropout": None, "unk_token": None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}}
with open(os.path.join(out, "tokenizer.json"), "w") as f:
    json.dump(tok, f)
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": chars[1]}, f)

rows = [
    {"prompt_ids": [5, 17, 300, 42], "continuation_ids": [7, 7, 100, 511, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [1], "continuation_ids": [2, 3]},
]
with open(os.path.join(out, "rows.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
with open(os.path.join(out, "mlx-lm-scores.jsonl"), "w") as f:
    for r in rows:
        ids = mx.array([r["prompt_ids"] + r["continuation_ids"]])
        logits = model(ids)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        steps = []
        for i, t in enumerate(r["continuation_ids"]):
            row = lp[len(r["prompt_ids"]) - 1 + i]
            top = mx.argsort(-row)[:5].tolist()
            steps.append({"token": t, "logprob": row[t].item(),
                          "top": [[k, row[k].item()] for k in top]})
        f.write(json.dumps({"steps": steps}) + "\n")
