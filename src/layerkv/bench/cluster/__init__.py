"""Hosts as network namespaces and a Mooncake pool spread over them: the infrastructure of suite
`network` (layerkv.bench.network) and of the cluster test tier (tests/cluster). Needs root.

    netns.py  hosts: one network namespace each, veth links to a switch namespace, rate limits
    pool.py   a `layerkv master` host, storage hosts, and processes started on any host
"""
