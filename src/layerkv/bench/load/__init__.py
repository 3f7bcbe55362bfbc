"""Suite `load` (opt-in): real `vllm serve` servers under vLLM's own benchmark client, per
scenario and contender; throughput, latency percentiles, pool hits, RSS, logs and outputs.

    suite.py    the suite: each scenario x contender run, the soak
    plan.py     what it runs (pure): model, workload, scenarios, contenders
    fleet.py    one contender's servers and pool, started and stopped together
    client.py   vLLM's benchmark client, run under the engine's Python
    probe.py    /metrics samples, the master's put balance, log errors, the RSS sampler thread
    report.py   the rows, the goals checked and the plots (pure over the records)
    lmcache.py  LMCache 0.5.6 as a contender: its venv and its server
"""
