"""The master host partitioned (during lookups, put start, put end) and the producer host
partitioned after writing layers, before its put end, each its own test, on the pool of
tests/cluster/conftest.py. Outputs equal local compute bit for bit, no engine hangs (each cut
costs one store_call_timeout_s, then the outage short-circuits), no object is left PROCESSING.
Each test prints how long the pool took to serve hits again after the link returned.

Mooncake's master drops a client (and unmounts its segments: every object on them is gone)
once its heartbeats stop for client_ttl (10 s): a partition shorter than that leaves the pool's
objects in place, a longer one empties it and the holders mount their segments again."""

from __future__ import annotations

import pytest
import torch

from layerkv.messages import KVRole
from layerkv.store.faults import IS_EXIST, PUT_END, PUT_RANGES, PUT_START
from tests.cluster.pool import Pool
from tests.cluster.scenario import HIT_TOKENS, MASTER_FAILURE, assert_local, cut_at_gate, job, make_prompts

pytestmark = pytest.mark.mooncake
CLIENT_TTL_S = 10.0  # mooncake_master's default --client_ttl


@pytest.mark.parametrize("hold_s", [0.0, CLIENT_TTL_S + 5.0], ids=["short", "past-client-ttl"])
def test_the_master_host_is_partitioned_during_lookups(pool: Pool, hold_s: float) -> None:
    """The consumer's first lookup finds the master cut off: it answers within
    store_call_timeout_s as an outage and both requests compute locally (no hit, no hang). A short
    partition keeps the producer's objects: after the link returns, probes of its prefixes hit.
    One past client_ttl loses them (the storage hosts were dropped): probes of prefixes written
    after the link returned hit."""
    tag = f"lookups-{int(hold_s)}"
    prompts = make_prompts(seed=201 + int(hold_s), num_probes=20)
    producer = pool.engine(
        "producer", job(tag, prompts.producer + ([] if hold_s else prompts.probe_writes), hold=True), "producer"
    )
    out = pool.tmp / f"{tag}.pt"
    probes = {"prompts": prompts.probes, "hit": HIT_TOKENS, "interval_s": 1.0}
    if hold_s:
        probes["writes"] = prompts.probe_writes
    try:
        made = pool.report(producer)
        assert made["idle"] and made["stats"][0]["committed_keys"] > 0
        consumer = pool.engine(
            "consumer",
            job(
                tag,
                prompts.consumer,
                out=str(out),
                role=KVRole.CONSUMER.value,
                layerkv=MASTER_FAILURE,
                gate={"method": IS_EXIST},
                probes=probes,
            ),
            "consumer",
        )
        try:
            seen = cut_at_gate(pool, consumer, "master", hold_s)
        finally:
            assert consumer.stop() == 0
    finally:
        assert producer.stop() == 0
    kinds = assert_local(tag, torch.load(out, weights_only=False), prompts)
    print(
        f"master cut during lookups ({hold_s:.0f} s past the requests): {kinds}, hit tokens {seen['hit_tokens']}, "
        f"requests {seen['seconds']} s; after the link returned: {seen['recovery']}"
    )
    assert seen["hit_tokens"] == [0, 0]  # no lookup answered: computed locally
    assert max(seen["seconds"]) < 3 * MASTER_FAILURE["store_call_timeout_s"]  # bounded, no hang
    assert seen["recovery"]["recovery_s"] is not None, seen["recovery"]
    assert seen["idle"]


# (where the gate stops the producer's first save, the host cut there, its layerkv config)
SAVE_CUTS = {
    "put-start": ({"method": PUT_START}, "master", {}),
    "put-end": ({"method": PUT_END}, "master", {}),
    # the default save path writes whole objects after the forward: cut before their put end
    "producer-before-put-end": ({"method": PUT_RANGES, "when": "after"}, "producer", {}),
    # the per-layer path (a registered host cache): layer 0 written, layer 1 not yet
    "producer-between-layers": (
        {"method": PUT_RANGES, "layer_idx": 1},
        "producer",
        {"transfer_plan": "layers", "register_kv_cache": True, "encrypt_objects": False},
    ),
}


@pytest.mark.parametrize("where", list(SAVE_CUTS))
def test_a_partition_while_the_producer_saves(pool: Pool, where: str) -> None:
    """The producer's first save is cut off: at its put start or its put end the master is
    partitioned; or the producer host itself, once its objects are written (before their put
    end), or between its layer writes (its later layers, its put end and its revoke fail).
    The save fails within save_timeout_s, nothing it began is served (the consumer's outputs
    equal local compute), no object stays PROCESSING for good (the master discards an
    uncompleted put after put_start_discard_timeout_sec, 30 s), and after the link returns the
    producer's saves are served again."""
    tag = f"save-{where}"
    gate, host, layerkv = SAVE_CUTS[where]
    prompts = make_prompts(seed=401 + 10 * list(SAVE_CUTS).index(where), num_probes=20)
    producer = pool.engine(
        "producer",
        job(
            tag,
            prompts.producer,
            layerkv={**MASTER_FAILURE, **layerkv},
            gate=gate,
            probes={"prompts": prompts.probes, "writes": prompts.probe_writes, "hit": HIT_TOKENS},
        ),
        "producer",
    )
    try:
        made = cut_at_gate(pool, producer, host)
    finally:
        assert producer.stop() == 0
    keys = sorted(set(made["put_keys"]))
    out = pool.tmp / f"{tag}.pt"
    consumer = pool.engine(
        "consumer",
        job(tag, prompts.consumer, out=str(out), role=KVRole.CONSUMER.value, check_keys=keys, settle_s=60.0),
        "consumer",
    )
    try:
        seen = pool.report(consumer)
    finally:
        assert consumer.stop() == 0
    kinds = assert_local(tag, torch.load(out, weights_only=False), prompts)
    stats = made["stats"][0]
    print(
        f"{host} cut at the producer's save ({where}): save failures {stats['save_failed_keys']} keys, commit failures "
        f"{stats.get('commit_failed', '-')}, requests {made['seconds']} s; after the link returned: "
        f"{made['recovery']}; "
        f"consumer: {kinds}, hit tokens {seen['hit_tokens']}; PROCESSING left {len(seen['processing'])} "
        f"of {len(keys)} keys after {seen['processing_s']} s"
    )
    assert max(made["seconds"]) < 3 * MASTER_FAILURE["store_call_timeout_s"] + 5  # bounded, no hang
    assert made["recovery"]["recovery_s"] is not None, made["recovery"]
    assert seen["processing"] == [], seen["processing"]
    assert made["idle"] and seen["idle"]
