"""`save_decode_blocks` under vLLM's real Scheduler and worker hook path: by default the blocks a
request's answer fills are saved too (a later turn that sends the answer back hits them); set
to false, only the prompt's full blocks are, and decode steps plan no save."""

from __future__ import annotations

import pytest

from tests.vllm.vllm_harness import BLOCK_SIZE, require_vllm

require_vllm()

from tests.tokens import prompt  # noqa: E402
from tests.vllm.pool_rig import SAMPLED_TOKEN, assert_blocks  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("save_decode_blocks", [True, False])
def test_the_blocks_an_answer_fills_are_saved_unless_switched_off(pool, save_decode_blocks):
    producer = pool.node(extra={"save_decode_blocks": save_decode_blocks})
    tokens = prompt(11, 2 * BLOCK_SIZE + 8)
    producer.add("p", tokens, max_tokens=2 * BLOCK_SIZE)  # decode fills block 2 and block 3
    producer.run_to_completion()
    saved_blocks = 4 if save_decode_blocks else 2
    assert producer.core_worker.stats().committed_keys == saved_blocks
    assert producer.scheduler.connector.scheduler_side.subs[0].stats().save_blocks == saved_blocks

    consumer = pool.node()
    next_turn = tokens + [SAMPLED_TOKEN] * (2 * BLOCK_SIZE) + [5]  # the prompt, its answer, one more token
    consumer.add("c", next_turn)
    consumer.step()
    assert consumer.core_worker.stats().load_blocks == saved_blocks
    assert_blocks(consumer, "c", next_turn, saved_blocks)  # what was loaded is the model's KV
