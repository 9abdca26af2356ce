"""Makes tests/fixtures/models/qwen3-next-tiny/ and qwen3-next-tiny-4bit/: a Qwen3-Next model
(`model_type: qwen3_next`, Qwen3-Next-80B-A3B's architecture: Qwen3.5's hybrid of gated-DeltaNet
linear attention and gated full attention, with the DeltaNet projections fused per key head as
`in_proj_qkvz` / `in_proj_ba`, and mixture-of-experts MLPs with a gated shared expert) on small
random weights, built by mlx-lm 0.32.2 itself (`mlx_lm.models.qwen3_next.Model`), with mlx-lm's
teacher-forced top-5 logprobs for a few rows (`mlx-lm-scores.jsonl`), so the test suite checks
our `qwen3_next` graph against mlx-lm without mlx-lm installed.

The config is Qwen3-Next-80B-A3B's `config.json` with every size shrunk (hidden 64, 5 layers:
layer 3 full attention, the others DeltaNet; 8 attention heads of 32 over 2 KV heads, partial
RoPE on a quarter; DeltaNet with 2 key heads of 32 and 4 value heads of 16, a 4-tap conv; 8
experts of width 32, 2 per token, renormalised, a shared expert of width 48 behind its sigmoid
gate; layer 1 dense through `mlp_only_layers`; vocabulary 256) and every structural feature kept.
The smallest gap between a token's 2nd and 3rd router logit over the scored rows is printed.

- `qwen3-next-tiny`: float32 weights; scores from mlx-lm in float32.
- `qwen3-next-tiny-4bit`: mlx-lm's own `quantize_model` (4 bits, group 32; its predicate puts
  the router and the shared expert's gate at 8 bits, group 64), reloaded by `load_model`.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_next_tiny.py tests/fixtures/models
"""
import os
import sys

import mlx.core as mx
from mlx_lm.models import qwen3_next

from tiny_fixture import (byte_level_tokenizer, decode_gap, patch_gather_qmm, quantize_and_reload,
                          random_model, write_float32, write_scores)

patch_gather_qmm()

router_gaps = []
_moe_call = qwen3_next.Qwen3NextSparseMoeBlock.__call__


def _moe_call_recording(self, x):
    top = mx.sort(self.gate(x), axis=-1)
    router_gaps.append(mx.min(top[..., -2] - top[..., -3]).item())
    return _moe_call(self, x)


qwen3_next.Qwen3NextSparseMoeBlock.__call__ = _moe_call_recording

root = sys.argv[1]
config = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 64, "num_hidden_layers": 5, "intermediate_size": 96,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "vocab_size": 256, "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "attention_bias": False, "rope_scaling": None,
    "eos_token_id": 1, "torch_dtype": "float32",
}
model, params = random_model(qwen3_next, config, seed=80)
tokenizer = byte_level_tokenizer()

rows = [
    {"prompt_ids": [(i * 37 + 11) % 256 for i in range(150)],
     "continuation_ids": [10, 20, 30, 40, 50, 60, 70, 80]},
    {"prompt_ids": list(range(40, 110)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [5, 17, 200, 42], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": [2], "continuation_ids": [2, 3]},
]


def score(out, m):
    router_gaps.clear()
    margin = write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), m, rows)
    print(f"{out}: smallest top-2 margin {margin:.4f} nats, "
          f"smallest 2nd-3rd router gap {min(router_gaps):.2e}")


dense_dir = os.path.join(root, "qwen3-next-tiny")
write_float32(dense_dir, config, params, tokenizer, rows)
score(dense_dir, model)
print(f"mlx-lm cached decode vs one pass (long row): {decode_gap(model, rows[0]):.2e} nats")

quant_dir = os.path.join(root, "qwen3-next-tiny-4bit")
score(quant_dir, quantize_and_reload(quant_dir, model, config, tokenizer, rows,
                                     group_size=32, bits=4))
