"""Suite `decode` (opt-in): a KV connector's host cost per engine step in steady-state decode,
through vLLM's real Scheduler and worker hook path in this process (vllm installed here).

    suite.py    the suite: contenders, rounds, the result
    engine.py   vLLM's real scheduler and worker hooks on CPU caches, with no model
    meters.py   per-method timers and per-thread store call counters, and the rows made of them
"""
