"""The transfer planner is a pure function of the step's shape and the measured costs: these
tests pin its choices and its model."""

from __future__ import annotations

import dataclasses

import pytest

from layerkv.transfer.costs import Costs
from layerkv.transfer.planner import (
    GROUPS,
    LAYERS,
    WHOLE,
    Exploration,
    LoadPlan,
    StepShape,
    best_of_kinds,
    candidates,
    choose_lanes,
    choose_plan,
    fastest,
    plan_kinds,
    simulate,
    transfer_s,
)

SHAPE = StepShape(
    num_keys=64, num_layers=8, layer_nbytes=128 << 10, header_nbytes=192, segments_per_layer=2, staging_ok=True
)
# Mooncake over TCP loopback on an idle host: ~40 us per range that concurrent calls overlap, ~1.5 GB/s
MOONCAKE = Costs(
    call_s=100e-6,
    range_s=40e-6,
    range_cpu_s=5e-6,
    bytes_per_s=1.5e9,
    whole_call_s=150e-6,
    whole_key_s=20e-6,
    whole_bytes_per_s=2e9,
    copy_bytes_per_s=5e9,
)


def _with_compute(per_layer_token_s: float) -> Costs:
    costs = MOONCAKE.snapshot()
    costs.compute_per_layer_token_s = per_layer_token_s
    return costs


def test_lanes_need_enough_keys_each() -> None:
    assert [choose_lanes(n, 4) for n in (1, 7, 8, 16, 31, 32, 64, 1000)] == [1, 1, 1, 2, 3, 4, 4, 4]
    assert choose_lanes(1000, 2) == 2


def test_simulation_adds_what_cannot_overlap() -> None:
    shape = StepShape(
        num_keys=8, num_layers=2, layer_nbytes=1000, header_nbytes=0, segments_per_layer=1, staging_ok=True
    )
    costs = Costs(
        call_s=1.0,
        range_s=0.5,
        range_cpu_s=0.25,
        bytes_per_s=8000.0,
        copy_bytes_per_s=1e18,
        compute_per_layer_token_s=3.0,
        compute_per_layer_s=0.0,
    )
    # per layer, 1 lane: each read = 1 + 8 * 0.5 + 8 * 0.25 + 8000 / 8000 = 8 s; layer 0 computes 8..11,
    # layer 1 arrives at 16, computes 16..19
    assert simulate(LoadPlan(LAYERS, (1, 2), 1), shape, costs, num_tokens=1) == pytest.approx(19.0)
    # one group of both layers: 1 + 4 + 2 + 2 = 9 s, then two layers of compute
    assert simulate(LoadPlan(GROUPS, (2,), 1), shape, costs, num_tokens=1) == pytest.approx(15.0)
    # two lanes halve the per-lane range cost, and each pays the call: 2 + 4 * 0.5 + 8 * 0.25 + 1 = 7 s per layer
    assert simulate(LoadPlan(LAYERS, (1, 2), 2), shape, costs, num_tokens=1) == pytest.approx(17.0)


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


def _predict(costs: Costs, num_calls: int, ranges_per_call: int, nbytes: int) -> float:
    return (
        num_calls * costs.call_s
        + ranges_per_call * costs.range_s
        + num_calls * ranges_per_call * costs.range_cpu_s
        + nbytes / costs.bytes_per_s
    )


def test_estimates_converge_to_what_is_measured() -> None:
    """Calls of different shapes separate the per-range cost from the bandwidth: a host where
    each range costs 60 us however many lanes run and bytes move at 1 GB/s (measured in a vLLM
    engine here) is learned from per-layer reads (4 lanes of 32 ranges of 64 KiB) and staged
    group reads (64 ranges of 512 KiB), and both are then predicted within a few percent."""
    costs = MOONCAKE.snapshot()

    def truth(num_calls: int, ranges_per_call: int, nbytes: int) -> float:
        return num_calls * 200e-6 + num_calls * ranges_per_call * 60e-6 + nbytes / 1e9

    shapes = [(4, 32, 8 << 20), (1, 64, 32 << 20), (4, 16, 32 << 20), (1, 64, 8 << 20)]
    for _ in range(30):
        for shape in shapes:
            costs.observe_ranges(truth(*shape), *shape)
    fitted = costs.snapshot()
    for shape in shapes:
        assert _predict(fitted, *shape) == pytest.approx(truth(*shape), rel=0.05), shape
    assert fitted.bytes_per_s == pytest.approx(1e9, rel=0.15)


