"""cluster/tools/sim/samples.py: the best fixed split by mean over samples, the autoscaled arm's paired
difference against it, and the held-out check (the split chosen on alternate samples, judged on the rest)."""
from __future__ import annotations

import pytest

from cluster.tools.sim.samples import summarize_samples


def _rows(goods: dict[str, list[int]], hours: dict[str, float]) -> list[dict]:
    return [{"split": "80:20" if arm == "autoscaled" else arm, "autoscale": arm == "autoscaled", "sample": k,
             "good": g, "worker_hours": hours[arm], "start_split": "80:20"}
            for arm, gs in goods.items() for k, g in enumerate(gs)]


def test_best_by_mean_paired_difference_and_held_out_choice():
    # "a" wins the even samples big, "b" the odd ones: "a" is best by mean, but chosen on the odd
    # samples "b" is, and judged on the even ones it serves none
    rows = _rows({"a": [10, 0, 10, 0], "b": [0, 5, 0, 5], "autoscaled": [6, 6, 6, 6]},
                 {"a": 1.0, "b": 1.0, "autoscaled": 0.9})
    s = summarize_samples(rows)
    assert s["samples"] == [0, 1, 2, 3] and s["best_fixed_by_mean"] == "a"
    assert s["arms"]["a"]["good"] == {"mean": 5, "sd": 5.8, "se": 2.9, "n": 4}
    d = s["autoscaled_minus_best"]
    assert d["per_sample"] == {"0": -4, "1": 6, "2": -4, "3": 6} and d["samples_autoscaled_ge"] == 2
    assert d["good"]["mean"] == 1 and d["worker_hours"]["mean"] == -0.1 and s["goal_met_by_mean"]
    assert s["per_sample_best"] == {"0": {"split": "a", "good": 10}, "1": {"split": "b", "good": 5},
                                    "2": {"split": "a", "good": 10}, "3": {"split": "b", "good": 5}}
    h = s["held_out"]
    assert [(f["chosen_on"], f["split"], f["judged_on"]) for f in h["folds"]] == [([0, 2], "a", [1, 3]),
                                                                                 ([1, 3], "b", [0, 2])]
    assert h["diff_good"]["mean"] == 6 and h["samples_autoscaled_ge"] == 4 and h["goal_met"]


def test_fewer_good_or_more_worker_hours_by_mean_is_not_the_goal():
    rows = _rows({"a": [10, 12], "autoscaled": [11, 10]}, {"a": 1.0, "autoscaled": 0.9})
    assert not summarize_samples(rows)["goal_met_by_mean"]                  # 10.5 < 11
    rows = _rows({"a": [10, 12], "autoscaled": [11, 11]}, {"a": 1.0, "autoscaled": 1.1})
    s = summarize_samples(rows)
    assert s["autoscaled_minus_best"]["good"]["mean"] == 0 and not s["goal_met_by_mean"]


def test_every_arm_must_run_on_the_same_samples():
    rows = _rows({"a": [10, 12], "autoscaled": [11, 11]}, {"a": 1.0, "autoscaled": 0.9})
    with pytest.raises(ValueError, match="same samples"):
        summarize_samples(rows[1:])
    with pytest.raises(ValueError, match="disjoint samples"):
        summarize_samples(rows + rows[:1])
