"""Makes an MLX model directory at a published model's shape with random 4-bit weights, for
measuring speed and memory at real sizes (issue 35) where the real weights cannot be fetched.
Built by mlx-lm 0.32.2's own model class, so both servers load the same files.

Weights are `normal * 0.02` in bfloat16, quantized by `nn.quantize` (group 64, 4 bits, mlx-lm's
default), saved with `mx.save_safetensors`; the tokenizer files are copied from a converted model
with the same vocabulary (`mlxhost convert` of the Qwen2.5-Coder-0.5B GGUF for the Qwen shapes).
Generation is lazy per layer and takes under a minute on a GPU even at 32B.

Run (python3 with mlx and mlx-lm 0.32.2; on the GPU machine, see benches/device/real_shapes.sh):
  python3 benches/make_real_shape.py qwen3-8b OUT_DIR TOKENIZER_DIR
  python3 benches/make_real_shape.py --list
"""
import argparse
import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

# Published configs (the model cards' config.json, fields mlx-lm reads).
SHAPES = {
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
        "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "qwen2.5-32b": {
        "model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64,
        "intermediate_size": 27648, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    # Mixture of experts (issue 37): Qwen3-30B-A3B (Qwen3-Coder-30B-A3B has the same shape).
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    # Hybrid linear attention (issue 38): Qwen3.5-9B's text decoder, flat (mlx-lm reads a
    # `qwen3_5` config without `text_config` as the text config itself): 24 gated-DeltaNet layers
    # (16 key heads and 32 value heads of 128, a 4-tap conv) and 8 gated full-attention layers
    # (16 heads of 256 over 4 KV heads, RoPE on a quarter of each head).
    "qwen3.5-9b": {
        "model_type": "qwen3_5", "hidden_size": 4096, "num_hidden_layers": 32,
        "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
    },
    # gpt-oss-20b: experts in MXFP4 (how it ships), the rest 8-bit affine, as mlx-community's
    # MXFP4-Q8 conversion. Its own vocabulary (201088) is kept, so the head streams the real bytes;
    # the copied tokenizer covers the first 151k ids, enough for `bench` and `mlx_lm.benchmark`.
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
        "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
        "experts_per_token": 4, "vocab_size": 201088, "rms_norm_eps": 1e-5,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_theta": 150000, "swiglu_limit": 7.0, "attention_bias": True,
        "max_position_embeddings": 131072, "initial_context_length": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "tie_word_embeddings": False,
    },
    # For checking this script on a CPU in seconds.
    "tiny": {
        "model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    },
    "tiny-moe": {
        "model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "tiny-gpt-oss": {
        "model_type": "gpt_oss", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "experts_per_token": 2, "vocab_size": 201088, "rms_norm_eps": 1e-5,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000, "swiglu_limit": 7.0, "attention_bias": True,
        "max_position_embeddings": 131072, "initial_context_length": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "tie_word_embeddings": False,
    },
}


def quantization(config):
    """How a shape is quantized: (group_size, bits, mode, per-module predicate or None).
    gpt-oss: MXFP4 experts (group 32, no biases), everything else 8-bit affine (group 64)."""
    if config["model_type"] == "gpt_oss":
        def predicate(path, module):
            if ".mlp.experts." in path + ".":
                return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        return 64, 8, "affine", predicate
    return 64, 4, "affine", None


def pad_vocabulary(path, vocab_size):
    """Random weights pick any id of the model's vocabulary, and gpt-oss's (201088) is larger than
    the copied Qwen tokenizer's: ids it lacks get placeholder BPE entries `<|pad_ID|>` (no merge
    ever makes them), so both servers can detokenize every id the model emits."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        tok = json.load(f)
    if tok.get("model", {}).get("type") != "BPE":
        return
    taken = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok.get("added_tokens", [])}
    missing = [i for i in range(vocab_size) if i not in taken]
    if not missing:
        return
    for i in missing:
        tok["model"]["vocab"][f"<|pad_{i}|>"] = i
    with open(path, "w") as f:
        json.dump(tok, f, ensure_ascii=False)


def build(name, out, tokenizer_dir, seed=0):
    import importlib

    config = dict(SHAPES[name])
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    # Random bfloat16 weights, lazily: nothing is materialised before the save.
    model.update(
        tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16), model.parameters())
    )
    group_size, bits, mode, predicate = quantization(config)
    if predicate is None:
        nn.quantize(model, group_size=group_size, bits=bits, mode=mode)
        config["quantization"] = {"group_size": group_size, "bits": bits}
    else:
        # mlx-lm's own quantize_model writes the per-module entries its loader (and ours) read.
        from mlx_lm.utils import quantize_model
        model, config = quantize_model(model, config, group_size, bits, mode=mode,
                                       quant_predicate=predicate)
    os.makedirs(out, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(os.path.join(out, "model.safetensors"), weights, metadata={"format": "mlx"})
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for f in os.listdir(tokenizer_dir):
        if f.endswith(".safetensors") or f == "config.json" or f.endswith(".index.json"):
            continue
        src = os.path.join(tokenizer_dir, f)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out, f))
    pad_vocabulary(os.path.join(out, "tokenizer.json"), config["vocab_size"])
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(json.dumps({"shape": name, "dir": out, "weights_bytes": size,
                      "parameters": sum(v.size for v in weights.values())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("out", nargs="?")
    ap.add_argument("tokenizer_dir", nargs="?", help="a converted model's directory (tokenizer files)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args()
    if a.list or not a.shape:
        print(json.dumps(SHAPES, indent=1))
        return
    if not (a.out and a.tokenizer_dir):
        ap.error("OUT and TOKENIZER_DIR are required")
    build(a.shape, a.out, a.tokenizer_dir, a.seed)


if __name__ == "__main__":
    main()
