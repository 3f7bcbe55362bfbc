"""The commit protocol in one room, both sides. Worker side: a step's saves are written during the step and
left open: each object's put session waits here (`PendingPuts`), grouped by the step that wrote
it. The scheduler side sends each step's verdict in a later step's plan (`StepVerdict`, once every
worker reported the step); `Commits.apply` then queues a `CommitJob` on the write thread, which
commits (put end) the objects of requests known clean and revokes those of requests that
attended to KV that failed to load. A step whose verdict never comes is revoked after
`commit_timeout_s` (`Commits.expire`, the write thread's idle chore); shutdown revokes whatever is
still pending (`Commits.drain`). Scheduler side (`Verdicts`): the steps with saves wait for every
worker's report of them; each step's verdict goes out with the next plan.

    save job (write thread):   put start ─ write ─> PendingPuts.add(step)
    plan of a later step:      Commits.apply(verdicts) ─> CommitJob.run (write thread):
                                   put end (clean) / put revoke (tainted), a revoke always before
                                   a new put start of the same key (same thread, in order)

    scheduler:  plan N (saves) ─ Verdicts.await_step(N) ... workers report N ─ Verdicts.report
                ─ plan N+1 carries Verdicts.take() = [verdict on N]

Threads: `PendingPuts` is guarded by its lock (save jobs add, the commit job and the idle chore
pop); `Commits` is the compute thread's, except `expire` (write thread) and its counter (lock);
`Verdicts` is the scheduler thread's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from layerkv.messages import ReqId
from layerkv.metadata import StepVerdict
from layerkv.store.base import ObjectKey
from layerkv.store.checked import CheckedStore
from layerkv.transfer.thread import JobState, TransferThread

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingPut:
    key: ObjectKey
    owner: ReqId  # the request whose block the object was written from


class PendingPuts:
    """Put sessions whose bytes are all written but whose commit is not decided yet, by step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._steps: dict[int, tuple[float, list[PendingPut]]] = {}  # guarded by _lock: seq -> (since, puts)

    def add(self, step_seq: int, puts: list[PendingPut]) -> None:
        if not puts:
            return
        with self._lock:
            since, held = self._steps.setdefault(step_seq, (self._clock(), []))
            held.extend(puts)

    def pop(self, step_seq: int) -> list[PendingPut]:
        """The step's puts (forgotten here: the caller ends or revokes them)."""
        with self._lock:
            entry = self._steps.pop(step_seq, None)
        return entry[1] if entry else []

    def pop_older_than(self, max_age_s: float) -> list[PendingPut]:
        """Puts of steps pending longer than `max_age_s` (their verdict never came)."""
        now = self._clock()
        with self._lock:
            old = [seq for seq, (since, _) in self._steps.items() if now - since > max_age_s]
            return [put for seq in old for put in self._steps.pop(seq)[1]]

    def pop_all(self) -> list[PendingPut]:
        with self._lock:
            steps, self._steps = self._steps, {}
        return [put for _, puts in steps.values() for put in puts]

    def num_keys(self) -> int:
        with self._lock:
            return sum(len(puts) for _, puts in self._steps.values())


@dataclass(slots=True)
class CommitOutcome:
    committed: int = 0
    revoked_tainted: int = 0
    commit_failed: int = 0  # put end failed: revoked
    error: BaseException | None = None


class CommitJob(JobState):
    """Commit / revoke the pending puts of the steps `verdicts` name (write thread)."""

    def __init__(self, verdicts: tuple[StepVerdict, ...], *, store: CheckedStore, pending: PendingPuts) -> None:
        super().__init__("layerkv commit")
        self.verdicts = verdicts
        self._store = store
        self._pending = pending
        self.outcome = CommitOutcome()

    def run(self) -> None:
        try:
            for verdict in self.verdicts:
                puts = self._pending.pop(verdict.step_seq)
                tainted = [p.key for p in puts if verdict.revokes(p.owner)]
                clean = [p.key for p in puts if not verdict.revokes(p.owner)]
                if tainted:
                    log.info(
                        "layerkv: step %d: revoking %d objects of requests that attended to KV that failed to load",
                        verdict.step_seq,
                        len(tainted),
                    )
                    self._store.batch_put_session_revoke(tainted)
                    self.outcome.revoked_tainted += len(tainted)
                if clean:
                    self._commit(clean)
        except BaseException as exc:  # noqa: BLE001 - a thread error must not reach the engine
            log.exception("layerkv: committing put sessions failed")
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
            log.warning(
                "layerkv: commit failed for %d keys (%s); revoking them",
                len(bad),
                sorted(set(results[results != 0].tolist())),
            )
            self.outcome.commit_failed += len(bad)
            self._store.batch_put_session_revoke(bad)


