"""bench.job_floor: untimed warm-up runs over every tar, then floor and job alternate (floor, job, floor,
... floor), each round's job runs bracketed
by two floor measurements whose mean is its floor, the job's small and large runs alternating their
order, and the figure is the median of the rounds' own ratios with their spread (no Ray: the pool and
the job are scripted)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench import job_floor
from preprocess.config import JobConfig


@dataclass
class _Report:
    samples_written: int
    inputs_per_node: dict[str, int] = field(default_factory=lambda: {"node": 1})


class _ScriptedPool:
    def __init__(self, rates: list[float], calls: list[str]) -> None:
        self.rates, self.calls = list(rates), calls

    def rounds(self, names: list[str], rounds: int) -> None:
        self.calls.append("warm floor")

    def rate(self, name: str) -> float:
        self.calls.append(name)
        return self.rates.pop(0)


def test_rounds_interleave_and_ratios_are_per_round(monkeypatch, tmp_path):
    calls: list[str] = []
    # Job seconds per run: small 400 images, large 1200; the marginal rate is 800 / (large - small).
    durations = iter([9.0, 9.0,  # warm-up runs (job_floor.WARMUP_RUNS, over every tar)
                      2.0, 6.0,  # round 1, small then large: 200 img/s
                      4.0, 2.0,  # round 2, large then small: 400 img/s
                      2.0, 7.0])  # round 3, small then large: 160 img/s

    def scripted_run(tars, output, cfg, workers=None):
        calls.append(f"job {len(tars)}")
        return next(durations), _Report(200 * len(tars))

    monkeypatch.setattr(job_floor, "_run", scripted_run)
    # Round floors: (200 + 300) / 2 = 250, (300 + 500) / 2 = 400, (500 + 300) / 2 = 400.
    pool = _ScriptedPool([200.0, 300.0, 500.0, 300.0], calls)
    result = job_floor.job_floor_rounds(pool, ["a", "b"], ["a", "b", "c", "d", "e", "f"], str(tmp_path),
                                        JobConfig(), rounds=3, log=lambda _: None)
    assert job_floor.WARMUP_RUNS == 2
    assert calls == (["warm floor", "job 6", "job 6", "floor"] + ["job 2", "job 6", "floor"]
                     + ["job 6", "job 2", "floor"] + ["job 2", "job 6", "floor"])
    assert [r["ratio"] for r in result["rounds"]] == [0.8, 1.0, 0.4]
    assert [(r["floor_before_images_per_s"], r["floor_after_images_per_s"]) for r in result["rounds"]] == [
        (200.0, 300.0), (300.0, 500.0), (500.0, 300.0)]
    assert result["ratio_median"] == 0.8 and (result["ratio_min"], result["ratio_max"]) == (0.4, 1.0)
    assert result["marginal_images_per_s"] == 200.0 and result["floor_images_per_s"] == 400.0
    assert result["small_images"] == 400 and result["large_images"] == 1200


def test_a_round_with_no_marginal_time_is_kept_but_not_counted(monkeypatch, tmp_path):
    durations = iter([1.0, 1.0, 2.0, 4.0, 3.0, 3.0])  # 2 warm-ups; round 1: 200 img/s; round 2: large == small
    monkeypatch.setattr(job_floor, "_run", lambda tars, *a, **k: (next(durations), _Report(200 * len(tars))))
    result = job_floor.job_floor_rounds(_ScriptedPool([250.0, 250.0, 250.0], []), ["a"], ["a", "b", "c"],
                                        str(tmp_path), JobConfig(), rounds=2, log=lambda _: None)
    assert len(result["rounds"]) == 2 and result["rounds"][1]["ratio"] != result["rounds"][1]["ratio"]
    assert result["ratio_median"] == result["ratio_min"] == result["ratio_max"] == 0.8
    assert result["marginal_images_per_s"] == 200.0
