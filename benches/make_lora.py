"""Random low-rank LoRA adapters for SmolLM2-135M-Instruct and mlx-lm's scores with them, for
tests/tests/lora.rs (no package ships an adapter for the models we can install).

Each adapter is written twice from the same tensors (float16):

- `<name>-mlx/`: mlx-lm's adapter folder, `adapters.safetensors` (`model.layers.N.<module>.lora_a`
  `[in, r]` and `.lora_b` `[r, out]`) and `adapter_config.json` (`fine_tune_type`, `num_layers`,
  `lora_parameters`: `rank`, `scale`, `dropout`, `keys`), as `mlx_lm.lora` saves them;
- `<name>-peft/`: PEFT's, `adapter_model.safetensors` (`base_model.model.model.layers.N.<module>.
  lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`, the transposes) and
  `adapter_config.json` (`peft_type`, `r`, `lora_alpha` = scale * r, `target_modules`,
  `layers_to_transform`), so `lora_alpha / r` is mlx-lm's `scale`.

`alpha`: rank 8, scale 2, q_proj and v_proj of the last 8 layers. `beta`: rank 4, scale 1.5,
every projection (q, k, v, o, gate, up, down) of the last 4 layers. A is normal / sqrt(in), B
normal * 0.2 (a trained B starts at zero; this B moves the outputs by tenths of a nat to nats, so a
test tells an adapter from the base and from another adapter).

`rows.jsonl`: three prompts of tests/fixtures/smollm2-greedy.json, each with the first 12
tokens of mlx-lm's greedy continuation under `alpha`. `mlx-lm-scores.<name>.jsonl`: mlx-lm's
teacher-forced logprobs and top-5 of those rows with `load(BASE, adapter_path=<name>-mlx)`;
`mlx-lm-scores.base.jsonl` without an adapter (mlx-lm 0.32.2, MLX 0.32.2, CPU). The model's float
parameters are cast to float32 after loading (`set_dtype`), so the scores are mlx-lm's float32
path over the same 4-bit weights, mlxhost's default CPU path (its float16 path is ~50x slower
on x86: MLX's CPU quantized kernel).

BASE is the default model converted to MLX's layout (mlx-lm cannot read its GGUF):
  target/release/mlxhost convert ~/.cache/mlxhost/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-mlx
  /tmp/mlxvenv/bin/python benches/make_lora.py /tmp/smollm2-mlx tests/fixtures/lora

`mlx-lm-scores.<name>-fused.jsonl`: the same rows scored by mlx-lm's fused model (`mlx_lm.fuse`'s
step: each `LoRALinear.fuse()`, the 4-bit weights dequantized, the delta added and quantized again
with their own bits and group size), after the float32 cast, as `--lora-merge` merges.
`--fused BASE OUT` writes just these (the adapters already in OUT).

`--bench DIR --rank R [--count N]` writes N adapters (`bench0`..) of rank R over every projection
of every layer, mlx-lm format only, no scores: benches/lora.sh's adapters (too large to commit).
"""
import argparse
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, os.path.dirname(__file__))
from tiny_fixture import write_scores  # noqa: E402

HIDDEN, KV_WIDTH, INTERMEDIATE, LAYERS = 576, 192, 1536, 30
MODULES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV_WIDTH),
    "self_attn.v_proj": (HIDDEN, KV_WIDTH),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}
ADAPTERS = {
    "alpha": dict(rank=8, scale=2.0, keys=["self_attn.q_proj", "self_attn.v_proj"], layers=8,
                  seed=42),
    "beta": dict(rank=4, scale=1.5, keys=list(MODULES), layers=4, seed=43),
}
B_STD = 0.2


def tensors(spec):
    """{(layer, key): (A [in, r], B [r, out])} in float16."""
    mx.random.seed(spec["seed"])
    out = {}
    for layer in range(LAYERS - spec["layers"], LAYERS):
        for key in spec["keys"]:
            d_in, d_out = MODULES[key]
            a = mx.random.normal((d_in, spec["rank"])) / d_in ** 0.5
            b = mx.random.normal((spec["rank"], d_out)) * B_STD
            out[(layer, key)] = (a.astype(mx.float16), b.astype(mx.float16))
    return out


