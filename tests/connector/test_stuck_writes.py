"""A background object write that does not return (a stalled segment holder: Mooncake has no
transfer timeout on TCP) must not make every later step allocate a new staging image: found by
the chaos tier (tests/chaos, test_segment_holder_stalled), pinned here on every backend."""

from __future__ import annotations

import time

from layerkv.connector.worker import MAX_SAVES_IN_FLIGHT
from layerkv.store.faults import PUT_RANGES
from tests.connector.rig import BLOCK_SIZE, Req
from tests.tokens import block_tokens


def _serve(rig, req: Req) -> None:  # type: ignore[no-untyped-def]
    """rig.run without its flush (which waits for the background writes)."""
    _, s = rig.admit(req, BLOCK_SIZE)
    rig.step([s])
    while not req.done:
        rig.step([rig.chunk(req, BLOCK_SIZE)])
    rig.step([])  # the verdicts on its saves


def test_a_stuck_background_write_does_not_pile_up_staging(make_rig) -> None:
    rig = make_rig(num_layers=2, transfer_plan="auto")
    rig.faults[0].delay(PUT_RANGES, 60.0, times=1)  # the first step's object write never returns
    worker = rig.workers[0]
    start = time.monotonic()
    _serve(rig, Req("r0", block_tokens(4, BLOCK_SIZE)))
    areas = worker._areas
    assert areas is not None
    held = areas.nbytes()
    for i in range(1, 6):  # 25 more steps that each have a block to save
        _serve(rig, Req(f"r{i}", block_tokens(4, BLOCK_SIZE, base=100 * i)))
    assert worker._areas is areas and areas.nbytes() == held  # fixed at start-up: never grows
    assert areas.saves.slots_in_use() <= MAX_SAVES_IN_FLIGHT  # the saves in flight hold one slot each
    stats = worker.stats()
    assert stats.save_skipped_steps >= 25 - MAX_SAVES_IN_FLIGHT - 1  # all but those in flight behind the write
    assert stats.save_skipped_keys == stats.save_skipped_steps  # one block per step
    # held behind the write: the saves in flight and their settle jobs, not one job per step
    assert worker.open_sessions()["running_jobs"] <= 2 * MAX_SAVES_IN_FLIGHT, worker.open_sessions()
    # the six verdict-only steps: the first waits save_timeout_s for its commits (stuck behind
    # the write), the others see that wait is still unfinished and do not wait again
    bound = rig.config.save_timeout_s
    assert time.monotonic() - start < 2.5 * bound, f"{time.monotonic() - start:.1f} s: every idle step waited {bound} s"
    rig.faults[0].release()
    assert worker.is_idle(5.0)
