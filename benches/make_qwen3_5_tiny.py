"""Makes tests/fixtures/models/qwen3.5-tiny/ and qwen3.5-tiny-4bit/: a Qwen3.5 model
(`model_type: qwen3_5`, the hybrid of gated-DeltaNet linear attention and gated full attention
every Qwen3.5 size uses) on small random weights, built by mlx-lm 0.32.2 itself
(`mlx_lm.models.qwen3_5.Model`), with mlx-lm's teacher-forced top-5 logprobs for a few rows
(`mlx-lm-scores.jsonl`, `mlxhost score`'s format), so the test suite checks our `qwen3_5` graph
against mlx-lm without mlx-lm installed.

The config is a Qwen3.5 `config.json` (a `qwen3_5` config whose `text_config` holds the
decoder, `rope_parameters` with `partial_rotary_factor` 0.25) with every size shrunk (hidden 64,
6 layers, 8 attention heads of 32 over 2 KV heads, linear attention with 2 key heads and 4 value
heads of 32 and 16, a 4-tap causal conv, vocabulary 256) and every structural feature kept:
`full_attention_interval: 4` (layers 3 full, the others gated DeltaNet, one of them after the
full layer), more value heads than key heads in the linear layers, per-head q/k RMSNorm and the
output gate folded into `q_proj` in the full layers, partial RoPE (8 of 32 dims), the gated
RMSNorm before `out_proj`, an untied head.

Rows: a prompt of 150 tokens and one of 70 (longer than mlxhost's 64-token DeltaNet chunk, so
the chunked prefill runs over several chunks and a padded tail), short ones, and a 1-token
prompt.

- `qwen3.5-tiny`: float32 weights; scores from mlx-lm in float32.
- `qwen3.5-tiny-4bit`: the same model quantized by mlx-lm's own `quantize_model` (4 bits,
  group 32, affine; the linears whose input width is not a multiple of 32 stay float), scores
  from that quantized model reloaded with `mlx_lm.utils.load_model`.

Weights are normal with std 0.3, norm weights around 1 (benches/tiny_fixture.py). mlx-lm's
one-pass scores use its sequential DeltaNet recurrence (`gated_delta_ops` on the CPU); the
printed cached-decode gap says its cached path (conv and recurrent state carried step to step)
agrees with them.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_qwen3_5_tiny.py tests/fixtures/models
"""
import os
import sys

from mlx_lm.models import qwen3_5

from tiny_fixture import (byte_level_tokenizer, decode_gap, quantize_and_reload, random_model,
                          write_float32, write_scores)

root = sys.argv[1]
text_config = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 96,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "rms_norm_eps": 1e-6, "vocab_size": 256,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True},
    "eos_token_id": 1,
}
config = {
    "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": text_config, "tie_word_embeddings": False, "torch_dtype": "float32",
}
model, params = random_model(qwen3_5, config, seed=35)
tokenizer = byte_level_tokenizer()

rows = [
    {"prompt_ids": [(i * 37 + 11) % 256 for i in range(150)],
     "continuation_ids": [10, 20, 30, 40, 50, 60, 70, 80]},
    {"prompt_ids": list(range(40, 110)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [5, 17, 200, 42], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": [2], "continuation_ids": [2, 3]},
]


def score(out, m):
    margin = write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), m, rows)
    print(f"{out}: smallest top-2 margin {margin:.4f} nats")


dense_dir = os.path.join(root, "qwen3.5-tiny")
write_float32(dense_dir, config, params, tokenizer, rows)
score(dense_dir, model)
print(f"mlx-lm cached decode vs one pass (long row): {decode_gap(model, rows[0]):.2e} nats")

quant_dir = os.path.join(root, "qwen3.5-tiny-4bit")
score(quant_dir, quantize_and_reload(quant_dir, model, config, tokenizer, rows,
                                     group_size=32, bits=4))