def write_mlx(path, spec, ts):
    os.makedirs(path, exist_ok=True)
    weights = {}
    for (layer, key), (a, b) in ts.items():
        weights[f"model.layers.{layer}.{key}.lora_a"] = a
        weights[f"model.layers.{layer}.{key}.lora_b"] = b
    mx.save_safetensors(os.path.join(path, "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": spec["layers"],
              "lora_parameters": {"rank": spec["rank"], "scale": spec["scale"], "dropout": 0.0,
                                  "keys": spec["keys"]}}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_peft(path, spec, ts):
    os.makedirs(path, exist_ok=True)
    weights = {}
    for (layer, key), (a, b) in ts.items():
        prefix = f"base_model.model.model.layers.{layer}.{key}"
        weights[f"{prefix}.lora_A.weight"] = a.T
        weights[f"{prefix}.lora_B.weight"] = b.T
    mx.save_safetensors(os.path.join(path, "adapter_model.safetensors"), weights,
                        metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
              "r": spec["rank"], "lora_alpha": spec["scale"] * spec["rank"], "lora_dropout": 0.0,
              "target_modules": sorted(k.split(".")[-1] for k in spec["keys"]),
              "layers_to_transform": list(range(LAYERS - spec["layers"], LAYERS)),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "modules_to_save": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def load32(base, adapter):
    """mlx-lm's `load(base, adapter_path=adapter)` with its float parameters (scales, biases,
    norms, the adapter's A and B) cast to float32: MLX's CPU quantized kernel is ~50x slower with
    float16 activations, and the float16 scores took over an hour on a 2-core machine."""
    model, _ = load(base, adapter_path=adapter)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def fuse(model):
    """`mlx_lm.fuse`'s step: every `LoRALinear` replaced by its `fuse()` (re-quantized)."""
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    return model


def fused_scores(base, out):
    with open(os.path.join(out, "rows.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for name in ADAPTERS:
        model = fuse(load32(base, os.path.join(out, f"{name}-mlx")))
        m = write_scores(os.path.join(out, f"mlx-lm-scores.{name}-fused.jsonl"), model, rows)
        print(f"{name} fused: smallest top-2 margin {m:.3f} nats")


def fixtures(base, out):
    os.makedirs(out, exist_ok=True)
    for name, spec in ADAPTERS.items():
        ts = tensors(spec)
        write_mlx(os.path.join(out, f"{name}-mlx"), spec, ts)
        write_peft(os.path.join(out, f"{name}-peft"), spec, ts)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "tests", "fixtures", "smollm2-greedy.json")) as f:
        cases = json.load(f)
    alpha = load32(base, os.path.join(out, "alpha-mlx"))
    rows = [{"prompt_ids": c["prompt_ids"], "continuation_ids": greedy(alpha, c["prompt_ids"], 12)}
            for c in cases[:3]]
    with open(os.path.join(out, "rows.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    margins = {"alpha": write_scores(os.path.join(out, "mlx-lm-scores.alpha.jsonl"), alpha, rows)}
    beta = load32(base, os.path.join(out, "beta-mlx"))
    margins["beta"] = write_scores(os.path.join(out, "mlx-lm-scores.beta.jsonl"), beta, rows)
    plain = load32(base, None)
    margins["base"] = write_scores(os.path.join(out, "mlx-lm-scores.base.jsonl"), plain, rows)
    for name, m in margins.items():
        print(f"{name}: smallest top-2 margin {m:.3f} nats")
    fused_scores(base, out)


def bench(out, rank, count):
    for i in range(count):
        spec = dict(rank=rank, scale=1.0, keys=list(MODULES), layers=LAYERS, seed=100 + i)
        write_mlx(os.path.join(out, f"bench{i}"), spec, tensors(spec))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--bench")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--fused", action="store_true")
    a = p.parse_args()
    if a.bench:
        bench(a.bench, a.rank, a.count)
    elif a.fused:
        fused_scores(a.base, a.out)
    else:
        fixtures(a.base, a.out)


if __name__ == "__main__":
    main()
