"""Makes tests/fixtures/models/qwen3-tiny/: a Qwen3 model on small random weights, built and
saved by mlx-lm 0.32.2 itself (`mlx_lm.models.qwen3.Model`), with mlx-lm's teacher-forced
top-5 logprobs for a few rows (`mlx-lm-scores.jsonl`, `mlxhost score`'s format), so the test
suite checks our `qwen3` graph (per-head q/k RMSNorm, explicit head_dim, tied head) against
mlx-lm without mlx-lm installed.

Weights are normal with std 0.3 (mlx-lm's default init gives nearly uniform logits, where every
top-5 is a near-tie), norm weights around 1 (`1 + 0.3 * normal`). The tokenizer is a
byte-level BPE with no merges over 512 tokens (only ids are scored). The shared pieces are in
benches/tiny_fixture.py.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_tiny.py tests/fixtures/models/qwen3-tiny
"""
import os
import sys

from mlx_lm.models import qwen3

from tiny_fixture import char_tokenizer, random_model, write_float32, write_scores

out = sys.argv[1]
config = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 512, "max_position_embeddings": 1024, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}
model, params = random_model(qwen3, config, seed=7)
rows = [
    {"prompt_ids": [5, 17, 300, 42], "continuation_ids": [7, 7, 100, 511, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [1], "continuation_ids": [2, 3]},
]
write_float32(out, {**config, "architectures": ["Qwen3ForCausalLM"]}, params,
              char_tokenizer(512), rows)
write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), model, rows)