def revoke_puts(store: CheckedStore, puts: list[PendingPut], why: str) -> int:
    """Revoke `puts` (shutdown, or a verdict that never came); returns how many."""
    if puts:
        log.warning("layerkv: revoking %d pending put sessions: %s", len(puts), why)
        store.batch_put_session_revoke([p.key for p in puts])
    return len(puts)


class Commits:
    """One worker's side of the protocol: which steps it started saves in, the commit job of
    this step's plan, one that outlived its wait, the idle expiry and the shutdown drain."""

    def __init__(self, store: CheckedStore, writer: TransferThread, commit_timeout_s: float) -> None:
        self.store = store
        self.pending = PendingPuts()
        self.writer = writer  # the write thread: commits, staged saves' writes, the idle expiry
        self._timeout_s = commit_timeout_s
        self._saved_steps: set[int] = set()  # steps whose save job was started, until their verdict
        self.job: CommitJob | None = None  # this step's (compute thread)
        self._late: CommitJob | None = None  # a verdict-only step's job that outlived its wait
        self._latest: CommitJob | None = None  # the last job queued (this step's or an earlier one's)
        self._lock = threading.Lock()
        self._expired = 0  # guarded by _lock: pending puts revoked after commit_timeout_s

    def saving(self, step_seq: int) -> None:
        """A save job of `step_seq` started: its verdict has something to commit."""
        self._saved_steps.add(step_seq)

    def apply(self, verdicts: tuple[StepVerdict, ...]) -> CommitJob | None:
        """Queue the commits of the verdicts on steps this worker saved in (the others have
        nothing pending: a stalled store skips every step's saves, and its verdicts must not each
        queue a job). On the write thread, so before this step's saves' writes."""
        mine = tuple(v for v in verdicts if v.step_seq in self._saved_steps)
        if not mine:
            return None
        self._saved_steps -= {v.step_seq for v in mine}
        self.job = self._latest = CommitJob(mine, store=self.store, pending=self.pending)
        self.writer.submit(self.job)
        return self.job

    def commit_now(self, step_seq: int) -> bool:
        """A role that never loads (kv_producer): no load on any rank or stage can taint its
        saves, so the step's objects are committed as soon as they are written, without waiting
        for the scheduler's verdict (which then finds nothing left to do). Queued on the write
        thread after the step's writes. False (the verdict decides, as for every other role)
        when this step already has a commit job, or no saves."""
        if self.job is not None or step_seq not in self._saved_steps:
            return False
        self.apply((StepVerdict(step_seq),))
        return True

    def finish_idle_step(self, wait_s: float) -> None:
        """A step with nothing but verdicts is what an engine runs when it would otherwise go
        idle: its commits finish here, so they are in the pool (and in this step's stats) before
        the engine stops stepping. Bounded; one that times out (the write thread is stuck in the
        store) finishes alone, and no later step waits until it has: a stalled store costs one
        bound, not one per step. The job waited for is the latest one queued: a step that
        computes tokens never waits for its commits (SchedulerConnector keeps the engine
        stepping once more, with nothing scheduled, after such a step carried verdicts)."""
        if self._late is not None and self._late.finished:
            self._late = None
        job = self._latest
        if job is not None and self._late is None and not job.wait_finished(wait_s):
            self._late = job

    def end_step(self) -> CommitJob | None:
        """Forget this step's job (the caller collects its outcome); returns it."""
        job, self.job = self.job, None
        return job

    def expire(self) -> None:
        """Write thread, when idle: revoke puts whose verdict never came."""
        puts = self.pending.pop_older_than(self._timeout_s)
        if puts:
            n = revoke_puts(self.store, puts, f"no commit verdict within {self._timeout_s:.0f} s")
            with self._lock:
                self._expired += n

    def expired(self) -> int:
        with self._lock:
            return self._expired

    def drain(self, why: str) -> int:
        """Revoke every pending put (shutdown); returns how many."""
        return revoke_puts(self.store, self.pending.pop_all(), why)


