"""benches/routing_model.py, the offline model of the routing-quality trace lane: its timing
matches engine-sim's reference tables, and its engines and policies do what they claim on
traces small enough to work out by hand."""

import importlib.util
import pathlib
import random

import pytest

SPEC = importlib.util.spec_from_file_location(
    "routing_model",
    pathlib.Path(__file__).resolve().parents[2] / "benches" / "routing_model.py",
)
model = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(model)


def test_timing_matches_engine_sims_reference_tables():
    # engine-sim/src/timing.rs's tests: prefill 8,192 tokens 169.14 ms, decode at half usage
    # 26.31 ms.
    assert model.prefill_ms(8192) == pytest.approx(169.14, abs=0.006)
    assert model.prefill_ms(0) == 0.0
    assert model.decode_ms(0.5) == pytest.approx(26.31, abs=0.006)
    time, iterations = model.chunked_ms(10_000)
    assert iterations == 2
    assert time == pytest.approx(model.prefill_ms(8192) + model.prefill_ms(1808))


def request(arrival, blocks, osl=1):
    return model.Request(arrival, blocks * model.BLOCK, osl, list(range(blocks)))


def test_one_request_on_an_idle_engine_takes_its_chunked_prefill():
    r = request(0.0, 20)  # 10,240 tokens: two iterations
    model.replay(model.RoundRobin(), [r], engines=2)
    # As engine-sim times them: each iteration with work adds a decode step at the KV usage
    # when it was planned (none before the first, the first chunk's 16 blocks before the
    # second).
    first = model.prefill_ms(8192) + model.decode_ms(0.0)
    second = model.prefill_ms(2048) + model.decode_ms(16 / model.CAPACITY)
    assert r.first == pytest.approx(first + second)
    assert r.hit == 0


@pytest.mark.parametrize(
    "policy, same_engine, hit_blocks",
    [(model.RoundRobin(), False, 0), (model.CacheAware(), True, 20), (model.KvCost(), True, 20)],
)
def test_a_later_turn_finds_its_prefix_where_the_policy_sent_it(policy, same_engine, hit_blocks):
    random.seed(1)
    first = request(0.0, 20)
    # The next turn extends the same conversation by one block once the first has finished:
    # all 20 blocks of the first turn are there to hit where it ran.
    later = model.Request(10_000.0, 21 * model.BLOCK, 1, list(range(21)))
    engines = model.replay(policy, [first, later], engines=4)
    assert (later.engine == first.engine) is same_engine
    assert later.hit == hit_blocks * model.BLOCK
    assert sum(e.hit_tokens for e in engines) == hit_blocks * model.BLOCK


def test_a_request_waits_behind_the_prefill_queued_ahead_of_it():
    big = request(0.0, 40)  # 20,480 tokens: three iterations, FCFS ahead of the small one
    small = model.Request(1.0, 100, 1, [1000])
    engines = model.replay(model.RoundRobin(), [big, small], engines=1)
    assert engines[0].query_tokens == 40 * model.BLOCK + 100
    assert small.first >= big.first
    # kvmesh's cost sees that queue and sends the small request to the idle engine.
    random.seed(1)
    big, small = request(0.0, 40), model.Request(1.0, 100, 1, [1000])
    model.replay(model.KvCost(), [big, small], engines=2)
    assert small.engine != big.engine
    assert small.first - small.arrival == pytest.approx(
        model.prefill_ms(100) + model.decode_ms(0.0)
    )