def test_one_stalled_call_barely_moves_the_estimates() -> None:
    costs = MOONCAKE.snapshot()
    for _ in range(10):
        costs.observe_ranges(_predict(MOONCAKE, 4, 32, 8 << 20), 4, 32, 8 << 20)
    before = costs.snapshot()
    costs.observe_ranges(5.0, 4, 32, 8 << 20)  # a 5 s stall (a master failover, a paused process)
    assert _predict(costs.snapshot(), 4, 32, 8 << 20) < 1.5 * _predict(before, 4, 32, 8 << 20)


def test_whole_object_and_copy_and_compute_estimates_follow_samples() -> None:
    costs = MOONCAKE.snapshot()
    for _ in range(30):
        costs.observe_whole(0.064, keys_per_call=16, nbytes=64 << 20)  # 1 GB/s
        costs.observe_copy(0.004, 8 << 20)  # 2 GB/s
    costs = costs.snapshot()
    predicted = costs.whole_call_s + 16 * costs.whole_key_s + (64 << 20) / costs.whole_bytes_per_s
    assert predicted == pytest.approx(0.064, rel=0.05)
    assert costs.copy_bytes_per_s == pytest.approx((8 << 20) / 0.004, rel=0.01)


def test_compute_is_a_fixed_part_plus_a_part_per_token() -> None:
    """Decode steps (1 token, 5 ms) between prefills (1,000 tokens, 80 ms): both are predicted,
    and a decode step no longer reads as 5 ms per token (which made the next prefill's compute
    look 60x too long)."""
    costs = MOONCAKE.snapshot()
    for _ in range(20):
        costs.observe_compute(0.005, num_layers=8, num_tokens=1)
        costs.observe_compute(0.080, num_layers=8, num_tokens=1000)
    costs = costs.snapshot()
    for tokens, seconds in ((1, 0.005), (1000, 0.080)):
        assert 8 * (costs.compute_per_layer_s + tokens * costs.compute_per_layer_token_s) == pytest.approx(
            seconds, rel=0.1
        )


# Costs fitted from a real vLLM CPU engine loading a 2,048-token prefix with 32 new tokens here
# (64 keys, 128 KiB per layer per block, ~60 us per range whatever the lanes, ~1 GB/s,
# ~5 ms of compute per layer): per-layer reads took ~130 ms, staged groups ~95 ms.
VLLM_CPU = Costs(
    call_s=200e-6,
    range_s=1e-6,
    range_cpu_s=60e-6,
    bytes_per_s=1e9,
    whole_call_s=1e-3,
    whole_key_s=50e-6,
    whole_bytes_per_s=0.8e9,
    copy_bytes_per_s=4e9,
    compute_per_layer_token_s=150e-6,
)


def test_where_ranges_cost_cpu_a_short_suffix_reads_groups_not_layers() -> None:
    plan = choose_plan(SHAPE, VLLM_CPU, num_tokens=32)
    assert plan.mode != LAYERS, plan
    assert simulate(plan, SHAPE, VLLM_CPU, 32) < 0.8 * simulate(
        LoadPlan(LAYERS, tuple(range(1, 9)), 4), SHAPE, VLLM_CPU, 32
    )


def test_a_plan_of_a_given_kind_is_that_kinds_best() -> None:
    kinds = plan_kinds(SHAPE, 4)
    assert kinds == ((LAYERS, 1), (GROUPS, 1), (WHOLE, 1), (LAYERS, 4), (GROUPS, 4), (WHOLE, 4))
    for mode, lanes in kinds:
        plan = choose_plan(SHAPE, VLLM_CPU, num_tokens=32, kind=(mode, lanes))
        assert (plan.mode, plan.lanes) == (mode, lanes)
        assert all(
            plan.predicted_s <= simulate(p, SHAPE, VLLM_CPU, 32) + 1e-12
            for p in candidates(SHAPE, 4)
            if (p.mode, p.lanes) == (mode, lanes)
        )
    device = StepShape(64, 8, 128 << 10, 192, 2, staging_ok=False)
    assert plan_kinds(device, 4) == ((LAYERS, 1), (LAYERS, 4))
    assert choose_plan(device, VLLM_CPU, 32, kind=(WHOLE, 4)).mode == LAYERS  # no staging: no other mode
    assert {p.lanes for p in candidates(SHAPE, 4, lanes=3)} == {3}  # transfer_lanes set


