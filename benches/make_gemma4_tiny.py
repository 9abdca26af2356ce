"""Makes tests/fixtures/models/gemma4-tiny/ and gemma4-tiny-4bit/: a Gemma 4 model (`model_type:
gemma4`, the text decoder `gemma4_text` inside it) on small random weights, built by mlx-lm
0.32.2 itself (`mlx_lm.models.gemma4.Model`), with mlx-lm's teacher-forced top-5 logprobs for a
few rows (`mlx-lm-scores.jsonl`, `mlxhost score`'s format), so the test suite checks our Gemma 4
graph against mlx-lm without mlx-lm installed.

The config is gemma-4-E2B's `config.json` (a `gemma4` config whose `text_config` holds the
decoder) with every size shrunk (hidden 32, 6 layers, 4 query heads, head_dim 16 on sliding
layers and global_head_dim 32 on full ones, MLP width 64, per-layer inputs of width 16,
vocabulary 256) and every structural feature kept:
- both layer types from an explicit `layer_types` list (sliding, sliding, full, twice), with a
  16-token window that the 58-token row crosses, and a 306-token row that crosses the window
  plus mlxhost's 256-position rollback margin;
- per-layer inputs (`hidden_size_per_layer_input`: `embed_tokens_per_layer`,
  `per_layer_model_projection`, each layer's gate and projection);
- KV sharing (`num_kv_shared_layers: 3`: layers 3 and 4 reuse layer 1's keys and values, layer
  5 layer 2's) and the double-wide MLP of the shared layers (`use_double_wide_mlp`);
- proportional partial RoPE on full layers (`partial_rotary_factor: 0.25`, theta 1e6), default
  RoPE on sliding ones (theta 1e4); q/k norms, the weightless v norm, layer scalars, tied head,
  final logit softcapping.
Beyond E2B, the full layers take the 26B/31B models' `attention_k_eq_v` (no `v_proj`: values
are the key projection) with `num_global_key_value_heads: 2` (sliding layers keep 1 KV head), so
that path is checked too. The softcap is 10 instead of 30: these random logits stay within a
few nats, where a cap of 30 would barely bend them and a missing softcap would go unnoticed.
The mixture-of-experts block (26B-A4B's `enable_moe_block`) is not built: mlxhost refuses it.

- `gemma4-tiny`: float32 weights (~0.5 MB); scores from mlx-lm in float32.
- `gemma4-tiny-4bit`: the same model quantized by mlx-lm's own `quantize_model` (4 bits, group
  32, affine; layers whose input width is not a multiple of 32, the per-layer projections, stay
  float32, as mlx-lm leaves them), float32 scales; scores from that quantized model. It is
  reloaded with `mlx_lm.utils.load_model` before scoring, so the directory is what mlx-lm loads.

Weights are normal with std 0.3 (mlx-lm's default init gives nearly uniform logits, where every
top-5 is a near-tie), norm weights and layer scalars around 1 (Gemma 4's norms multiply by `w`,
not Gemma 3's `1 + w`). The tokenizer is byte-level with no merges (token i is byte i), so the
server can run the model on any text; only ids are scored. Tensors are saved as mlx-lm saves a
`gemma4` model: `language_model.model.*`. The shared pieces are in benches/tiny_fixture.py.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_gemma4_tiny.py tests/fixtures/models
"""
import os
import sys

from mlx_lm.models import gemma4

from tiny_fixture import (byte_level_tokenizer, decode_gap, quantize_and_reload, random_model,
                          write_float32, write_scores)

root = sys.argv[1]
text_config = {
    "model_type": "gemma4_text",
    "hidden_size": 32, "num_hidden_layers": 6, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "global_head_dim": 32, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "vocab_size": 256, "rms_norm_eps": 1e-6, "final_logit_softcapping": 10.0,
    "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "enable_moe_block": False,
    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}
config = {
    "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
    "text_config": text_config, "vocab_size": 256, "eos_token_id": [1, 106],
    "tie_word_embeddings": True, "torch_dtype": "float32",
}
model, params = random_model(gemma4, config, seed=7, norm_std=None,
                             norm_suffixes=("norm.weight", "layer_scalar"))
tokenizer = byte_level_tokenizer()

rows = [
    {"prompt_ids": [2, 5, 17, 200], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [2], "continuation_ids": [2, 3]},
    {"prompt_ids": [(i * 37 + 11) % 256 for i in range(300)],
     "continuation_ids": [10, 20, 30, 40, 50, 60]},
]


def score(out, m):
    margin = write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), m, rows)
    print(f"{out}: smallest top-2 margin {margin:.4f} nats")


dense_dir = os.path.join(root, "gemma4-tiny")
write_float32(dense_dir, config, params, tokenizer, rows)
score(dense_dir, model)
# mlx-lm's cached path (the long row through its RotatingKVCache and the shared layers' reused
# KV) against its one pass.
print(f"mlx-lm cached decode vs one pass (long row): {decode_gap(model, rows[-1]):.2e} nats")

quant_dir = os.path.join(root, "gemma4-tiny-4bit")
score(quant_dir, quantize_and_reload(quant_dir, model, config, tokenizer, rows,
                                     group_size=32, bits=4))
