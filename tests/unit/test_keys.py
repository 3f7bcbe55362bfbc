from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from layerkv.errors import ConfigError, UnsupportedSetupError
from layerkv.messages import Deployment
from layerkv.objects.keys import (
    Namespace,
    block_hash_bytes,
    block_key,
    block_keys,
    model_basename,
    namespace_for,
    storage_role,
)
from layerkv.objects.layout import CacheLayout

NUM_BLOCKS = 4
BASE = Deployment(model_id="meta-llama/Llama-3.1-8B", kv_dtype="float16", block_size=16, num_kv_heads=8, tp_size=2)


def make_layout(num_layers: int = 2, head_dim: int = 4) -> CacheLayout:
    # [2, num_blocks, block_size, heads, head_dim] per layer
    caches = {
        f"model.layers.{i}.attn": np.zeros((2, NUM_BLOCKS, 16, 2, head_dim), np.float16) for i in range(num_layers)
    }
    return CacheLayout.from_caches(caches, NUM_BLOCKS, max_transfer_bytes=1 << 20)


def test_namespace_format_and_key_format() -> None:
    ns = namespace_for(BASE, "default", make_layout())
    assert ns.name.startswith("Llama-3.1-8B-") and len(ns.name.rsplit("-", 1)[1]) == 16
    assert len(ns.digest) == 16 and ns.digest.hex().startswith(ns.name.rsplit("-", 1)[1])
    assert block_key(ns, b"\xab\x01", 3) == f"{ns.name}@ab01@3"
    assert block_key(Namespace("ns", bytes(16)), b"\x00", 0) == "ns@00@0"


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "meta-llama/Llama-3.1-70B"},
        {"model_fingerprint": "abc123"},
        {"kv_dtype": "bfloat16"},
        {"block_size": 32},
        {"tp_size": 4, "num_kv_heads": 8},
        {"num_kv_heads": 4},
        {"num_kv_heads": 2},  # tp 2, 2 heads: same put_step 1 but a different head partition
        {"pp_size": 2},
        {"pp_size": 2, "pp_rank": 1},
        {"is_mla": True},
    ],
)
def test_every_deployment_input_changes_the_digest(change: dict) -> None:
    layout = make_layout()
    base = namespace_for(BASE, "default", layout)
    other = namespace_for(dataclasses.replace(BASE, **change), "default", layout)
    assert other.digest != base.digest and other.name != base.name


def test_tenant_and_layout_change_the_digest() -> None:
    layout = make_layout()
    base = namespace_for(BASE, "default", layout)
    assert namespace_for(BASE, "team-b", layout).digest != base.digest
    assert namespace_for(BASE, "default", make_layout(num_layers=3)).digest != base.digest
    assert namespace_for(BASE, "default", make_layout(head_dim=8)).digest != base.digest


def test_tp_rank_alone_does_not_change_the_namespace() -> None:
    layout = make_layout()
    rank1 = dataclasses.replace(BASE, tp_rank=1)
    assert namespace_for(rank1, "default", layout) == namespace_for(BASE, "default", layout)


_SCRIPT = """
import numpy as np
from layerkv.objects.keys import namespace_for
from layerkv.objects.layout import CacheLayout
from layerkv.messages import Deployment
caches = {f"model.layers.{i}.attn": np.zeros((2, 4, 16, 2, 4), np.float16) for i in range(2)}
layout = CacheLayout.from_caches(caches, 4, max_transfer_bytes=1 << 20)
d = Deployment(model_id="meta-llama/Llama-3.1-8B", kv_dtype="float16", block_size=16, num_kv_heads=8, tp_size=2)
print(namespace_for(d, "default", layout).name)
"""


def test_namespace_is_stable_across_processes() -> None:
    here = namespace_for(BASE, "default", make_layout()).name
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    names = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.path.abspath(src)}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        names.add(out.stdout.strip())
    assert names == {here}


# (tp_size, num_kv_heads) -> put_step; num_storage_ranks = tp_size // put_step
PUT_STEP_TABLE = {
    (1, 1): 1,
    (1, 2): 1,
    (1, 4): 1,
    (1, 8): 1,
    (2, 1): 2,
    (2, 2): 1,
    (2, 4): 1,
    (2, 8): 1,
    (4, 1): 4,
    (4, 2): 2,
    (4, 4): 1,
    (4, 8): 1,
    (8, 1): 8,
    (8, 2): 4,
    (8, 4): 2,
    (8, 8): 1,
}


