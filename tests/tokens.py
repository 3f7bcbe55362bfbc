"""Token ids for test prompts: pure functions, no engine, no store, no threads.

`block_tokens` builds the consecutive prompts of the connector rig's tests (tests/connector),
`prompt` the seeded prompts of tests/vllm (its stand-in model only needs distinct, valid ids).
The reference engine's random prompts live in tests/e2e/harness.py and the real tiny model's in
tests/vllm_engine/tiny_model.py (ids spread over that model's vocabulary).
"""

from __future__ import annotations


def block_tokens(num_blocks: int, block_size: int, *, extra: int = 1, base: int = 0) -> list[int]:
    """The ids base, base + 1, ...: `num_blocks` full blocks, then `extra` tokens past them.

    The default extra=1 lets every full block hit: the connector never loads a prompt's last
    token (the engine must compute it), so a block-aligned prompt (extra=0) hits one block fewer.
    Prompts with bases far enough apart share no block."""
    return list(range(base, base + num_blocks * block_size + extra))


def prompt(seed: int, num_tokens: int) -> list[int]:
    """`num_tokens` ids in [3, 503) (0-2 are special ids); prompts of different seeds (< 500
    apart) differ in their first token, so they share no block."""
    return [(seed * 41 + k) % 500 + 3 for k in range(num_tokens)]
