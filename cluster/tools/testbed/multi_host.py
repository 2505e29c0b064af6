"""pdserve across test hosts (this package's `TestBed`): a Ray head with the frontend on h1,
Ray worker nodes carrying the pools' resources on the other hosts, as
docs/deploy.md describes for real machines."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from cluster.tools.testbed import TestBed, TestHost

ROOT = Path(__file__).resolve().parents[3]       # the repository: the hosts import this tree
BIN = Path(sys.executable).parent
RAY_PORT = 6379


def host_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UCX_"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_AUTO_CONNECT="0",
               PYTHONPATH=str(ROOT), **extra)
    return env


def ray_start(host: TestHost, *, head: TestHost | None = None, resources: dict | None = None,
              num_cpus: int = 2) -> None:
    argv = [str(BIN / "ray"), "start", "--node-ip-address", host.address, "--num-cpus", str(num_cpus),
            "--object-store-memory", str(150 * 2**20), "--disable-usage-stats"]
    if head is None:
        argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
    else:
        argv += ["--address", f"{head.address}:{RAY_PORT}"]
    if resources:
        argv += ["--resources", json.dumps(resources)]
    res = host.run(argv, timeout=180, env=host_env())
    if res.returncode != 0:
        raise RuntimeError(f"ray start on {host.name} failed: {res.stdout[-2000:]} {res.stderr[-2000:]}")


_ENDPOINT = re.compile(r"^\s+(gRPC|HTTP|metrics)\s+(\S+:\d+\S*)")


def read_endpoints(stream: IO[str], timeout: float) -> dict[str, str]:
    """The endpoints `pdserve serve` prints ("gRPC host:port", "HTTP url", "metrics url", metrics
    last), read from its stdout on a thread so that a serve that prints nothing, or stops printing,
    is given up on after `timeout` seconds instead of blocking the caller. Returns what was seen."""
    found: dict[str, str] = {}
    done = threading.Event()

    def read() -> None:
        for line in stream:
            if m := _ENDPOINT.search(line):
                found.setdefault(m.group(1), m.group(2))
                if m.group(1) == "metrics":
                    break
        done.set()

    threading.Thread(target=read, name="serve-stdout", daemon=True).start()
    done.wait(timeout)
    return dict(found)


class MultiHostServe:
    """`pdserve serve --address HEAD:6379` on h1 with prefill actors on the hosts given
    `pdserve_prefill` and decode actors on those given `pdserve_decode`."""

    def __init__(self, bed: TestBed, model_dir: Path, *, prefill_hosts=("h2",), decode_hosts=("h3",),
                 prefill_workers: int = 1, decode_workers: int = 1, slots_per_host: int = 1000, **serve) -> None:
        self.bed, self.head = bed, bed.host("h1")
        model = bed.shared_dir / ("model" + ("" if model_dir.is_dir() else model_dir.suffix))
        if not model.exists():   # (a tmp_path model is not visible in the hosts' private /tmp)
            (shutil.copytree if model_dir.is_dir() else shutil.copy2)(model_dir, model)
        ray_start(self.head, num_cpus=1)
        self.roles = {**{n: {"pdserve_prefill": slots_per_host} for n in prefill_hosts},
                      **{n: {"pdserve_decode": slots_per_host} for n in decode_hosts}}
        # the worker hosts join at once (each `ray start` is ~10 s of mostly waiting on 2 cores)
        with ThreadPoolExecutor(len(self.roles)) as pool:
            list(pool.map(lambda role: ray_start(bed.host(role[0]), head=self.head, resources=role[1]),
                          self.roles.items()))
        cfg = dict(model=str(model), address=f"{self.head.address}:{RAY_PORT}", host=self.head.address,
                   prefill_resource="pdserve_prefill", decode_resource="pdserve_decode",
                   prefill_workers=prefill_workers, decode_workers=decode_workers, num_kv_blocks=128,
                   max_model_len=512, max_num_seqs=8, metrics_port=0,
                   # the head host's own network namespace; both below its ephemeral range (32768-60999)
                   # and outside Ray's worker ports (10002-19999), so Ray's head, started first there,
                   # cannot have been handed either (50051 could, one start in ~2000)
                   grpc_port=9051, http_port=8000,
                   transfer_backend="tcp", local_prefill_threshold=0, local_prefill_hit_ratio=1.0,
                   log_level="INFO,pdserve.requests=DEBUG")
        cfg.update(serve)
        self.log_path = bed.shared_dir / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        conf = bed.shared_dir / "serve.json"
        conf.write_text(json.dumps(cfg))
        self.proc = self.head.popen([str(BIN / "pdserve"), "serve", "--config", str(conf)], env=host_env(),
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True)
        found = read_endpoints(self.proc.stdout, timeout=300)
        self.grpc_target, self.http_url = found.get("gRPC", ""), found.get("HTTP", "")
        self.metrics_url = found.get("metrics", "")
        if not self.metrics_url:
            code = self.proc.poll()
            self.stop(timeout=20)
            raise RuntimeError(f"pdserve serve printed no endpoints within 300 s (exit code {code}); "
                               f"its log:\n{self.log()[-4000:]}\n--- ray status ---\n{self._ray_status_or_why()}")

    def _ray_status_or_why(self) -> str:
        try:
            return self.ray_status()
        except (OSError, subprocess.SubprocessError) as e:
            return f"(ray status failed: {e})"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def workers(self) -> dict[str, dict]:
        """worker id -> what it said when ready (address, hostname, pid ...), from the log."""
        return {m.group(1): ast.literal_eval(m.group(2))
                for m in re.finditer(r"worker (\S+) ready: (\{.*\})", self.log())}

    def restart_host(self, name: str) -> None:
        """Boot a killed worker host again and rejoin it to Ray with its pool's resource:
        Ray then restarts the actors it lost there (max_restarts=-1)."""
        ray_start(self.bed.reboot(name), head=self.head, resources=self.roles[name])

    def worker_on(self, hostname: str) -> str:
        """The worker id whose latest incarnation runs on `hostname`."""
        return [w for w, i in self.workers().items() if i["hostname"] == hostname][-1]

    def wait_routable(self, worker_id: str, timeout: float = 180) -> None:
        """Until the frontend reports the worker again (its load reports reach the router)."""
        end = time.monotonic() + timeout
        while self.metric("pdserve_kv_blocks_capacity", worker=worker_id) is None:
            if time.monotonic() > end:
                raise AssertionError(f"{worker_id} is not back after {timeout}s: {self.log()[-3000:]}")
            time.sleep(0.5)

    def wait_idle(self, timeout: float = 90) -> None:
        """Until no lease is held and no live worker holds a KV block (what leaked, if not)."""
        end = time.monotonic() + timeout
        while True:
            held = {**self.metric_values("pdserve_leases_active"), **self.metric_values("pdserve_kv_blocks_used")}
            if not any(held.values()):
                return
            if time.monotonic() > end:
                raise AssertionError(f"not idle after {timeout}s: {held}")
            time.sleep(0.5)

    def metric_values(self, name: str) -> dict[str, float]:
        """worker -> value of a per-worker gauge."""
        return {f"{name}{{{s.labels.get('worker')}}}": s.value for s in self._samples() if s.name == name}

    def _samples(self):
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def trace(self, rid: str) -> list[str]:
        """The server's trace lines of request `rid` (route, prefill, join, migration)."""
        return [line.split(": ", 2)[-1] for line in self.log().splitlines()
                if "pdserve.requests" in line and f" {rid}:" in line]

    def metric(self, name: str, **labels: str) -> float | None:
        for s in self._samples():
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None

    def ray_status(self) -> str:
        return self.head.run([str(BIN / "ray"), "status", "--address", f"{self.head.address}:{RAY_PORT}"],
                             env=host_env(), timeout=60).stdout

    def ray_active_nodes(self) -> int:
        block = self.ray_status().split("Active:", 1)[-1].split("Pending:", 1)[0]
        return len(re.findall(r"node_", block))

    def diagnose(self, lines: int = 40) -> str:
        """For a failed check: the server's last log lines other than request traces, and Ray's view."""
        own = [line for line in self.log().splitlines() if "pdserve.requests" not in line]
        return "\n".join(own[-lines:]) + "\n--- ray status ---\n" + self.ray_status()

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.poll()
