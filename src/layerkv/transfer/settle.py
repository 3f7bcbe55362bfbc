"""Applying the scheduler's verdicts: for each earlier step, commit (put end) the pending
sessions of requests that are known clean and revoke those of tainted requests. Runs on the
send thread before the step's save job, so a revoke always precedes a new put start of the same
key. Also the idle chore that revokes pending sessions whose verdict never came.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from layerkv.metadata import StepVerdict
from layerkv.store.checked import CheckedStore
from layerkv.transfer.pending import PendingPut, PendingPuts
from layerkv.transfer.thread import JobState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SettleOutcome:
    committed: int = 0
    revoked_tainted: int = 0
    commit_failed: int = 0  # put end failed: revoked
    error: BaseException | None = None


class SettleJob(JobState):
    """Commit / revoke the pending puts of the steps `verdicts` name (send thread)."""

    def __init__(self, verdicts: tuple[StepVerdict, ...], *, store: CheckedStore, pending: PendingPuts) -> None:
        super().__init__("layerkv settle")
        self.verdicts = verdicts
        self._store = store
        self._pending = pending
        self.outcome = SettleOutcome()

    def run(self) -> None:
        try:
            for verdict in self.verdicts:
                puts = self._pending.pop(verdict.step_seq)
                tainted = [p.key for p in puts if verdict.revokes(p.owner)]
                clean = [p.key for p in puts if not verdict.revokes(p.owner)]
                if tainted:
                    log.info("layerkv: step %d: revoking %d objects of requests that attended to KV that failed to load",
                             verdict.step_seq, len(tainted))
                    self._store.batch_put_session_revoke(tainted)
                    self.outcome.revoked_tainted += len(tainted)
                if clean:
                    self._commit(clean)
        except BaseException as exc:  # noqa: BLE001 - a thread error must not reach the engine
            log.exception("layerkv: settling put sessions failed")
            self.outcome.error = exc
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def _commit(self, keys: list[str]) -> None:
        results = np.asarray(self._store.batch_put_session_end(keys), dtype=np.int64)
        self.outcome.committed += int(np.count_nonzero(results == 0))
        bad = [k for k, code in zip(keys, results.tolist()) if code != 0]
        if bad:
            log.warning("layerkv: commit failed for %d keys (%s); revoking them", len(bad), sorted(set(results[results != 0].tolist())))
            self.outcome.commit_failed += len(bad)
            self._store.batch_put_session_revoke(bad)


def revoke_all(store: CheckedStore, puts: list[PendingPut], why: str) -> int:
    """Revoke `puts` (shutdown, or a verdict that never came); returns how many."""
    if puts:
        log.warning("layerkv: revoking %d pending put sessions: %s", len(puts), why)
        store.batch_put_session_revoke([p.key for p in puts])
    return len(puts)
