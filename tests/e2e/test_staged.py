"""The oracle with staged layer-group loads (read_layers_per_range=4): the consumer that reads
groups of layers through host staging gives bit-identical output to local compute."""

from __future__ import annotations

import dataclasses

from tests.backends import BOTH_BACKENDS
from tests.e2e.harness import HIT_TOKENS, MODEL, assert_loaded, produce_and_consume, two_docs


@BOTH_BACKENDS
def test_staged_consumer_equals_local(make_oracle) -> None:
    model = dataclasses.replace(MODEL, num_layers=6)  # groups [0] [1..4] [5]: 6 is not 1 + 4k
    oracle = make_oracle(model=model, read_layers_per_range=4)
    producer_prompts, consumer_prompts = two_docs(seed=40)
    _, consumer, got = produce_and_consume(oracle, producer_prompts, consumer_prompts)
    assert_loaded(consumer, got, HIT_TOKENS)
    # three range calls (one per group) per loading step, not one per layer
    assert consumer.workers[0].stats().load_range_calls == 3 * len(consumer_prompts)
    reads = [c for c in consumer.rank_faults(0).calls("batch_get_into_multi_buffer_ranges")]
    assert reads and all(c.num_ranges == len(c.keys) for c in reads)  # one range per key