def test_lanes_that_do_not_overlap_are_not_used() -> None:
    """Where every range costs the same CPU time however many calls run at once (range_s ~ 0),
    more lanes buy nothing: one lane is chosen; where calls overlap, lanes are used."""
    assert choose_plan(SHAPE, VLLM_CPU, num_tokens=32).lanes == 1
    overlapping = VLLM_CPU.snapshot()
    overlapping.range_s, overlapping.range_cpu_s = 60e-6, 1e-6
    assert choose_plan(SHAPE, overlapping, num_tokens=32).lanes == 4


def test_exploration_tries_the_least_recently_used_plausible_kind_then_settles() -> None:
    """Every 4th plan while a plausible kind has < 2 samples, then every 16th: a short run pays
    for a few explorations only."""
    predicted = {(LAYERS, 1): 1.0, (GROUPS, 1): 1.2, (WHOLE, 4): 1.4, (GROUPS, 4): 2.0}  # (GROUPS, 4): > 1.5x
    exploring = Exploration(every=4, plausible=1.5, min_samples=2, sampled_every=16)
    tried = []
    for _ in range(50):
        kind = exploring.kind_to_try(predicted)
        tried.append(kind)
        exploring.used(kind or (LAYERS, 1))  # the free choice is always (LAYERS, 1) here
    turns = {n: kind for n, kind in enumerate(tried) if kind is not None}
    assert turns == {
        0: (LAYERS, 1),
        4: (GROUPS, 1),
        8: (WHOLE, 4),
        12: (GROUPS, 1),
        16: (WHOLE, 4),
        32: (GROUPS, 1),
        48: (WHOLE, 4),
    }
    assert Exploration(every=4).kind_to_try({(LAYERS, 1): 1.0}) is None  # nothing else to try
    assert all(Exploration(every=0).kind_to_try(predicted) is None for _ in range(10))


def test_the_worker_plan_is_the_fastest_kind_unless_exploring() -> None:
    best = best_of_kinds(SHAPE, VLLM_CPU, 32)
    assert tuple(best) == plan_kinds(SHAPE, 4)
    assert fastest(best.values()) == choose_plan(SHAPE, VLLM_CPU, 32)
    assert all(p.predicted_s == pytest.approx(simulate(p, SHAPE, VLLM_CPU, 32)) for p in best.values())


def test_a_kind_whose_reads_measure_slower_than_modelled_loses_its_place() -> None:
    """What the cost model leaves out (here: per-layer reads competing with compute for the
    cores) shows as loads of that kind reading their last layer later than modelled; their reads
    are then predicted that much longer and the planner prefers the next kind. Compute
    estimates do not enter the factor. One odd load moves it at most 4x, weighted."""
    costs = VLLM_CPU.snapshot()
    costs.range_s, costs.range_cpu_s, costs.copy_bytes_per_s = 0.0, 20e-6, 2e9  # per-layer reads look best
    first = choose_plan(SHAPE, costs, 32)
    assert first.mode == LAYERS
    for _ in range(10):
        for lanes in (1, 4):  # per-layer reads on any number of lanes
            plan = choose_plan(SHAPE, costs, 32, kind=(LAYERS, lanes))
            modelled = transfer_s(plan, SHAPE, costs)
            costs.observe_transfer((LAYERS, lanes), modelled, 1.4 * modelled)
    assert costs.kind_factor[(first.mode, first.lanes)] == pytest.approx(1.4, rel=0.1)
    slower = choose_plan(SHAPE, costs, 32, kind=(first.mode, first.lanes))
    assert transfer_s(slower, SHAPE, costs) == pytest.approx(transfer_s(first, SHAPE, costs))  # the model is unchanged
    assert slower.predicted_s > first.predicted_s + 0.3 * transfer_s(first, SHAPE, costs)  # its reads are 1.4x as long
    second = choose_plan(SHAPE, costs.snapshot(), 32)
    assert second.mode != LAYERS
    one = VLLM_CPU.snapshot()
    one.observe_transfer((LAYERS, 1), 0.1, 100.0)  # a stalled load
    assert one.kind_factor[(LAYERS, 1)] == pytest.approx(0.8 + 0.2 * 4)


