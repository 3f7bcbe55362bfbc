"""Fixtures for the vLLM facade tests (see vllm_harness.py, worker_rig.py and recording_doubles.py):
`pool` is PoolNodes (pool_rig.py) on the embedded store and on the real Mooncake master (a module
may define its own `pool`)."""

import pytest

from tests.vllm.recording_doubles import doubles  # noqa: F401  (a fixture)
from tests.vllm.worker_rig import clean_agent  # noqa: F401  (a fixture)


@pytest.fixture(params=["embedded", "mooncake"])
def pool(request, tmp_path, clean_agent):  # noqa: F811  (clean_agent: the fixture above)
    from tests.vllm.pool_rig import PoolNodes  # needs vLLM: imported only by the tests that use it

    master = request.getfixturevalue("mooncake_master") if request.param == "mooncake" else None
    nodes = PoolNodes(request.param, tmp_path, master)
    try:
        yield nodes
    finally:
        nodes.shutdown()
