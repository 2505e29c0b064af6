"""benchmarks/process_cpu.py: CPU seconds per named process, the driver and the rest, from /proc."""
from __future__ import annotations

import os
import subprocess
import sys

from bench_scripts import load_bench_script

# burns `argv[1]` seconds of its own CPU (process_time: what /proc counts), says so, then idles until stdin closes
BURN = ("import sys, time\n"
        "t = float(sys.argv[1])\n"
        "while time.process_time() < t: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n")


def _module():
    return load_bench_script("process_cpu")


def _burner(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURN, str(seconds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_cpu_of_a_named_worker_and_of_the_other_children_is_counted_apart():
    pc = _module()
    named, other = _burner(0.4), _burner(0.25)
    try:
        assert {named.pid, other.pid} <= set(pc.descendants(os.getpid()))
        before = pc.snapshot({"w": named.pid})
        burnt_named, burnt_other = float(named.stdout.readline()), float(other.stdout.readline())
        after = pc.snapshot({"w": named.pid})
    finally:
        for p in (named, other):
            p.stdin.close()
            p.wait(timeout=30)
    split = pc.cpu_split(before, after)
    # the window holds the named child's CPU from the first snapshot to its report (/proc
    # counts what process_time does, in clock ticks), and none of the other child's
    assert abs(split["workers_s"]["w"] - (burnt_named - before.named["w"])) <= 0.03
    # one thread did it all: equal to within a clock tick (the kernel splits a task's runtime into
    # user and system ticks for the thread and for its process separately, each rounded)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert abs(split["workers_busiest_thread_s"]["w"] - split["workers_s"]["w"]) <= tick + 1e-9
    assert split["ray_and_other_s"] <= burnt_other + 0.02 + 0.05              # + this test's own probes
    assert split["total_s"] >= split["workers_s"]["w"] + split["driver_s"]


def test_host_busy_is_counted_over_the_window():
    pc = _module()
    before = pc.snapshot({})
    burner = _burner(0.2)
    float(burner.stdout.readline())
    after = pc.snapshot({})
    burner.stdin.close()
    burner.wait(timeout=30)
    split = pc.cpu_split(before, after)
    assert split["ray_and_other_s"] >= 0.2 - 0.02          # the child started and burnt inside the window
    assert split["host_cores_busy"] * split["wall_s"] >= split["ray_and_other_s"] - 0.05
