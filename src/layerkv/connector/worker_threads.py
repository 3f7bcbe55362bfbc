"""The threads one worker (connector/worker.py) runs its jobs on, named after its rank
(`layerkv-recv-0`; `layerkv-recv-1-0` for pipeline stage 1, TP rank 0; `...-0s1` for shard 1):

* `layerkv-recv-*`: load jobs (their get sessions, reads and copies into the cache);
* `layerkv-send-*`: staged save jobs' copies out of the cache;
* `layerkv-write-*`: staged saves' store writes, direct saves, the commits and revokes of the
  verdicts (never ahead of the copies a step needs); when idle it expires late verdicts;
* one lane pool per direction (`layerkv-rlane-*`, `layerkv-slane-*`) for the store calls a job
  makes in parallel: a stuck write never holds up a read, or the reverse.

Built and closed on the compute thread. close() joins each thread with a timeout: a job still
inside the store is left to return (it is cancelled and closes its sessions when it does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerkv.messages import Deployment
from layerkv.transfer.calls import Lanes
from layerkv.transfer.thread import TransferThread

MAX_LANES = 8  # store calls one job makes at once, per direction


@dataclass(frozen=True, slots=True)
class WorkerThreads:
    recv: TransferThread
    send: TransferThread
    write: TransferThread
    load_lanes: Lanes
    save_lanes: Lanes

    @classmethod
    def named(cls, deployment: Deployment, shard: int | None, on_write_idle: Callable[[], None]) -> WorkerThreads:
        """A worker's threads; `shard`: which of the rank's shards it stores when the rank holds
        several (connector/shards.py), else None."""
        rank = f"{deployment.pp_rank}-{deployment.tp_rank}" if deployment.pp_size > 1 else str(deployment.tp_rank)
        rank += f"s{shard}" if shard is not None else ""
        return cls(
            recv=TransferThread(f"layerkv-recv-{rank}"),
            send=TransferThread(f"layerkv-send-{rank}"),
            write=TransferThread(f"layerkv-write-{rank}", on_idle=on_write_idle),
            load_lanes=Lanes(f"layerkv-rlane-{rank}", max_lanes=MAX_LANES),
            save_lanes=Lanes(f"layerkv-slane-{rank}", max_lanes=MAX_LANES),
        )

    def close(self) -> None:
        """The transfer threads first (their running jobs may still call through the lanes), then
        the lanes. Idempotent."""
        for thread in (self.recv, self.send, self.write):
            thread.close()
        self.load_lanes.close()
        self.save_lanes.close()

    def alive(self) -> list[str]:
        """Names of the transfer threads still running (none after close)."""
        return [t.name for t in (self.recv, self.send, self.write) if t.is_alive]
