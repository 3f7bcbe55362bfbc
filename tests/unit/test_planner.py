"""The transfer planner is a pure function of the step's shape and the measured costs: these
tests pin its choices and its model."""

from __future__ import annotations

import pytest

from layerkv.transfer.planner import GROUPS, LAYERS, WHOLE, Costs, LoadPlan, StepShape, choose_lanes, choose_plan, simulate

SHAPE = StepShape(num_keys=64, num_layers=8, layer_nbytes=128 << 10, header_nbytes=192, segments_per_layer=2, staging_ok=True)
# Mooncake over TCP loopback, as measured here: ~40 us per range, ~1.5 GB/s
MOONCAKE = Costs(call_s=100e-6, range_s=40e-6, bytes_per_s=1.5e9, whole_call_s=150e-6, whole_key_s=20e-6,
                 whole_bytes_per_s=2e9, copy_bytes_per_s=5e9)


def _with_compute(per_layer_token_s: float) -> Costs:
    costs = MOONCAKE.snapshot()
    costs.compute_per_layer_token_s = per_layer_token_s
    return costs


def test_lanes_need_enough_keys_each() -> None:
    assert [choose_lanes(n, 4) for n in (1, 7, 8, 16, 31, 32, 64, 1000)] == [1, 1, 1, 2, 3, 4, 4, 4]
    assert choose_lanes(1000, 2) == 2


def test_simulation_adds_what_cannot_overlap() -> None:
    shape = StepShape(num_keys=8, num_layers=2, layer_nbytes=1000, header_nbytes=0, segments_per_layer=1, staging_ok=True)
    costs = Costs(call_s=1.0, range_s=0.5, bytes_per_s=8000.0, copy_bytes_per_s=1e18, compute_per_layer_token_s=3.0)
    # per layer, 1 lane: each read = 1 + 8 * 0.5 + 8000 / 8000 = 6 s; layer 0 computes 6..9, layer 1 arrives at 12
    assert simulate(LoadPlan(LAYERS, (1, 2), 1), shape, costs, num_tokens=1) == pytest.approx(15.0)
    # one group of both layers: 1 + 4 + 2 = 7 s, then two layers of compute
    assert simulate(LoadPlan(GROUPS, (2,), 1), shape, costs, num_tokens=1) == pytest.approx(13.0)


def test_a_short_suffix_reads_few_large_ranges() -> None:
    """Transfer-bound (32 new tokens): nothing to hide behind, so the fewest, largest reads."""
    plan = choose_plan(SHAPE, _with_compute(2e-6), num_tokens=32)
    assert plan.mode in (WHOLE, GROUPS) and len(plan.group_ends) <= 2, plan
    assert plan.lanes == 4


def test_a_long_suffix_hides_the_transfer_behind_compute() -> None:
    """Compute-bound (2,048 new tokens, ~4 ms a layer; 32 layers, 32 KiB per layer per block):
    layer 0 first, the rest read while compute runs; >= 90 % of the transfer is hidden (only the
    first layer's read cannot be: with 8 layers that alone is 1/8 of the transfer)."""
    shape = StepShape(64, 32, 32 << 10, 192, 2, staging_ok=True)
    costs = _with_compute(2e-6)
    plan = choose_plan(shape, costs, num_tokens=2048)
    assert plan.mode != WHOLE and plan.group_ends[0] == 1, plan
    compute = 32 * 2048 * 2e-6
    whole = simulate(LoadPlan(WHOLE, (32,), 4), shape, costs, 2048)  # load everything, then compute
    transfer = whole - compute
    assert plan.predicted_s <= compute + 0.1 * transfer, (plan, compute, transfer)


def test_when_bandwidth_dominates_the_plan_skips_the_staging_copy() -> None:
    """128 KiB per layer per block: reading straight into the cache (no scatter copy) wins."""
    plan = choose_plan(SHAPE, _with_compute(2e-6), num_tokens=2048)
    assert plan.mode == LAYERS, plan


def test_device_caches_read_layer_by_layer() -> None:
    shape = StepShape(64, 8, 128 << 10, 192, 2, staging_ok=False)
    plan = choose_plan(shape, _with_compute(2e-6), num_tokens=32)
    assert plan.mode == LAYERS and plan.group_ends == tuple(range(1, 9))


def test_estimates_move_towards_what_is_measured_and_one_sample_is_bounded() -> None:
    costs = MOONCAKE.snapshot()
    predicted = costs.call_s + 16 * costs.range_s + (1 << 20) / costs.bytes_per_s
    for _ in range(40):
        costs.observe_ranges(2 * predicted, num_calls=1, ranges_per_call=16, nbytes=1 << 20)
    now = costs.call_s + 16 * costs.range_s + (1 << 20) / costs.bytes_per_s
    assert now == pytest.approx(2 * predicted, rel=0.02)  # the model now predicts what was measured
    assert 1.5 < costs.range_s / MOONCAKE.range_s < 2.5 and 1.5 < MOONCAKE.bytes_per_s / costs.bytes_per_s < 2.5
    one = MOONCAKE.snapshot()
    one.observe_ranges(1000.0, num_calls=1, ranges_per_call=16, nbytes=1 << 20)  # a stall: at most 4x, weighted
    assert one.range_s <= MOONCAKE.range_s * (0.8 + 0.2 * 4) + 1e-12
    costs.observe_compute(0.08, num_layers=8, num_tokens=1000)
    assert costs.compute_per_layer_token_s == pytest.approx(0.8 * MOONCAKE.compute_per_layer_token_s + 0.2 * 1e-5)
