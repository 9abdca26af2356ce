"""Makes tests/fixtures/models/gpt-oss-tiny/ and gpt-oss-tiny-mxfp4/: a gpt-oss model
(`model_type: gpt_oss`, the architecture of gpt-oss-20b and gpt-oss-120b) on small random
weights, built by mlx-lm 0.32.2 itself (`mlx_lm.models.gpt_oss.Model`), with mlx-lm's
teacher-forced top-5 logprobs for a few rows (`mlx-lm-scores.jsonl`, `mlxhost score`'s format),
so the test suite checks our `gpt_oss` graph against mlx-lm without mlx-lm installed.

The config is gpt-oss-20b's `config.json` with every size shrunk (hidden 32, 4 layers, 4 query
heads and 2 KV heads of width 16, 8 experts of width 32 with 4 per token, vocabulary 256) and
every structural feature kept:
- alternating sliding-window and full layers from an explicit `layer_types` list (sliding,
  full, twice), with a 16-token window (the real one is 128) that the 58-token row crosses,
  and a 306-token row that crosses it plus mlxhost's 256-position rollback margin;
- attention sinks (one learned logit per query head in every softmax), here normal with std
  1.5 so they take a real share of the attention (the script prints how far the logprobs move
  without them);
- q/k/v/o biases; YaRN RoPE with the real `rope_scaling` (factor 32, beta_fast 32, beta_slow
  1, original context 4096) and theta 150000, which at head width 16 blends interpolated and
  extrapolated pairs (correction range 2..5 of 8) and scales q and k by YaRN's mscale;
- the router with its bias, top-4 of the raw logits, then softmax over those 4;
- the experts' SwiGLU variant (`swiglu_oai`: gate clipped above at 7, the linear part clipped
  to [-7, 7] and shifted by 1, `gate * sigmoid(1.702 gate)`), with per-expert biases; the gate
  and up weights are wide enough (std 0.6) that the clipping bites (the script prints the
  share of clipped values).

- `gpt-oss-tiny`: float32 weights (~0.57 MB); scores from mlx-lm in float32, and its greedy
  continuation of each row's prompt (12 tokens through its cached decode, with each step's
  top-2 margin: `mlx-lm-greedy.jsonl`).
- `gpt-oss-tiny-mxfp4`: the same model quantized by mlx-lm's own `quantize_model`: the experts
  in MLX's `mxfp4` mode (4-bit E2M1 values, one E8M0 scale per 32, no biases: how gpt-oss
  ships them), the attention projections in `mxfp4` too (what `mlx_lm.convert --q-mode mxfp4`
  writes), the embedding, output head and router 8-bit affine with group 32 (float32 scales;
  mlx-lm's `quant_predicate` asks group 64 for the router, which a 32-wide input cannot take),
  as per-module `quantization` entries; scores and greedy continuations from that quantized
  model, reloaded with `mlx_lm.utils.load_model` first, so the directory is what mlx-lm loads.

The tokenizer is byte-level with no merges (token i is byte i), so the server can run the model
on any text; only ids are scored. The shared pieces are in benches/tiny_fixture.py.

Run (the mlx-lm venv of benches/side_by_side.sh):
  $VENV/bin/python benches/make_gpt_oss_tiny.py tests/fixtures/models
"""
import json
import os
import sys

import mlx.core as mx
from mlx_lm.models import activations, gpt_oss

from tiny_fixture import (byte_level_tokenizer, decode_gap, patch_gather_qmm,
                          quantize_and_reload, random_model, row_logprobs, write_float32,
                          write_scores)

patch_gather_qmm()

# Shares of the experts' gate and linear inputs that swiglu_oai clips, while scoring.
clipped = []
_swiglu_oai = activations.swiglu_oai


def _swiglu_oai_recording(gate, x, alpha=1.702, limit=7.0):
    clipped.append(((mx.sum(gate > limit) + mx.sum(mx.abs(x) > limit)) / (2 * gate.size)).item())
    return _swiglu_oai(gate, x, alpha=alpha, limit=limit)


activations.swiglu_oai = _swiglu_oai_recording

# The smallest gap between a token's 4th- and 5th-largest router logit while scoring (how far
# its top-4 choice is from a tie).
router_gaps = []
_moe_call = gpt_oss.MLPBlock.__call__


def _moe_call_recording(self, x):
    top = mx.sort(self.router(x), axis=-1)
    router_gaps.append(mx.min(top[..., -4] - top[..., -5]).item())
    return _moe_call(self, x)


