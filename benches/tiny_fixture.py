"""Shared pieces of the tiny random-weight model fixtures under tests/fixtures/models/, written
by benches/make_qwen3_tiny.py, make_qwen3_moe_tiny.py, make_qwen3_moe_tiny_gguf.py,
make_gemma4_tiny.py and make_gpt_oss_tiny.py with mlx-lm 0.32.2:

- `random_model`: an mlx-lm model on normal weights of std 0.3 (mlx-lm's default init gives
  nearly uniform logits, where every top-5 is a near-tie), norm weights around 1;
- `char_tokenizer` / `byte_level_tokenizer`: a tokenizer.json with no merges (only ids are
  scored), one single character per id, or GPT-2's byte-level alphabet so any text encodes;
- `write_common`: config.json, tokenizer.json, tokenizer_config.json and rows.jsonl;
- `write_float32`: those plus the float32 `model.safetensors`;
- `write_scores`: mlx-lm's teacher-forced logprobs of each row's continuation with its top-5
  (`mlx-lm-scores.jsonl`, `mlxhost score`'s format);
- `quantize_and_reload`: a quantized directory written by mlx-lm's own `quantize_model` and
  `save_model`, reloaded by `load_model` before scoring, so it is what mlx-lm loads;
- `decode_gap`: how far mlx-lm's cached decode is from its one-pass scores;
- `patch_gather_qmm`: the `global_scale` shim quantized MoE models need with MLX 0.32.2.

Every fixture these scripts write is byte-for-byte what they wrote before this module existed:
keep it so (regenerate into a temporary directory and `cmp` against tests/fixtures/models).
"""
import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import load_model, quantize_model, save_model

STD = 0.3


def patch_gather_qmm():
    """mlx-lm 0.32.2's QuantizedSwitchLinear passes `global_scale=None` to `mx.gather_qmm`, a
    keyword MLX 0.32.2 (the version mlxhost links) does not have yet: its quantized MoE raises
    a TypeError there. `None` means "no global scale", which is what 0.32.2's op computes, so
    drop the keyword."""
    gather_qmm = mx.gather_qmm

    def gather_qmm_compat(*args, global_scale=None, **kwargs):
        if global_scale is not None:
            raise ValueError("global_scale needs a newer MLX")
        return gather_qmm(*args, **kwargs)

    mx.gather_qmm = gather_qmm_compat


def random_model(arch, config, seed, norm_std=STD, norm_suffixes=("norm.weight",), scale=None):
    """Seeds MLX's generator with `seed`, builds `arch.Model` from `config` and loads normal
    weights of std 0.3. Parameters whose name ends in one of `norm_suffixes` become
    `1 + normal * norm_std` (`norm_std=None`: `1 + normal`), around 1 as trained models have
    them; for the others `scale(name)` may return a factor to widen them by (None: keep).
    Returns the model (evaluated) and its flat {name: array} parameters."""
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = tree_map(lambda p: mx.random.normal(p.shape) * STD, model.parameters())
    params = dict(tree_flatten(params))
    for k in params:
        if k.endswith(norm_suffixes):
            params[k] = 1.0 + (params[k] if norm_std is None else params[k] * norm_std)
        elif scale is not None and (factor := scale(k)) is not None:
            params[k] = params[k] * factor
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model, params


def _tokenizer(vocab, level=None):
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": level, "post_processor": None,
            "decoder": level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []}}


def char_tokenizer(n):
    """A minimal tokenizer.json: `n` single-character tokens (U+0100 onwards), no merges, no
    pre-tokenizer or decoder."""
    chars = [chr(0x100 + i) for i in range(n)]
    return _tokenizer({c: i for i, c in enumerate(chars)})


def bytes_to_unicode():
    """GPT-2's map from bytes to printable characters (`ByteLevel`'s alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_level_tokenizer():
    """A byte-level tokenizer.json: token i is byte i (GPT-2's byte-to-character map), no
    merges, so any text encodes (the server's warm-up encodes English) and ids decode back."""
    byte_chars = bytes_to_unicode()
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}
    return _tokenizer({byte_chars[b]: b for b in range(256)}, level)


def write_common(out, config, tokenizer, rows, eos_id=1):
    """Creates `out` with config.json (`config` as given), tokenizer.json, a
    tokenizer_config.json naming token `eos_id` as EOS, and rows.jsonl (one row a line)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    eos = next(t for t, i in tokenizer["model"]["vocab"].items() if i == eos_id)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, f)
    with open(os.path.join(out, "rows.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_float32(out, config, params, tokenizer, rows):
    """`write_common` plus the float32 weights as `model.safetensors` (`format: mlx`)."""
    write_common(out, config, tokenizer, rows)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), params,
                        metadata={"format": "mlx"})


def row_logprobs(model, row):
    """Float32 log-softmax of the model's logits over the row's prompt and continuation."""
    ids = mx.array([row["prompt_ids"] + row["continuation_ids"]])
    logits = model(ids)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def write_scores(path, model, rows):
    """Writes mlx-lm's teacher-forced logprobs of each row's continuation, with its top-5, to
    `path` (one `{"steps": [...]}` a row). Returns the smallest top-2 margin in nats."""
    smallest_margin = float("inf")
    with open(path, "w") as f:
        for r in rows:
            lp = row_logprobs(model, r)
            steps = []
            for i, t in enumerate(r["continuation_ids"]):
                row = lp[len(r["prompt_ids"]) - 1 + i]
                top = mx.argsort(-row)[:5].tolist()
                smallest_margin = min(smallest_margin, row[top[0]].item() - row[top[1]].item())
                steps.append({"token": t, "logprob": row[t].item(),
                              "top": [[k, row[k].item()] for k in top]})
            f.write(json.dumps({"steps": steps}) + "\n")
    return smallest_margin


def quantize_and_reload(out, model, config, tokenizer, rows, **quantize):
    """Quantizes `model` with mlx-lm's `quantize_model(model, config, **quantize)`, writes it to
    `out` (`write_common` with the quantized config, then `save_model`, without the index
    file) and returns it as `load_model` reads it back."""
    model, qconfig = quantize_model(model, config, **quantize)
    write_common(out, qconfig, tokenizer, rows)
    save_model(out, model)
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    return load_model(Path(out))[0]


def decode_gap(model, row):
    """How far mlx-lm's own cached path (the row's prompt prefilled, then one token per step
    through the model's `make_cache()`) is from its one-pass scores, in nats: the two must
    agree for the one-pass scores to be the reference for ours."""
    ids = row["prompt_ids"] + row["continuation_ids"]
    whole = row_logprobs(model, row)
    cache = model.make_cache()
    n = len(row["prompt_ids"])
    out = [model(mx.array([ids[:n]]), cache=cache)[0, -1]]
    for t in ids[n:-1]:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    stepped = mx.stack(out).astype(mx.float32)
    stepped = stepped - mx.logsumexp(stepped, axis=-1, keepdims=True)
    return mx.max(mx.abs(stepped - whole[n - 1:-1])).item()
