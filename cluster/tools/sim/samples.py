"""One fleet's comparison over several samples (benchmarks/autoscale_sim.py ``--samples``).

Every arm (each fixed split, and the autoscaled run) runs on every sample. Per arm: the mean and
sample sd of good requests and worker-hours. The best fixed split is the one with the most good
requests BY MEAN (ties to fewer mean worker-hours): one split for all samples, as an operator
would have to fix it, not each sample's own best (the best of one sample is partly the maximum of
the scatter between neighbouring splits: ``per_sample_best`` shows how far above the mean it
reads). Against it: the paired per-sample difference autoscaled - best fixed, and a held-out
check: the samples in two halves (alternate samples in sorted order), the best split chosen on one
half judged on the other, both ways, so every sample's difference is against a split chosen
without it.
"""
from __future__ import annotations

import math
from statistics import mean, stdev
from typing import Iterable, Mapping, Sequence

AUTOSCALED = "autoscaled"


def stat(xs: Sequence[float], digits: int = 1) -> dict:
    """Mean, sample sd (0 for one value), standard error of the mean, n."""
    if not xs:
        raise ValueError("stat() needs at least one value: run at least one sample")
    sd = stdev(xs) if len(xs) > 1 else 0.0
    return {"mean": round(mean(xs), digits), "sd": round(sd, digits),
            "se": round(sd / math.sqrt(len(xs)), digits), "n": len(xs)}


def arms(rows: Iterable[Mapping]) -> dict[str, dict[int, Mapping]]:
    """Runs by arm (the fixed split's label, or ``autoscaled``) and sample; every arm must have
    run on the same samples."""
    out: dict[str, dict[int, Mapping]] = {}
    for r in rows:
        arm = AUTOSCALED if r["autoscale"] else r["split"]
        if r["sample"] in out.setdefault(arm, {}):
            raise ValueError(f"two runs of {arm} on sample {r['sample']}: merge outputs of disjoint samples")
        out[arm][r["sample"]] = r
    samples = {frozenset(v) for v in out.values()}
    if len(samples) != 1 or AUTOSCALED not in out:
        raise ValueError("every arm (each fixed split and the autoscaled run) must run on the same samples: "
                         f"got {({k: sorted(v) for k, v in out.items()})}")
    return out


def best_by_mean(fixed: Mapping[str, Mapping[int, Mapping]], samples: Sequence[int]) -> str:
    """The fixed split with the most mean good requests over ``samples``, ties to fewer worker-hours."""
    return max(fixed, key=lambda a: (mean(fixed[a][s]["good"] for s in samples),
                                     -mean(fixed[a][s]["worker_hours"] for s in samples)))


def paired(auto: Mapping[int, Mapping], against: Mapping[int, Mapping], samples: Sequence[int]) -> dict:
    """Autoscaled - ``against`` per sample: good requests and worker-hours, and on how many samples
    the autoscaled arm served at least as many good requests."""
    good = [auto[s]["good"] - against[s]["good"] for s in samples]
    hours = [auto[s]["worker_hours"] - against[s]["worker_hours"] for s in samples]
    return {"good": stat(good), "worker_hours": stat(hours, 3), "per_sample": dict(zip(map(str, samples), good)),
            "samples_autoscaled_ge": sum(g >= 0 for g in good)}


def held_out(by_arm: Mapping[str, Mapping[int, Mapping]], samples: Sequence[int]) -> dict:
    """The best fixed split chosen on alternate samples, judged on the others, both ways."""
    fixed = {a: v for a, v in by_arm.items() if a != AUTOSCALED}
    halves = (list(samples[0::2]), list(samples[1::2]))
    folds, good, hours = [], [], []
    for chosen_on, judged_on in (halves, halves[::-1]):
        split = best_by_mean(fixed, chosen_on)
        d = paired(by_arm[AUTOSCALED], fixed[split], judged_on)
        folds.append({"chosen_on": chosen_on, "split": split, "judged_on": judged_on,
                      "fixed_good": stat([fixed[split][s]["good"] for s in judged_on]),
                      "autoscaled_good": stat([by_arm[AUTOSCALED][s]["good"] for s in judged_on]),
                      "diff_good": d["good"]})
        good += list(d["per_sample"].values())
        hours += [by_arm[AUTOSCALED][s]["worker_hours"] - fixed[split][s]["worker_hours"] for s in judged_on]
    return {"folds": folds, "diff_good": stat(good), "diff_worker_hours": stat(hours, 3),
            "samples_autoscaled_ge": sum(g >= 0 for g in good),
            "goal_met": mean(good) >= 0 and mean(hours) < 0}


def summarize_samples(rows: Iterable[Mapping]) -> dict:
    """The multi-sample summary of one fleet (see the module's docstring); the held-out check
    needs at least two samples."""
    by_arm = arms(rows)
    samples = sorted(by_arm[AUTOSCALED])
    fixed = {a: v for a, v in by_arm.items() if a != AUTOSCALED}
    per_arm = {a: {"good": stat([v[s]["good"] for s in samples]),
                   "worker_hours": stat([v[s]["worker_hours"] for s in samples], 3),
                   "good_per_sample": [v[s]["good"] for s in samples]} for a, v in by_arm.items()}
    out: dict = {"samples": samples, "arms": per_arm,
                 "autoscaled_start_splits": [by_arm[AUTOSCALED][s]["start_split"] for s in samples]}
    if not fixed:
        return out
    best = best_by_mean(fixed, samples)
    diff = paired(by_arm[AUTOSCALED], fixed[best], samples)
    own_best = {str(s): max(fixed, key=lambda a: (fixed[a][s]["good"], -fixed[a][s]["worker_hours"]))
                for s in samples}
    out.update(best_fixed_by_mean=best, autoscaled_minus_best=diff,
               per_sample_best={s: {"split": a, "good": fixed[a][int(s)]["good"]} for s, a in own_best.items()},
               goal_met_by_mean=(mean(diff["per_sample"].values()) >= 0
                                 and mean(by_arm[AUTOSCALED][s]["worker_hours"] - fixed[best][s]["worker_hours"]
                                          for s in samples) < 0))
    if len(samples) >= 2:
        out["held_out"] = held_out(by_arm, samples)
    return out
