"""connector/stats.Samples, the per-step observations behind vLLM's histograms
(integrations/vllm/metrics.py): drained by take, bounded when nobody takes them."""

from __future__ import annotations

from layerkv.connector.stats import LOAD_WAIT_S, LOOKUP_S, Samples


def test_take_drains_what_was_observed_by_name():
    samples = Samples()
    assert samples.take() == {}
    samples.observe(LOAD_WAIT_S, 0.25)
    samples.observe(LOAD_WAIT_S, 1)
    samples.observe(LOOKUP_S, 0.001)
    assert samples.take() == {LOAD_WAIT_S: [0.25, 1.0], LOOKUP_S: [0.001]}
    assert samples.take() == {}


def test_an_engine_that_never_takes_holds_the_last_max_per_name():
    samples = Samples()
    for i in range(Samples.MAX_PER_NAME + 10):
        samples.observe(LOAD_WAIT_S, i)
    (kept,) = samples.take().values()
    assert len(kept) == Samples.MAX_PER_NAME and kept[0] == 10 and kept[-1] == Samples.MAX_PER_NAME + 9
