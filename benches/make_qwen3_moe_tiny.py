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
expert choice in our graph would be a bug, not rounding. The tokenizer is a byte-level BPE
with no merges over 256 tokens (only ids are scored). The shared pieces are in
benches/tiny_fixture.py.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_moe_tiny.py tests/fixtures/models
"""
import os
import sys

import mlx.core as mx
from mlx_lm.models import qwen3_moe

from tiny_fixture import (char_tokenizer, patch_gather_qmm, quantize_and_reload, random_model,
                          write_float32, write_scores)

patch_gather_qmm()

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
model, params = random_model(qwen3_moe, config, seed=11)
tokenizer = char_tokenizer(256)
rows = [
    {"prompt_ids": [5, 17, 200, 42], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [1], "continuation_ids": [2, 3]},
]


def score(out, m):
    router_gaps.clear()
    write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), m, rows)
    print(f"{out}: smallest 2nd-3rd router logit gap {min(router_gaps):.4f}")


dense_dir = os.path.join(root, "qwen3-moe-tiny")
write_float32(dense_dir, config, params, tokenizer, rows)
score(dense_dir, model)

quant_dir = os.path.join(root, "qwen3-moe-tiny-4bit")
score(quant_dir, quantize_and_reload(quant_dir, model, config, tokenizer, rows,
                                     group_size=32, bits=4))
