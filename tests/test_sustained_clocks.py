"""benchmarks/sustained_clocks.py on the CPU, with a fake timer and clock: each callable alone in turn, the idle
gap before every run, each run's summary and clock window, and bad arguments."""

import pytest
from benchmark_scripts import benchmark_module


class Fake:
    """A timer, sleep and clock in one: time advances by rep_ms per timed run and by each sleep."""

    def __init__(self, samples: dict):
        self.now, self.log, self.samples = 100.0, [], samples

    def timer(self, fn, rep_ms):
        self.log.append(("run", fn(), rep_ms))
        self.now += rep_ms / 1000
        return self.samples[fn()]

    def sleep(self, s):
        self.log.append(("sleep", s))
        self.now += s

    def clock(self):
        return self.now


def test_each_callable_runs_alone_in_turn_after_an_idle_gap():
    sc = benchmark_module("sustained_clocks")
    slow_then_capped = [10.0] * 20 + [12.0] * 30  # 50 calls: the last 20 slower
    fake = Fake({"ours": slow_then_capped, "flashmla": [8.0, 9.0, 7.0]})
    runs = sc.run_alone({"ours": lambda: "ours", "flashmla": lambda: "flashmla"}, seconds=2.0, repeats=2, gap_s=0.5,
                        timer=fake.timer, sleep=fake.sleep, clock=fake.clock)
    assert fake.log == [("sleep", 0.5), ("run", "ours", 2000), ("sleep", 0.5), ("run", "flashmla", 2000)] * 2
    assert [len(r) for r in runs.values()] == [2, 2]
    first = runs["ours"][0]
    assert (first["us_median"], first["us_first"], first["us_last"], first["calls"]) == (12.0, 10.0, 12.0, 50)
    assert runs["flashmla"][0]["us_first"] == runs["flashmla"][0]["us_last"] == 8.0  # fewer calls than FIRST_LAST
    assert first["window"] == [100.5, 102.5]  # after the gap, for the run's 2 s
    assert runs["ours"][1]["window"] == [105.5, 107.5]


@pytest.mark.parametrize("seconds, repeats, gap", [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_bad_arguments_raise(seconds, repeats, gap):
    sc = benchmark_module("sustained_clocks")
    with pytest.raises(ValueError, match="need seconds > 0"):
        sc.run_alone({}, seconds, repeats, gap, timer=None)
