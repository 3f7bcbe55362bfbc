"""The chaos tier: seeded rounds of faults on a real mooncake_master (killed, stopped, restarted),
its segment holder, producers and readers in separate processes, each stalled or killed at an
exact point of a transfer. Every round: outputs equal local compute, bit for bit; every request
within its bound; nothing left PROCESSING, no session left open. See test_rounds.py."""
