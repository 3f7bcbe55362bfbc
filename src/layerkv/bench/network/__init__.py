"""Suite `network` (opt-in, needs root): time to first token across network-namespace hosts
(layerkv.bench.cluster) over shaped consumer links. Each module below runs in its own process:

    suite.py    the suite: writes a job, runs cluster.py in a private namespace, builds the result
    cluster.py  python -m: makes the cluster, shapes the consumer's link per rate, runs the hosts
    host.py     python -m on the consumer host: the reference engine's contenders
    engines.py  real vLLM engines across hosts (suite serving's `measure`), when an engine Python is given
"""