@pytest.mark.parametrize(("tp_size", "num_kv_heads"), sorted(PUT_STEP_TABLE))
def test_put_step_table(tp_size: int, num_kv_heads: int) -> None:
    put_step = PUT_STEP_TABLE[(tp_size, num_kv_heads)]
    placements = [
        storage_role(dataclasses.replace(BASE, tp_size=tp_size, tp_rank=r, num_kv_heads=num_kv_heads))
        for r in range(tp_size)
    ]
    assert {p.put_step for p in placements} == {put_step}
    assert [p.storage_rank for p in placements] == [r // put_step for r in range(tp_size)]
    assert [p.writes for p in placements] == [r % put_step == 0 for r in range(tp_size)]
    assert {p.num_storage_ranks for p in placements} == {min(tp_size, num_kv_heads)}
    # every storage rank has exactly one writer
    assert sorted(p.storage_rank for p in placements if p.writes) == list(range(tp_size // put_step))


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_mla_has_one_storage_rank_written_by_rank_0(tp_size: int) -> None:
    placements = [
        storage_role(dataclasses.replace(BASE, tp_size=tp_size, tp_rank=r, num_kv_heads=1, is_mla=True))
        for r in range(tp_size)
    ]
    assert [p.storage_rank for p in placements] == [0] * tp_size
    assert [p.writes for p in placements] == [True] + [False] * (tp_size - 1)
    assert {p.num_storage_ranks for p in placements} == {1}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"tp_rank": 2}, ConfigError, r"tp_rank=2 must be 0 <= tp_rank < tp_size=2"),
        ({"tp_rank": -1}, ConfigError, r"tp_rank=-1 must be 0 <= tp_rank < tp_size=2"),
        ({"pp_rank": 1}, ConfigError, r"pp_rank=1 must be 0 <= pp_rank < pp_size=1"),
        ({"num_kv_heads": 0}, ConfigError, r"num_kv_heads=0 must be an int >= 1"),
        ({"num_kv_heads": 3, "tp_size": 2}, UnsupportedSetupError, r"num_kv_heads=3 is not divisible by tp_size=2"),
        ({"num_kv_heads": 3, "tp_size": 4}, UnsupportedSetupError, r"tp_size=4 is not a multiple of num_kv_heads=3"),
    ],
)
def test_bad_placements_raise_clear_errors(change: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        storage_role(dataclasses.replace(BASE, **change))


def test_bad_tenant_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"tenant='a@b' must be a non-empty string without '@'"):
        namespace_for(BASE, "a@b", make_layout())


@pytest.mark.parametrize(
    ("model_id", "basename"),
    [
        ("meta-llama/Llama-3.1-8B", "Llama-3.1-8B"),
        ("/models/qwen@v2/", "qwen_v2"),
        ("C:\\models\\phi 3", "phi_3"),
        ("@@@", "model"),
    ],
)
def test_model_basename_is_sanitised(model_id: str, basename: str) -> None:
    assert model_basename(model_id) == basename
    name = namespace_for(dataclasses.replace(BASE, model_id=model_id), "default", make_layout()).name
    assert "@" not in name and "/" not in name and name.startswith(basename + "-")


def test_block_hashes_are_bytes_end_to_end() -> None:
    assert block_hash_bytes(bytearray(b"\x01\x02")) == b"\x01\x02"
    assert block_key(Namespace("ns", bytes(16)), b"\xff", 1) == "ns@ff@1"
    for bad in (1, "ab", -1):
        with pytest.raises(ConfigError, match=f"block hash must be bytes .*got {type(bad).__name__}"):
            block_hash_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block hash must not be empty"):
        block_hash_bytes(b"")


def test_vectorised_key_builders_match_block_key() -> None:
    ns = Namespace("m-0123", b"\0" * 16)
    hashes = [bytes([i]) * 4 for i in range(5)]
    assert block_keys(ns, hashes, 2) == [block_key(ns, h, 2) for h in hashes]
    assert block_keys(ns, np.array([], dtype=object), 0) == []


def test_kv_signature_names_the_layout_without_tensors() -> None:
    with_sig = dataclasses.replace(BASE, kv_signature="L0:kv[2,16,2,8]f32")
    # the scheduler side (no tensors) and a worker (with its layout) agree when the engine gives a signature
    assert namespace_for(with_sig, "default") == namespace_for(with_sig, "default", make_layout())
    assert namespace_for(dataclasses.replace(with_sig, kv_signature="other"), "default") != namespace_for(
        with_sig, "default"
    )
    with pytest.raises(ConfigError, match="Deployment.kv_signature is empty and no cache layout was given"):
        namespace_for(dataclasses.replace(BASE, kv_signature=""), "default")


