"""Makes tests/fixtures/models/qwen3-moe-tiny.gguf (+ .q8_0.gguf, .q4_0.gguf): the random-weight
Qwen3-MoE of tests/fixtures/models/qwen3-moe-tiny (benches/make_qwen3_moe_tiny.py) written as
llama.cpp writes a `qwen3moe` GGUF, by the `gguf` Python package (gguf-py 0.19.0, llama.cpp's own
writer), so mlxhost's GGUF MoE loader is checked against the MLX directory's mlx-lm scores.

Layout (gguf-py `constants.py`, MODEL_ARCH.QWEN3MOE; llama.cpp's `convert_hf_to_gguf.py`,
Qwen3MoeModel):
- `general.architecture = qwen3moe`; `qwen3moe.{block_count, context_length, embedding_length,
  feed_forward_length, attention.head_count, attention.head_count_kv, attention.key_length,
  attention.value_length, attention.layer_norm_rms_epsilon, rope.freq_base, expert_count,
  expert_used_count, expert_feed_forward_length}`.
- Per sparse layer the router `blk.N.ffn_gate_inp.weight` (ggml ne [hidden, experts], kept F32
  in every variant, as llama.cpp's converter and llama-quantize keep it) and the stacked experts
  `blk.N.ffn_{gate,up,down}_exps.weight`, numpy shape [experts, out, in] (ggml ne [in, out,
  experts]); quantized types quantize each expert's rows along `in`, as llama.cpp does.
- Q/K rows are not permuted (llama.cpp permutes only llama-family q/k).
- Layer 1 is dense in the fixture (`mlp_only_layers: [1]`, which mlx-lm supports and llama.cpp's
  qwen3moe graph does not): it is written with llama.cpp's dense names `blk.1.ffn_{gate,up,down}`,
  and mlxhost takes a layer without `ffn_gate_inp` but with `ffn_gate` as dense.
- Tokenizer: the directory's 256 single-character byte-level tokens, no merges, as
  `tokenizer.ggml.model = gpt2` without `tokenizer.ggml.merges` (gguf-py refuses an empty
  array); EOS id 1 (the directory's `eos_token`).

Variants: `qwen3-moe-tiny.gguf` (F32 everywhere: the directory's weights exactly; its reference
is the directory's `mlx-lm-scores.jsonl`), `qwen3-moe-tiny.q8_0.gguf` and `.q4_0.gguf` (every
matrix but the router in Q8_0 / Q4_0). For the quantized ones mlx-lm 0.32.2's `qwen3_moe.Model`
scores the weights gguf-py dequantizes from those files, in float32:
`qwen3-moe-tiny.q8_0.mlx-lm-scores.jsonl`, `qwen3-moe-tiny.q4_0.mlx-lm-scores.jsonl`.

The scoring is benches/tiny_fixture.py's `write_scores`.

Run (the mlx-lm venv of benches/side_by_side.sh, plus `pip install gguf==0.19.0`):
  $VENV/bin/python benches/make_qwen3_moe_tiny_gguf.py tests/fixtures/models
"""
import json
import os
import sys

import gguf
import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3_moe

from tiny_fixture import write_scores

root = sys.argv[1]
src = os.path.join(root, "qwen3-moe-tiny")
with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
weights = {k: np.array(v) for k, v in mx.load(os.path.join(src, "model.safetensors")).items()}
rows = [json.loads(line) for line in open(os.path.join(src, "rows.jsonl"))]
with open(os.path.join(src, "tokenizer.json")) as f:
    vocab = json.load(f)["model"]["vocab"]
tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

ARCH = "qwen3moe"
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(mlx_name):
    base = mlx_name.removesuffix(".weight")
    if base == "model.embed_tokens":
        return "token_embd.weight"
    if base == "model.norm":
        return "output_norm.weight"
    if base == "lm_head":
        return "output.weight"
    _, _, layer, module = base.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.weight"


def write(path, qtype):
    """Writes the GGUF; returns the weights as a reader of that file sees them (float32)."""
    w = gguf.GGUFWriter(path, ARCH)
    c = config
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else
                    {gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                     gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # what Qwen3 GGUFs carry
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    # No `tokenizer.ggml.merges`: gguf-py cannot write an empty array, and a vocabulary of
    # single characters needs none (mlxhost reads its absence as no merges only then).
    w.add_eos_token_id(1)
    seen = {}
    for name in sorted(weights):
        a = weights[name].astype(np.float32)
        gname = gguf_name(name)
        if qtype is None or a.ndim == 1 or gname.endswith("ffn_gate_inp.weight"):
            w.add_tensor(gname, a)
            seen[name] = a
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gname, q, raw_dtype=qtype)
            seen[name] = gguf.quants.dequantize(q, qtype).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {os.path.getsize(path)} bytes")
    return seen


def score(path, params):
    """mlx-lm's teacher-forced logprobs (float32) of `params` loaded into `qwen3_moe.Model`."""
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in params.items()])
    mx.eval(model.parameters())
    write_scores(path, model, rows)


f32 = write(os.path.join(root, "qwen3-moe-tiny.gguf"), None)
assert all(np.array_equal(f32[k], weights[k]) for k in weights)
for suffix, qtype in [("q8_0", gguf.GGMLQuantizationType.Q8_0),
                      ("q4_0", gguf.GGMLQuantizationType.Q4_0)]:
    seen = write(os.path.join(root, f"qwen3-moe-tiny.{suffix}.gguf"), qtype)
    score(os.path.join(root, f"qwen3-moe-tiny.{suffix}.mlx-lm-scores.jsonl"), seen)