# -- scheduler side -------------------------------------------------------------------------
class VerdictStats(Protocol):
    tainted_requests: int
    unreported_steps: int


@dataclass(slots=True)
class _AwaitedStep:
    """A step with saves whose verdict waits for every worker's report."""

    block_tables: dict[ReqId, frozenset[int]]  # every request of the step: all its block ids
    since_s: float  # monotonic time the step was planned
    invalid_block_ids: set[int] = field(default_factory=set)  # reported while it waited
    num_reports: int = 0


class Verdicts:
    """The scheduler side: the steps with saves that wait for their workers' reports, and the
    verdicts decided but not yet carried by a plan. A step is decided once all `num_workers`
    (every TP rank and pipeline stage) reported it: commit, except the objects of requests whose
    block table held a block that failed to load on any worker; a step some worker never reports
    is revoked whole (once a later step is reported, or after `commit_timeout_s`). Scheduler
    thread only."""

    def __init__(
        self,
        num_workers: int,
        commit_timeout_s: float,
        stats: VerdictStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._num_workers = num_workers
        self._timeout_s = commit_timeout_s
        self._stats = stats
        self._clock = clock
        self._awaiting: dict[int, _AwaitedStep] = {}  # step seq -> its requests' block tables, until decided
        self._decided: list[StepVerdict] = []  # not yet sent

    def await_step(self, step_seq: int, block_tables: dict[ReqId, frozenset[int]]) -> None:
        """Step `step_seq` plans saves: its verdict waits for its reports."""
        self._awaiting[step_seq] = _AwaitedStep(block_tables, self._clock())

    def take(self) -> tuple[StepVerdict, ...]:
        """The verdicts decided since the last call (the next plan carries them)."""
        decided, self._decided = tuple(self._decided), []
        return decided

    def report(self, invalid_block_ids: AbstractSet[int], reported_steps: Sequence[int]) -> None:
        """One combined worker output. Failed blocks count against every step still waiting
        (under async scheduling a step can be built before the previous step's failures are
        known)."""
        if not self._awaiting:  # nothing waits (a decode step): nothing to count
            return
        for awaited in self._awaiting.values():
            awaited.invalid_block_ids |= invalid_block_ids
        counts = Counter(reported_steps)
        for seq, n in counts.items():
            if seq in self._awaiting:
                self._awaiting[seq].num_reports += n
        latest = max(counts, default=-1)
        for seq in sorted(self._awaiting):
            awaited = self._awaiting[seq]
            if awaited.num_reports >= self._num_workers:
                del self._awaiting[seq]
                tainted = frozenset(
                    r for r, blocks in awaited.block_tables.items() if blocks & awaited.invalid_block_ids
                )
                self._decided.append(StepVerdict(seq, tainted))
                self._stats.tainted_requests += len(tainted)
            elif seq < latest:  # a later step is reported, this one never will be in full
                self._revoke(seq, "")

    def pending(self) -> bool:
        """A step waits for its verdict, or a verdict for the next plan: the engine must keep
        stepping. A step whose reports did not all come within commit_timeout_s is revoked here
        (the workers revoke such sessions themselves too)."""
        deadline = self._clock() - self._timeout_s
        for seq in [s for s, a in self._awaiting.items() if a.since_s < deadline]:
            self._revoke(seq, f" within {self._timeout_s:.0f} s")
        return bool(self._awaiting or self._decided)

    def _revoke(self, seq: int, within: str) -> None:
        awaited = self._awaiting.pop(seq)
        log.warning(
            "layerkv: step %d was reported by %d of %d workers%s; revoking its saves",
            seq,
            awaited.num_reports,
            self._num_workers,
            within,
        )
        self._decided.append(StepVerdict(seq, revoke_all=True))
        self._stats.unreported_steps += 1