gpt_oss.MLPBlock.__call__ = _moe_call_recording

root = sys.argv[1]
config = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
    "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 8, "num_experts_per_tok": 4, "experts_per_token": 4,
    "vocab_size": 256, "rms_norm_eps": 1e-5, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "initial_context_length": 4096, "max_position_embeddings": 131072,
    "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "float32",
}


def widen(name):
    """Sinks to std 1.5 and the experts' gate and up weights to std 0.6."""
    if name.endswith("sinks"):
        return 5.0
    if "experts.gate_proj.weight" in name or "experts.up_proj.weight" in name:
        return 2.0
    return None


model, params = random_model(gpt_oss, config, seed=5, norm_std=None, scale=widen)
tokenizer = byte_level_tokenizer()

rows = [
    {"prompt_ids": [2, 5, 17, 200], "continuation_ids": [7, 7, 100, 255, 0]},
    {"prompt_ids": list(range(40, 90)), "continuation_ids": [3, 1, 4, 1, 5, 9, 2, 6]},
    {"prompt_ids": [2], "continuation_ids": [2, 3]},
    {"prompt_ids": [(i * 37 + 11) % 256 for i in range(300)],
     "continuation_ids": [10, 20, 30, 40, 50, 60]},
]


def score(out, m):
    clipped.clear()
    router_gaps.clear()
    margin = write_scores(os.path.join(out, "mlx-lm-scores.jsonl"), m, rows)
    print(f"{out}: smallest top-2 margin {margin:.4f} nats; "
          f"swiglu_oai clipped {100 * sum(clipped) / len(clipped):.1f}% of its inputs; "
          f"smallest 4th-5th router logit gap {min(router_gaps):.4f}")


def write_greedy(out, m, steps=12):
    """mlx-lm's greedy continuation of each row's prompt through its cached decode (its
    RotatingKVCache on the sliding layers), with each step's top-2 margin in nats, so a test
    can compare greedy text over HTTP up to the first near-tie."""
    with open(os.path.join(out, "mlx-lm-greedy.jsonl"), "w") as f:
        for r in rows:
            cache = m.make_cache()
            logits = m(mx.array([r["prompt_ids"]]), cache=cache)[0, -1]
            ids, margins = [], []
            for _ in range(steps):
                lp = logits.astype(mx.float32)
                top = mx.sort(lp)[-2:].tolist()
                ids.append(mx.argmax(lp).item())
                margins.append(top[1] - top[0])
                logits = m(mx.array([[ids[-1]]]), cache=cache)[0, -1]
            f.write(json.dumps({"prompt_ids": r["prompt_ids"], "greedy_ids": ids,
                                "margins": margins}) + "\n")


def print_decode_gap(m):
    """mlx-lm's cached path (the long row through its RotatingKVCache) against its one pass."""
    print(f"mlx-lm cached decode vs one pass (long row): {decode_gap(m, rows[-1]):.2e} nats")


def sink_effect(m):
    """How far the logprobs move with the sinks zeroed: the sinks must matter for the test to
    check them."""
    with_sinks = [row_logprobs(m, r) for r in rows]
    saved = [layer.self_attn.sinks for layer in m.layers]
    for layer in m.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    gap = max(mx.max(mx.abs(a - row_logprobs(m, r))).item() for a, r in zip(with_sinks, rows))
    for layer, s in zip(m.layers, saved):
        layer.self_attn.sinks = s
    print(f"without the sinks the logprobs move by up to {gap:.2f} nats")


dense_dir = os.path.join(root, "gpt-oss-tiny")
write_float32(dense_dir, config, params, tokenizer, rows)
score(dense_dir, model)
write_greedy(dense_dir, model)
print_decode_gap(model)
sink_effect(model)


def mxfp4_predicate(path, module):
    if path.endswith("mlp.experts.gate_proj") or path.endswith("mlp.experts.up_proj") \
            or path.endswith("mlp.experts.down_proj") or ".self_attn." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": 32, "bits": 8, "mode": "affine"}


quant_dir = os.path.join(root, "gpt-oss-tiny-mxfp4")
reloaded = quantize_and_reload(quant_dir, model, config, tokenizer, rows, group_size=32, bits=8,
                               quant_predicate=mxfp4_predicate)
score(quant_dir, reloaded)
write_greedy(quant_dir, reloaded)
print_decode_gap(reloaded)