def test_keyed_names_cannot_be_computed_without_the_key() -> None:
    """With a names key the namespace digest and every block id are keyed hashes: the same key
    and deployment give the same names, another key (or none) names every block differently,
    and no key contains the engine's block hash."""
    layout, block_hash = make_layout(), bytes(range(32))
    plain = namespace_for(BASE, "default", layout)
    a = namespace_for(BASE, "default", layout, names_key=b"a" * 32)
    again = namespace_for(BASE, "default", layout, names_key=b"a" * 32)
    b = namespace_for(BASE, "default", layout, names_key=b"b" * 32)
    assert (
        a.keyed
        and not plain.keyed
        and a.name == again.name
        and block_key(a, block_hash, 0) == block_key(again, block_hash, 0)
    )
    assert len({plain.name, a.name, b.name}) == 3 and len({plain.digest, a.digest, b.digest}) == 3
    assert a.name.startswith("Llama-3.1-8B-") and len(a.block_id(block_hash)) == 16
    assert block_key(plain, block_hash, 0).split("@")[1] == block_hash.hex()
    for ns in (a, b):
        assert block_hash.hex() not in block_key(ns, block_hash, 0) and block_hash.hex()[:16] not in block_key(
            ns, block_hash, 0
        )
    assert a.block_id(block_hash) != b.block_id(block_hash) != plain.block_id(block_hash)
    assert "names_key" not in repr(a) and "a" * 8 not in repr(a)


def test_encrypted_objects_have_names_of_their_own() -> None:
    """Under the same key, an engine that encrypts names its objects apart from one that only
    MACs them (each reader accepts only its own kind: shared names would make each refuse, and
    remove, the other's); the names of unencrypted objects, keyed or not, do not change."""
    layout, block_hash, key = make_layout(), bytes(range(32)), b"a" * 32
    keyed = namespace_for(BASE, "default", layout, names_key=key)
    encrypted = namespace_for(BASE, "default", layout, names_key=key, encrypted=True)
    assert encrypted.name != keyed.name and encrypted.digest != keyed.digest
    assert block_key(encrypted, block_hash, 0) != block_key(keyed, block_hash, 0)
    assert namespace_for(BASE, "default", layout, names_key=key, encrypted=False) == keyed
    assert namespace_for(BASE, "default", layout) == namespace_for(BASE, "default", layout, encrypted=False)


# (tp_size, num_kv_heads, store_shards) -> each rank's shards
SHARD_TABLE = {
    (1, 2, 2): [(0, 1)],
    (2, 2, 2): [(0,), (1,)],
    (1, 8, 4): [(0, 1, 2, 3)],
    (2, 8, 4): [(0, 1), (2, 3)],
    (4, 8, 8): [(0, 1), (2, 3), (4, 5), (6, 7)],
    (4, 2, 2): [(0,), (0,), (1,), (1,)],  # replicated heads: put_step 2
}


@pytest.mark.parametrize(("tp_size", "num_kv_heads", "shards"), sorted(SHARD_TABLE))
def test_store_shards_split_the_heads_whatever_the_tp_size(tp_size: int, num_kv_heads: int, shards: int) -> None:
    roles = [
        storage_role(
            dataclasses.replace(BASE, tp_size=tp_size, tp_rank=r, num_kv_heads=num_kv_heads, store_shards=shards)
        )
        for r in range(tp_size)
    ]
    assert [r.storage_ranks for r in roles] == SHARD_TABLE[(tp_size, num_kv_heads, shards)]
    assert {r.num_storage_ranks for r in roles} == {shards}
    written = [s for r in roles if r.writes for s in r.storage_ranks]
    assert sorted(written) == list(range(shards))  # every shard has exactly one writer


def test_the_same_split_names_the_same_objects_at_any_tp_size() -> None:
    layout = make_layout()
    names = {
        namespace_for(dataclasses.replace(BASE, tp_size=tp, num_kv_heads=8, store_shards=4), "default", layout).name
        for tp in (1, 2, 4)
    }
    assert len(names) == 1
    # unchosen, the split follows the TP size and the TP size is in the name: private to it
    private = {
        namespace_for(dataclasses.replace(BASE, tp_size=tp, num_kv_heads=2), "default", layout).name for tp in (2, 4)
    }
    assert len(private) == 2
    assert namespace_for(dataclasses.replace(BASE, store_shards=2), "default", layout).name not in {
        namespace_for(dataclasses.replace(BASE, store_shards=4), "default", layout).name
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tp_size": 4, "num_kv_heads": 8, "store_shards": 2},
            r"store_shards=2 must divide num_kv_heads=8 and be a multiple of this deployment's 4",
        ),
        ({"tp_size": 1, "num_kv_heads": 8, "store_shards": 3}, r"store_shards=3 must divide num_kv_heads=8"),
        ({"tp_size": 2, "num_kv_heads": 1, "is_mla": True, "store_shards": 2}, r"MLA latent is one head"),
    ],
)
def test_splits_that_do_not_fit_are_refused(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedSetupError, match=message):
        storage_role(dataclasses.replace(BASE, **change))
