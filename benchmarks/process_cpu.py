"""Where a benchmark's CPU goes: CPU seconds (user + system, from /proc) of each
process of the run, taken before and after a measured window.

The run's processes are this one (the driver: frontend, gRPC server, router and
load generator share it), the worker actors (named by their pids) and every
other process below this one (Ray's GCS, raylet, dashboard and idle workers).
A process that exits inside the window loses its CPU from the count, so take
both snapshots while the same cluster is up.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """Every live process below `root` (from /proc): a run pins or counts only its own processes."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        at = todo.pop()
        kids = [pid for pid, pp in parent.items() if pp == at]
        out += kids
        todo += kids
    return out


def _stat_cpu_s(path: str) -> float:
    """utime + stime of one /proc/<pid>[/task/<tid>]/stat, in seconds (0 if it is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each of the process's threads so far, by thread id."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    return {int(t): _stat_cpu_s(f"/proc/{pid}/task/{t}/stat") for t in tids}


@dataclass(frozen=True)
class CpuSnapshot:
    at_s: float                          # os.times().elapsed when taken
    named: dict[str, float]              # worker id -> its process's CPU seconds
    named_threads: dict[str, dict[int, float]]   # worker id -> its threads' CPU seconds
    driver_s: float
    other_s: dict[int, float]            # every other process below this one, by pid
    host_busy_s: float                   # the whole host's busy CPU seconds (/proc/stat)


def snapshot(worker_pids: dict[str, int]) -> CpuSnapshot:
    me, known = os.getpid(), set(worker_pids.values())
    others = [p for p in descendants(me) if p not in known]
    return CpuSnapshot(os.times().elapsed,
                       {w: _stat_cpu_s(f"/proc/{p}/stat") for w, p in worker_pids.items()},
                       {w: thread_cpu_s(p) for w, p in worker_pids.items()},
                       _stat_cpu_s(f"/proc/{me}/stat"),
                       {p: _stat_cpu_s(f"/proc/{p}/stat") for p in others}, _host_busy_s())


def _host_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _TICKS     # all but idle and iowait


def cpu_split(before: CpuSnapshot, after: CpuSnapshot) -> dict:
    """CPU seconds spent in the window per worker process (and its busiest thread), by
    the driver and by the rest of the run's processes; wall seconds, and the cores the
    run kept busy beside those the whole host did (other sessions' jobs included)."""
    wall = after.at_s - before.at_s
    workers = {w: round(after.named[w] - before.named.get(w, 0.0), 2) for w in sorted(after.named)}
    busiest = {w: round(max((s - before.named_threads.get(w, {}).get(t, 0.0) for t, s in th.items()),
                            default=0.0), 2) for w, th in sorted(after.named_threads.items())}
    other = sum(s - before.other_s.get(p, 0.0) for p, s in after.other_s.items())
    total = sum(workers.values()) + (after.driver_s - before.driver_s) + other
    return {"wall_s": round(wall, 2), "workers_s": workers, "workers_busiest_thread_s": busiest,
            "driver_s": round(after.driver_s - before.driver_s, 2), "ray_and_other_s": round(other, 2),
            "total_s": round(total, 1), "cores_busy": round(total / wall, 2) if wall > 0 else None,
            "host_cores_busy": round((after.host_busy_s - before.host_busy_s) / wall, 2) if wall > 0 else None}
