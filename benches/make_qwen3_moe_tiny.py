"""Makes tests/fixtures/models/qwen3-moe-tiny/ and qwen3-moe-tiny-4bit/: a Qwen3-MoE model
(`model_type: qwen3_moe`, the architecture of Qwen3-30B-A3B and Qwen3-Coder-30B-A3B) on small
random weights, built by mlx-lm 0.32.2 itself (`mlx_lm.models.qwen3_moe.Model`), with mlx-lm's
teacher-forced top-5 logprobs for a few rows (`mlx-lm-scores.jsonl`, `mlxhost score`'s format),
so the test suite checks our `qwen3_moe` graph (router softmax, top-k, renormalised scores, the
chosen experts' SwiGLU through gather_mm / gather_qmm, a dense layer among sparse ones) against
mlx-lm without mlx-lm installed.

The config is Qwen3-30B-A3B's with every size shrunk (hidden 64, 3 layers, 8 experts, top-2,
expert width 32, head_dim 16, vocabulary 256) and every structural feature kept: per-head q/k
RMSNorm, explicit head_dim, untied head, `norm_topk_prob: true`, `decoder_sparse_step: 1`, and
layer 1 dense through `mlp_only_layers` (the real model has none; mlx-lm supports it, so we do).

- `qwen3-moe-tiny`: float32 weights (~0.7 MB); scores from mlx-lm in float32.
- `qwen3-moe-tiny-4bit`: the same model quantized by mlx-lm's own `quantize_model` (4 bits,
  group 32, affine; the router `mlp.gate` at 8 bits, group 64 by `Model.quant_predicate`,
  written as per-module `quantization` entries), float32 scales; scores from that quantized
  model. It is reloaded with `mlx_lm.utils.load_model` before scoring, so the directory is what
  mlx-lm loads.

Weights are normal with std 0.3 (mlx-lm's default init gives nearly uniform logits, where every
top-5 is a near-tie), norm weights around 1. At that scale the second expert keeps a real share
of each token's output (a median weight near 0.3), and over these rows the smallest gap between
a token's 2nd and 3rd router logit is printed: a gap far above float32 noise means a flipped
expert choice in our graph would be a bug, not rounding. The tokenizer is a byte-level BPE with no merges over 256 tokens (only ids are scored).

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_moe_tiny.py tests/fixtures/models
"""
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3_moe
from pathlib import Path

from mlx_lm.utils import load_model, quantize_model, save_model

# mlx-lm 0.32.2's QuantizedSwitchLinear passes `global_scale=None` to `mx.gather_qmm`, a keyword
# MLX 0.32.2 (the version mlxhost links) does not have yet: its quantized MoE raises a TypeError
# there. `None` means "no global scale", which is what 0.32.2's op computes, so drop the keyword.
_gather_qmm = mx.gather_qmm


def _gather_qmm_compat(*args, global_scale=None, **kwargs):
    if global_scale is not None:
        raise ValueError("global_scale needs a newer MLX")
    return _gather_qmm(*args, **kwargs)


mx.gather_qmm = _gather_qmm_compat

# The smallest gap between a token's 2nd- and 3rd-largest router logit while scoring (how far
# the top-2 choice is from a tie).
router_gaps = []
_moe_call = qwen3_moe.Qwen3MoeSparseMoeBlock.__call__


def _moe_call_recording(self, x):
    top = mx.sort(self.gate(x), axis=-1)
    router_gaps.append(mx.min(top[..., -2] - top[..., -3]).item())
    return _moe_call(self, x)


qwen3_moe.Qwen3MoeSparseMoeBlock.__call__ = _moe_call_recording

root = sys.argv[1]
mx.random.seed(11)
config = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "vocab_size": 256, "max_position_embeddings": 1024,
    "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "attention_bias": False, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 3, "torch_dtype": "float32",
}
model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
params = tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters())
params = dict(tree_flatten(params))
for k in params:
    if k.endswith("norm.weight"):
        params[k] = 1.0 + params[k] * 0.3
model.load_weights(list(params.items()))
mx.eval(model.parameters())

rows = [
    {"prompt_ids": [5, 17, 200, 42], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [1], "continuation_ids": [2, 3]},
]


def write_common(out, cfg):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    # A minimal tokenizer.json: 256 single-character tokens, no merges.
    chars = [chr(0x100 + i) for i in range(256)]
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
    with open(os.path.join(out, "rows.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_scores(out, m):
    """mlx-lm's teacher-forced logprobs of each row's continuation, with its top-5."""
    router_gaps.clear()
    with open(os.path.join(out, "mlx-lm-scores.jsonl"), "w") as f:
        for r in rows:
            ids = mx.array([r["prompt_ids"] + r["continuation_ids"]])
            logits = m(ids)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            steps = []
            for i, t in enumerate(r["continuation_ids"]):
                row = lp[len(r["prompt_ids"]) - 1 + i]
                top = mx.argsort(-row)[:5].tolist()
                steps.append({"token": t, "logprob": row[t].item(),
                              "top": [[k, row[k].item()] for k in top]})
            f.write(json.dumps({"steps": steps}) + "\n")
    print(f"{out}: smallest 2nd-3rd router logit gap {min(router_gaps):.4f}")


dense_dir = os.path.join(root, "qwen3-moe-tiny")
write_common(dense_dir, config)
mx.save_safetensors(os.path.join(dense_dir, "model.safetensors"), params,
                    metadata={"format": "mlx"})
write_scores(dense_dir, model)

quant_dir = os.path.join(root, "qwen3-moe-tiny-4bit")
model, qconfig = quantize_model(model, config, group_size=32, bits=4)
write_common(quant_dir, qconfig)
save_model(quant_dir, model)
for extra in ["model.safetensors.index.json"]:
    path = os.path.join(quant_dir, extra)
    if os.path.exists(path):
        os.remove(path)
reloaded = load_model(Path(quant_dir))[0]
write_scores(quant_dir, reloaded)
