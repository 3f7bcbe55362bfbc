"""The segment holder of the chaos tier (tests only): a Mooncake client whose global segment is
where the master places every object, in a process of its own so that a round can stall it
(SIGSTOP) while the master and the engines run on. Usage: python -m tests.chaos.holder
<client-config-json>; prints "ready <pid>" once mounted, exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

from layerkv.store.mooncake import MooncakeStore


def main(config_json: str) -> int:
    store = MooncakeStore.from_mooncake_config(json.loads(config_json))
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
