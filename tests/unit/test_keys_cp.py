"""Decode context parallelism in object names (objects/keys.py): each CP rank's share of a block is its
own object under a namespace naming the CP rank, the CP size and the interleave; the first rank of each
share writes; names without context parallelism are what they were before CP existed."""

from __future__ import annotations

import dataclasses

import pytest

from layerkv.errors import ConfigError, UnsupportedSetupError
from layerkv.messages import Deployment
from layerkv.objects.keys import namespace_for, share_deployment, storage_role

GQA = Deployment(
    model_id="meta-llama/Llama-3.1-8B", kv_dtype="float16", block_size=16, num_kv_heads=8, tp_size=2, kv_signature="sig"
)
MLA = Deployment(
    model_id="deepseek/V3",
    kv_dtype="bfloat16",
    block_size=64,
    num_kv_heads=1,
    tp_size=4,
    is_mla=True,
    kv_signature="mla",
    pp_size=2,
    pp_rank=1,
)


def ranks(base: Deployment, tp_size: int, dcp_size: int, **change: object) -> list[Deployment]:
    return [
        dataclasses.replace(base, tp_size=tp_size, tp_rank=r, dcp_size=dcp_size, dcp_rank=r % dcp_size, **change)
        for r in range(tp_size)
    ]


def test_names_without_context_parallelism_are_those_before_it() -> None:
    """Digests computed by the code before CP existed (commit 0f619aa): objects already in pools keep
    their names."""
    assert namespace_for(GQA, "default").digest.hex() == "8c2df10c922ca4e4e8f48847349986f6"
    assert namespace_for(MLA, "default").digest.hex() == "da4ffa1c87274269376c593476c8543f"
    assert namespace_for(dataclasses.replace(GQA, cp_interleave=4), "default") == namespace_for(GQA, "default")


@pytest.mark.parametrize(
    "change", [{"dcp_rank": 1}, {"cp_interleave": 4}, {"tp_size": 4, "tp_rank": 0, "dcp_size": 4, "dcp_rank": 0}]
)
def test_cp_rank_size_and_interleave_each_name_other_objects(change: dict) -> None:
    two = dataclasses.replace(MLA, dcp_size=2)
    other = dataclasses.replace(two, **change)
    if change == {"dcp_rank": 1}:
        other = dataclasses.replace(other, tp_rank=1)
    assert namespace_for(other, "default").digest != namespace_for(two, "default").digest
    assert namespace_for(two, "default").digest != namespace_for(MLA, "default").digest


def test_ranks_of_one_share_name_the_same_objects() -> None:
    """MLA TP 4 / DCP 2: ranks 0 and 2 hold CP share 0, ranks 1 and 3 share 1."""
    names = [namespace_for(d, "default").name for d in ranks(MLA, 4, 2)]
    assert names[0] == names[2] != names[1] == names[3]
    assert [namespace_for(share_of(MLA, 4, 2, c), "default").name for c in (0, 1)] == names[:2]


def share_of(base: Deployment, tp_size: int, dcp_size: int, cp_rank: int) -> Deployment:
    return share_deployment(dataclasses.replace(base, tp_size=tp_size, dcp_size=dcp_size), base.pp_rank, cp_rank)


@pytest.mark.parametrize(("tp_size", "writers"), [(2, [True, True]), (4, [True, True, False, False])])
def test_mla_writers_are_the_first_rank_of_each_share(tp_size: int, writers: list[bool]) -> None:
    roles = [storage_role(d) for d in ranks(MLA, tp_size, 2)]
    assert [r.writes for r in roles] == writers
    assert {r.storage_ranks for r in roles} == {(0,)} and {r.num_storage_ranks for r in roles} == {1}


def test_gqa_tp4_dcp2_every_rank_writes_its_heads_share() -> None:
    """2 KV heads over TP 4: ranks {0, 1} replicate head 0, {2, 3} head 1; DCP 2 gives each replica
    its own token share, so every rank is the only holder of its (head, share) and writes it."""
    roles = [storage_role(d) for d in ranks(GQA, 4, 2, num_kv_heads=2)]
    assert [r.storage_ranks for r in roles] == [(0,), (0,), (1,), (1,)]
    assert [r.writes for r in roles] == [True] * 4
    assert {r.num_storage_ranks for r in roles} == {2}


def test_gqa_tp8_dcp2_one_writer_per_head_and_share() -> None:
    roles = [storage_role(d) for d in ranks(GQA, 8, 2, num_kv_heads=2)]  # 4 replicas per head
    writers = [(d.tp_rank, r.storage_rank) for d, r in zip(ranks(GQA, 8, 2, num_kv_heads=2), roles) if r.writes]
    assert writers == [(0, 0), (1, 0), (4, 1), (5, 1)]  # per head: one writer of CP share 0, one of share 1


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"tp_size": 2, "dcp_size": 2, "dcp_rank": 0, "tp_rank": 1}, ConfigError, r"dcp_rank=0 must be tp_rank % "),
        ({"tp_size": 3, "dcp_size": 2}, UnsupportedSetupError, r"decode context parallel size 2 must divide tp_size=3"),
        ({"tp_size": 2, "dcp_size": 2}, UnsupportedSetupError, r"tp_size // num_kv_heads must be a multiple"),
        (
            {"tp_size": 4, "num_kv_heads": 2, "dcp_size": 2, "store_shards": 4},
            UnsupportedSetupError,
            r"store_shards=4 must divide|store_shards=4 with decode context parallelism",
        ),
    ],
)
def test_bad_cp_placements_raise_clear_errors(change: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        storage_role(dataclasses.replace(GQA, **change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dcp_size": 0}, r"dcp_size=0 must be an int >= 1"),
        ({"dcp_size": 2, "dcp_rank": 2}, r"dcp_rank=2 must be 0 <= dcp_rank < dcp_size=2"),
        ({"dcp_size": 2, "cp_interleave": 3}, r"cp_interleave=3 must divide block_size=16"),
        ({"dcp_size": 2, "cp_interleave": 32}, r"cp_interleave=32 must divide block_size=16"),
    ],
)
def test_bad_cp_settings_are_refused_by_the_deployment(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(GQA, **change)


def test_the_scheduler_block_spans_every_cp_rank() -> None:
    assert GQA.scheduler_block_size == 16
    assert dataclasses.replace(MLA, dcp_size=4).scheduler_block_size == 256
