"""layerkv's reference engine (needs torch): a small Llama-style model with a paged KV cache,
block hashing, a vLLM-v1-like scheduler and TP ranks in one process, driving the connector
hooks in vLLM's order. The demo and the correctness oracle of layerkv.
"""

from __future__ import annotations

from layerkv.engine.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from layerkv.engine.engine import Engine, EngineConfig, make_deployment
from layerkv.engine.hashing import block_hashes, hash_block
from layerkv.engine.model import ModelConfig, attn_layer_name, indexer_cache_name, init_weights
from layerkv.engine.request import RequestOutput, StepRecord, StepRequestRecord

__all__ = [
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "StepRecord",
    "StepRequestRecord",
    "attn_layer_name",
    "block_hashes",
    "hash_block",
    "indexer_cache_name",
    "init_weights",
    "load_hf_checkpoint",
    "make_deployment",
    "save_hf_checkpoint",
]
