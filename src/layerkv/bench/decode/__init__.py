"""Suite `decode` (opt-in): a KV connector's host cost per engine step in steady-state decode,
through vLLM's real Scheduler and worker hook path in this process (vllm installed here).

    suite.py       the suite: one run per contender and batch size, the result
    contenders.py  the connectors it compares and the `layerkv master` children they need
    engine.py      vLLM's real scheduler driving a worker, one step at a time, with no model
    worker.py      the worker side: vLLM's real worker hook path on CPU caches
    meters.py      per-method timers and per-thread store call counters, and the rows made of them
"""
