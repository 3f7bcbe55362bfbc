"""The model and prompts the real-vLLM benchmarks serve: a random-weight Llama saved with
transformers' save_pretrained (no download), and deterministic token ids. Runs in whatever
process calls it (imports torch / transformers only inside `save_random_llama`).

    python -m layerkv.bench.vllm.model PATH [--layers 8] [--hidden 1024] [--dtype float32]
        [--lm-head-scale 10] [--tokenizer]

`--tokenizer` adds a word-level tokenizer (for `vllm serve` and vLLM's benchmark client) whose
words are 3 letters: 4 characters a token with the space, under vLLM 0.32's 5-characters-a-token
limit on prompts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

VOCAB_SIZE = 4096


def native_dtype() -> str:
    """bfloat16 if this CPU multiplies bf16 natively (AVX512-BF16 / AMX), else float32: without
    them torch runs bf16 matmuls at ~1 GFLOPS (fp32: ~130 here), so bf16 would measure that
    fallback, not the KV transfer."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def save_random_llama(
    path: Path, num_layers: int, hidden_size: int, dtype: str, max_positions: int = 16384, lm_head_scale: float = 1.0
) -> Path:
    """A random-weight Llama (head_dim 128, as many KV heads as heads) saved into `path`.
    `lm_head_scale` > 1 sharpens its next-token distribution (a random model's is nearly flat):
    greedy tokens then survive the rounding differences of another batch or chunking."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 128,
        num_key_value_heads=hidden_size // 128,
        max_position_embeddings=max_positions,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def word(token_id: int) -> str:
    """Token id t >= 3 <-> a 3-letter word (base 26); ids 0-2 are <unk>, <s>, </s>."""
    return "".join(chr(ord("a") + (token_id // 26**k) % 26) for k in (2, 1, 0))


def save_word_tokenizer(path: Path, word_of: Callable[[int], str] = word, max_length: int = 16384) -> None:
    """A WordLevel tokenizer over VOCAB_SIZE words, id t >= 3 <-> `word_of(t)` (whitespace-split;
    text <-> ids round-trips), saved as tokenizer.json + tokenizer_config.json for `vllm serve`
    and transformers."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {**special, **{word_of(t): t for t in range(len(special), VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": max_length,
                "add_bos_token": False,
            }
        )
    )


def save_in(
    python: str, env: dict[str, str], path: Path, num_layers: int, hidden_size: int, dtype: str, *extra: str
) -> Path:
    """`save_random_llama` (+ `extra` flags of main()) run by another Python (an engine's venv, which
    has transformers); RuntimeError with its stderr if it fails. Returns `path`."""
    import subprocess

    made = subprocess.run(
        [
            python,
            "-m",
            "layerkv.bench.vllm.model",
            str(path),
            "--layers",
            str(num_layers),
            "--hidden",
            str(hidden_size),
            "--dtype",
            dtype,
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if made.returncode != 0:
        raise RuntimeError(f"making the model failed (exit {made.returncode}):\n{made.stderr[-3000:]}")
    return path


def kv_bytes_per_token(num_layers: int, hidden_size: int, dtype: str) -> int:
    """K and V of every layer for one token (head_dim x KV heads = hidden_size here)."""
    return num_layers * 2 * hidden_size * (2 if dtype in ("bfloat16", "float16") else 4)


def tokens(seed: int, num_tokens: int) -> list[int]:
    """Deterministic token ids in [3, VOCAB_SIZE): different seeds give different prompts."""
    return [(seed * 7919 + k * 131) % (VOCAB_SIZE - 3) + 3 for k in range(num_tokens)]


def main() -> int:
    parser = argparse.ArgumentParser(description="save a random-weight Llama for the real-vLLM benchmarks")
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default=native_dtype())
    parser.add_argument("--max-positions", type=int, default=16384)
    parser.add_argument("--lm-head-scale", type=float, default=1.0)
    parser.add_argument("--tokenizer", action="store_true", help="add a 3-letter word tokenizer")
    args = parser.parse_args()
    save_random_llama(args.path, args.layers, args.hidden, args.dtype, args.max_positions, args.lm_head_scale)
    if args.tokenizer:
        save_word_tokenizer(args.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
