"""A random-weight Llama checkpoint and a word-level tokenizer, made at test time (no download):
what the real-engine tests serve. Runs in the test process (transformers, tokenizers, torch).

Greedy tokens of a random model are fragile (its next-token distribution is nearly flat), so the
output head is scaled up: top-1 margins become large against the rounding noise of a different
schedule, while every logprob still depends on every KV byte (the oracle compares them bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 4096
WORD_PREFIX = "w"  # token id t <-> the word f"w{t}" (ids 0-2: <unk>, <s>, </s>)


@dataclass(frozen=True)
class TinyLlama:
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2  # TP=2: one KV head per rank
    dtype: str = "float32"
    lm_head_scale: float = 10.0
    seed: int = 0

    def save(self, path: Path) -> Path:
        """Write config.json + model.safetensors + tokenizer files into `path`; returns it."""
        import torch
        import transformers

        torch.manual_seed(self.seed)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        return _save(transformers.LlamaForCausalLM(config), self.lm_head_scale, self.dtype, path)


@dataclass(frozen=True)
class TinyGemma3:
    """A random-weight Gemma-3 text model with sliding-window and full-attention layers (a hybrid
    model: vLLM's hybrid KV cache manager gives it one full-attention and two sliding-window KV
    cache groups of two layers each)."""

    sliding_window: int = 64  # tokens: two blocks of 32
    layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention", "full_attention") * 2
    hidden_size: int = 256
    dtype: str = "float32"
    lm_head_scale: float = 10.0
    seed: int = 0

    def save(self, path: Path) -> Path:
        import torch
        import transformers

        torch.manual_seed(self.seed)
        config = transformers.Gemma3TextConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size,
            num_hidden_layers=len(self.layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=self.sliding_window,
            layer_types=list(self.layer_types),
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        return _save(transformers.Gemma3ForCausalLM(config), self.lm_head_scale, self.dtype, path)


def _save(model: Any, lm_head_scale: float, dtype: str, path: Path) -> Path:
    """Scale the output head (peaked greedy tokens), write weights and the word tokenizer."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    save_word_tokenizer(path)
    return path


def save_word_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer whose words are w0..w4095 (whitespace-split), saved as
    tokenizer.json + tokenizer_config.json so `vllm serve` and transformers load it."""
    from layerkv.bench.vllm.model import save_word_tokenizer as save

    save(path, lambda t: f"{WORD_PREFIX}{t}", max_length=4096)


def words(token_ids: list[int]) -> str:
    """The text that tokenizes to exactly `token_ids` with the word tokenizer."""
    return " ".join(f"{WORD_PREFIX}{t}" for t in token_ids)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Deterministic token ids (never the special ids 0-2)."""
    return [(seed * 7919 + k * 131) % (VOCAB_SIZE - 3) + 3 for k in range(num_tokens)]
