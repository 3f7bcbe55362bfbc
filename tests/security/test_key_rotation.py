"""A tenant key rotation carries the pool over (docs/security.md §2): after `layerkv keygen
--rotate`, the new key names and seals every write, and the objects written under the old key
are still found, verified with the old key and served, until the old key's line is removed;
then they are misses (recomputed), never a wrong token. Reference engine, embedded store and a
real mooncake_master; outputs bit-identical to local compute with the same schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerkv.objects.tenant_key import read_key_file, write_key_file
from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import PooledRun, assert_identical, computed_chunks, random_tokens, serve, small_engine

PREFIX = random_tokens(24, seed=61)  # 6 blocks of 4
FIRST = PREFIX + random_tokens(2, seed=62)  # written under the old key: the prefix's 6 blocks
SECOND = PREFIX + random_tokens(13, seed=63)  # after the rotation: 6 blocks read (old key), 3 written (new)
THIRD = SECOND[:36] + random_tokens(7, seed=64)  # 9 blocks read in one load: 6 under the old key, 3 the new
MAX_TOKENS = 3
ENGINE = small_engine(max_num_batched_tokens=16)
pytestmark = BOTH_BACKENDS
KEYED = pytest.mark.parametrize("encrypted", [False, True], ids=["tenant key", "encrypted"])


def _scheduler_stats(run: PooledRun):  # type: ignore[no-untyped-def]
    return run.engine.scheduler.hooks.stats()


def _drop_old_keys(path: Path) -> None:
    """What an operator does once the pool has turned over: keep only the first line."""
    current = [line for line in path.read_text().splitlines() if line and not line.startswith("#")][0]
    path.write_text(current + "\n")


def _served(run: PooledRun, prompt: list[int]) -> tuple[list, int]:  # type: ignore[type-arg]
    got = serve(run.engine, [prompt], MAX_TOKENS)
    return got, computed_chunks(run.engine, got[0].req_id)[0][0]


@KEYED
def test_objects_of_the_old_key_are_served_after_a_rotation_until_it_is_removed(
    make_oracle, tmp_path: Path, encrypted: bool
) -> None:  # type: ignore[no-untyped-def]
    key_file = tmp_path / "tenant.key"
    old = write_key_file(key_file).current.key_id
    oracle = make_oracle(
        engine_config=ENGINE, tenant="tenant-r", tenant_key_file=str(key_file), encrypt_objects=encrypted
    )
    before = oracle.pooled()
    serve(before.engine, [FIRST], MAX_TOKENS)
    old_namespace = before.namespace

    keys = write_key_file(key_file, rotate=True)
    assert [k.key_id for k in keys.all][1] == old
    after = oracle.pooled()
    assert after.namespace != old_namespace  # the new key names what it writes
    got, resume = _served(after, SECOND)
    assert resume == len(PREFIX)  # the old key's 6 blocks were found and read
    stats = _scheduler_stats(after)
    assert (stats.hit_blocks, stats.hit_blocks_older_key) == (6, 6)
    worker = after.workers[0].stats()
    assert (worker.header_failures, worker.checksum_failures, worker.load_failed_blocks) == (0, 0, 0)
    local = oracle.local()
    serve(local, [FIRST], MAX_TOKENS)
    assert_identical(got, serve(local, [SECOND], MAX_TOKENS))
    # what it computed went in under the new key only
    assert set(after.keys(SECOND, blocks=range(6, 9))) <= set(after.put_start_keys(0))
    assert all(k.startswith(after.namespace + "@") for k in after.put_start_keys(0))

    # one load that reads both generations: each object verified (decrypted) under its own key
    mixed = oracle.pooled()
    got, resume = _served(mixed, THIRD)
    assert resume == 36
    stats = _scheduler_stats(mixed)
    assert (stats.hit_blocks, stats.hit_blocks_older_key) == (9, 6)
    assert mixed.workers[0].stats().load_failed_blocks == 0
    assert_identical(got, serve(local, [THIRD], MAX_TOKENS))

    # the old key removed: its objects are misses, recomputed; nothing is read under it
    _drop_old_keys(key_file)
    assert len(read_key_file(key_file).all) == 1
    later = oracle.pooled()
    got, resume = _served(later, FIRST)
    assert resume == 0
    assert _scheduler_stats(later).hit_blocks_older_key == 0
    assert_identical(got, serve(oracle.local(), [FIRST], MAX_TOKENS))


def test_an_engine_that_never_had_the_old_key_reads_nothing_of_it(make_oracle, tmp_path: Path) -> None:
    """A new key file (no older key in it) is another tenant: the old key's objects miss."""
    key_file = tmp_path / "tenant.key"
    write_key_file(key_file)
    oracle = make_oracle(engine_config=ENGINE, tenant="tenant-r", tenant_key_file=str(key_file))
    serve(oracle.pooled().engine, [FIRST], MAX_TOKENS)
    key_file.unlink()
    write_key_file(key_file)
    stranger = oracle.pooled()
    got, resume = _served(stranger, SECOND)
    assert resume == 0 and _scheduler_stats(stranger).hit_blocks == 0
    assert_identical(got, serve(oracle.local(), [SECOND], MAX_TOKENS))


def test_engines_that_encrypt_and_engines_that_do_not_share_a_key_and_a_pool(make_oracle, tmp_path: Path) -> None:
    """Same tenant, same key, one pool: an engine with encrypt_objects and one without each find
    and serve their own objects, bit-identical; neither takes the other's for its own (that
    refused each other's headers and removed them: the encrypted kind has names of its own)."""
    key_file = tmp_path / "tenant.key"
    write_key_file(key_file)
    macs = make_oracle(engine_config=ENGINE, tenant="tenant-e", tenant_key_file=str(key_file))
    seals = make_oracle(engine_config=ENGINE, tenant="tenant-e", tenant_key_file=str(key_file), encrypt_objects=True)
    for oracle in (macs, seals):  # each writes the prefix's 6 blocks under its own names
        first = oracle.pooled()
        got, resume = _served(first, FIRST)
        assert resume == 0 and _scheduler_stats(first).hit_blocks == 0
        assert first.workers[0].stats().save_skipped_existing == 0
    assert macs.runs[0].namespace != seals.runs[0].namespace
    local = macs.local()
    serve(local, [FIRST], MAX_TOKENS)
    expected = serve(local, [SECOND], MAX_TOKENS)
    for oracle in (macs, seals):
        again = oracle.pooled()
        got, resume = _served(again, SECOND)
        assert resume == len(PREFIX)
        worker = again.workers[0].stats()
        assert (worker.header_failures, worker.removed_objects, worker.load_failed_blocks) == (0, 0, 0)
        assert_identical(got, expected)