def test_a_kind_whose_steps_finish_later_than_simulated_loses_its_place() -> None:
    """On a CPU host, reads beside the compute slow the compute, which neither the model nor the
    read factor sees: a kind's steps then compute their last layer later than simulated, and its
    predictions are scaled by that measured ratio. Its first step sets the factor (the prior is
    no measurement: a 4-request demo cannot wait for a weighted mean), at most 4x; a kind not yet
    measured whose reads also run beside the compute (layers, groups on other lanes) takes it
    too; whole-object reads (over before layer 0) keep 1."""
    costs = VLLM_CPU.snapshot()
    tokens = 32  # group reads look hidden behind this suffix's compute
    best = best_of_kinds(SHAPE, costs, tokens)
    first = fastest(best.values())
    assert first.mode == GROUPS
    costs.observe_finish((GROUPS, first.lanes), first.predicted_s, 1.8 * first.predicted_s)
    assert costs.finish_factor == {(GROUPS, first.lanes): pytest.approx(1.8)}
    assert costs.finish((GROUPS, 4 if first.lanes == 1 else 1)) == pytest.approx(1.8)  # the same mode, other lanes
    assert costs.finish((LAYERS, 1)) == costs.finish((LAYERS, 4)) == pytest.approx(1.8)  # reads beside compute too
    assert costs.finish((WHOLE, 1)) == costs.finish((WHOLE, 4)) == 1.0
    again = best_of_kinds(SHAPE, costs, tokens)
    assert all(again[k].predicted_s == pytest.approx(best[k].predicted_s * costs.finish(k)) for k in best)
    assert fastest(again.values()).mode == WHOLE
    costs.observe_finish((GROUPS, first.lanes), 1.0, 1.0)  # later steps are weighted
    assert costs.finish_factor[(GROUPS, first.lanes)] == pytest.approx(1.8 + 0.5 * (1.0 - 1.8))
    stalled = MOONCAKE.snapshot()
    stalled.observe_finish((WHOLE, 1), 0.01, 10.0)
    assert stalled.finish((WHOLE, 1)) == 4.0
    assert stalled.snapshot().finish_factor == stalled.finish_factor  # snapshots carry it


def test_the_planner_is_entered_by_choose_and_observe_only() -> None:
    """Planner: the fixed knobs give their plan; an auto plan is the simulated best; `observe`
    folds a step's calls into the fits, its compute only when no reads ran beside it, and an
    auto plan's reads and finish into its kind's factors."""
    from layerkv.config import PlanMode
    from layerkv.transfer.planner import Measured, Planner, StepTimes

    groups = Planner(PlanMode.GROUPS, SHAPE, prefetch_layers=3, group_ends=(1, 5, 8))
    assert groups.choose(64, 100) == (LoadPlan(GROUPS, (1, 5, 8), 1), 3)
    no_direct = Planner(PlanMode.LAYERS, dataclasses.replace(SHAPE, direct_ok=False), prefetch_layers=2)
    assert no_direct.choose(64, 100)[0].mode == GROUPS  # per layer, but through staging
    assert Planner(PlanMode.WHOLE, SHAPE).choose(64, 100) == (LoadPlan(WHOLE, (8,), 4), None)

    auto = Planner(PlanMode.AUTO, SHAPE, exploration=Exploration(every=0))
    plan, prefetch = auto.choose(64, 100)
    assert prefetch is None and plan.predicted_s > 0 and plan.kind in best_of_kinds(SHAPE, Costs(), 100)
    before = auto.costs.snapshot()
    measured = Measured(ranges=[(0.05, 1, 64, 64 * (128 << 10))], copies=[(0.01, 8 << 20)])
    auto.observe(
        StepTimes(
            100, step_s=0.2, wait_s=0.05, compute_alone=False, plan=plan, num_keys=64, transfer_s=0.1, measured=measured
        )
    )
    after = auto.costs.snapshot()
    assert after.bytes_per_s != before.bytes_per_s and after.copy_bytes_per_s != before.copy_bytes_per_s
    assert not auto.costs.measured("compute") and plan.kind in after.kind_factor  # reads beside: no compute sample
    assert after.finish_samples == {}  # compute not measured yet: no finish correction
    auto.observe(StepTimes(100, step_s=0.03, wait_s=0.0))  # a step without a load: compute alone
    assert auto.costs.measured("compute")
    auto.observe(StepTimes(100, step_s=0.2, wait_s=0.05, compute_alone=False, plan=plan, num_keys=64, transfer_s=0.1))
    assert auto.costs.snapshot().finish_samples == {plan.kind: 1}
