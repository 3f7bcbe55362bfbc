"""Llama-family checkpoints for the reference engine: read a local HF directory (config.json +
model.safetensors or a sharded index) into (ModelConfig, weights), and write one back. Worker
side, at engine construction only; no threads.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from layerkv.engine.model import ModelConfig, Weights, weight_shapes
from layerkv.errors import ConfigError, UnsupportedSetupError

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def model_config_from_hf(hf: dict, seed: int = 0) -> ModelConfig:
    """ModelConfig from an HF Llama config.json dict."""
    if hf.get("rope_scaling"):
        raise UnsupportedSetupError(
            f"config.json rope_scaling={hf['rope_scaling']!r}: the reference engine has plain RoPE only"
        )
    try:
        num_heads = hf["num_attention_heads"]
        return ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            seed=seed,
            dtype=_DTYPE_NAMES.get(str(hf.get("torch_dtype", "float32")), "float32"),
        )
    except KeyError as exc:
        raise ConfigError(f"config.json lacks {exc.args[0]!r}, needed for a Llama model") from exc


def load_hf_checkpoint(path: str | Path, dtype: str | None = None) -> tuple[ModelConfig, Weights]:
    """Read `path`/config.json and its safetensors weights; `dtype` overrides config.json's."""
    root = Path(path)
    hf = json.loads((root / "config.json").read_text())
    if dtype is not None:
        hf = {**hf, "torch_dtype": dtype}
    cfg = model_config_from_hf(hf)
    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    raw: Weights = {}
    for name in files:
        raw.update(load_file(str(root / name)))
    if "lm_head.weight" not in raw and hf.get("tie_word_embeddings", False):
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
    expected = weight_shapes(cfg)
    weights: Weights = {}
    for key, shape in expected.items():
        if key not in raw:
            raise ConfigError(f"checkpoint {root} lacks tensor {key!r} (shape {tuple(shape)})")
        if tuple(raw[key].shape) != tuple(shape):
            raise ConfigError(
                f"checkpoint tensor {key!r} has shape {tuple(raw[key].shape)}; config.json implies {tuple(shape)}"
            )
        weights[key] = raw[key].to(cfg.torch_dtype)
    return cfg, weights


def save_hf_checkpoint(cfg: ModelConfig, weights: Weights, path: str | Path) -> None:
    """Write `weights` (HF names) and a Llama config.json to directory `path`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps,
        "torch_dtype": cfg.dtype,
        "tie_word_embeddings": False,
    }
    (root / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))
