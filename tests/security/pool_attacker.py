"""A pool client without the tenant's key: a separate process with a bare Mooncake store client
(`MooncakeDistributedStore`, no layerkv) that knows the master's addresses. Its hands only: the
test (which knows layerkv's code, the public model and the victim's tenant string, as an
attacker would) decides what to write. Driven by JSON lines on stdin, one answer per line.

    {"op": "list"}                                  -> {"keys": [...]}  (the master's /get_all_keys)
    {"op": "exists", "keys": [...]}                 -> {"results": [...]}
    {"op": "get", "key": K}                         -> {"data": hex}  ("" when it cannot be read)
    {"op": "overwrite", "key": K, "data": hex}      -> {"rc": rc}  (upsert)
    {"op": "squat", "keys": [...], "nbytes": N}     -> {"results": [...]}  (put sessions never ended)
    {"op": "unsquat", "keys": [...]}                -> {"results": [...]}  (revokes them)
    {"op": "wipe", "regex": R}                      -> {"removed": n}
    {"op": "segment"}                               -> {"name": S}  (argv[3] > 0: it mounts a segment of that many MiB)
    {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from typing import Any


def main() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    config: dict[str, Any] = json.loads(sys.argv[1])
    metrics_url = sys.argv[2]
    client = MooncakeDistributedStore()
    segment_mib = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # a segment holder: objects may land in its memory
    rc = client.setup(
        config["local_hostname"],
        config["metadata_server"],
        segment_mib << 20,
        64 << 20,
        "tcp",
        "",
        config["master_server_address"],
    )
    if rc != 0:
        raise SystemExit(f"pool attacker: setup failed ({rc})")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "list":
            with urllib.request.urlopen(metrics_url + "/get_all_keys", timeout=10) as reply:
                answer: dict[str, Any] = {"keys": [k for k in reply.read().decode().splitlines() if k]}
        elif op == "exists":
            answer = {"results": list(client.batch_is_exist(cmd["keys"]))}
        elif op == "get":
            data = client.get(cmd["key"])
            answer = {"data": bytes(data).hex() if data else ""}
        elif op == "overwrite":
            answer = {"rc": client.upsert(cmd["key"], bytes.fromhex(cmd["data"]))}
        elif op == "squat":
            answer = {
                "results": list(client.batch_put_session_start(cmd["keys"], [int(cmd["nbytes"])] * len(cmd["keys"])))
            }
        elif op == "unsquat":
            answer = {"results": list(client.batch_put_session_revoke(cmd["keys"]))}
        elif op == "segment":
            answer = {"name": client.get_hostname()}
        elif op == "wipe":
            answer = {"removed": client.remove_by_regex(cmd["regex"])}
        else:
            answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)
    client.close()


if __name__ == "__main__":
    main()
