"""The chaos suite's cluster, per-trial checks and summary table."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from chaos_load import Outcome
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port


def chaos_config(model_dir, ray_dir: str, **overrides) -> ServeConfig:
    """2 prefill + 2 decode workers; every prompt handed off (so prefill faults bite);
    few sequences per worker (so requests queue: drains have something to move);
    a short lease (so only renewal keeps it alive while the decode node queues)."""
    base = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, block_size=16, max_num_seqs=8,
                grpc_port=free_port(), metrics_port=0, http_port=0, prefill_workers=2, decode_workers=2,
                transfer_backend="tcp", lease_ttl=2.0, transfer_timeout=5.0, max_migrations=2,
                max_queued_requests=512, request_timeout=300.0, ray_temp_dir=ray_dir,
                local_prefill_threshold=0, local_prefill_hit_ratio=1.0)
    base.update(overrides)
    return ServeConfig(**base)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (reaped, or a zombie / dead entry). A process that exits between
    the open and the read makes the read fail with ESRCH (ProcessLookupError): gone as well."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


class ChaosCluster(Cluster):
    async def on_loop(self, fn):
        """fn() on the frontend's loop (its state is not thread-safe), awaited from another loop."""
        async def call():
            return fn()
        return await asyncio.wrap_future(self.loop.submit(call()))

    def events(self) -> list[tuple[str, str]]:
        return self.loop.run(self.on_loop_sync(lambda: list(self.backend.journal.events)))

    async def on_loop_sync(self, fn):
        return fn()

    def explain(self, rid: str) -> str:
        """A request's trace (route, prefill worker and the blocks it handed off, decode
        worker and its blocks, migrations, moves, recomputes) and every prefill worker's
        lease counters."""
        events = self.loop.run(self.on_loop_sync(lambda: self.backend.request_events(rid)))
        return f"events {events}; leases {self.lease_counters()}"

    def pid(self, worker_id: str) -> int:
        return self.call(worker_id, "ready").pid

    def pool(self, name: str) -> list[str]:
        return sorted(w for w, r in self.backend.workers.items() if r.pool == name)

    @property
    def admission(self):
        return self.stack.runner.admission

    def counters(self) -> dict[str, int]:
        return dataclasses.asdict(self.backend.journal.counters)

    def lease_counters(self) -> dict[str, dict]:
        return {w: dataclasses.asdict(self.call(w, "lease_counters")) for w in self.pool("prefill")}

    def wait_alive(self, timeout: float = 180.0) -> None:
        """Every worker (restarted ones too) is up, reporting, and routable."""
        end = time.monotonic() + timeout
        while True:
            refs = self.backend.workers.values()
            view = self.backend.router.view
            routable = {v.worker_id for v in view.prefill + view.decode}
            if all(r.alive for r in refs) and routable == set(self.backend.workers):
                try:
                    for w in self.backend.workers:
                        self.call(w, "report")
                    return
                except Exception:
                    pass
            assert time.monotonic() < end, f"workers not back: {[(r.worker_id, r.alive) for r in refs]}"
            time.sleep(0.2)

    def settle(self, timeout: float = 120.0) -> int:
        """Wait until nothing is in flight anywhere; every worker passes
        check_integrity(). Returns the leaked blocks (0, or it fails)."""
        self.wait_alive()
        end = time.monotonic() + timeout
        while True:
            states = {w: self.call(w, "check_integrity") for w in self.backend.workers}   # raises if broken
            front = (len(self.backend.in_flight), self.admission.in_flight)
            busy = {w: s for w, s in states.items() if s.kv_blocks_used or s.running
                    or s.waiting or s.leases or s.held}
            if not busy and front == (0, 0):
                return 0
            if time.monotonic() > end:
                leaked = sum(s.kv_blocks_used for s in states.values())
                raise AssertionError(f"not idle after {timeout}s: workers {busy}, frontend in flight {front} "
                                     f"(admitted {sorted(self.admission._in_flight)}, backend "
                                     f"{sorted(self.backend.in_flight)}, cleanups pending "
                                     f"{len(self.stack.runner._cleanups)}), leaked blocks {leaked}")
            time.sleep(0.1)


def check_outcomes(outs: dict[str, Outcome], refs: dict[str, list[int]], allowed: set[str],
                   explain=None) -> Counter:
    """Every request ended: finished with exactly its reference tokens, or an allowed code.
    explain(rid) -> str adds what the cluster knows about a request that fails."""
    errors: Counter = Counter()
    for rid, o in outs.items():
        if o.finished:
            assert o.tokens == refs[rid], (
                f"{rid}: tokens differ from the undisturbed run:\ngot  {o.tokens}\nwant {refs[rid]}\n"
                + (refs.divergence(rid, o.tokens) + "\n" if hasattr(refs, "divergence") else "")
                + (f"cluster: {explain(rid)}" if explain else "cluster: nothing recorded"))
        else:
            assert o.code, f"{rid}: no terminal state"
            assert o.code in allowed, f"{rid}: {o.code} ({o.details}) is not an allowed outcome {allowed}"
            errors[o.code] += 1
    return errors


def check_leases(before: dict[str, dict], after: dict[str, dict], restarted: set[str] = frozenset()) -> dict:
    """Every lease pinned ended exactly once; none is left. Returns the summed deltas."""
    total: Counter = Counter()
    for w, a in after.items():
        assert a["active"] == 0, f"{w} still holds {a['active']} leases"
        assert a["pinned"] == a["expired"] + a["notified"] + a["released"], f"{w}: {a}"
        b = before.get(w) if w not in restarted else None
        for k in ("pinned", "expired", "notified", "released", "renewed"):
            total[k] += a[k] - (b[k] if b and a["pinned"] >= b["pinned"] else 0)
    return dict(total)


@dataclass
class Row:
    trials: int = 0
    requests: int = 0
    completed: int = 0
    migrated: int = 0
    moved: int = 0
    recomputed: int = 0
    errors: Counter = field(default_factory=Counter)
    leaked: int = 0
    notes: Counter = field(default_factory=Counter)


class ChaosReport:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def add(self, fault: str, outs: dict[str, Outcome], *, errors: Counter, leaked: int, migrated: int = 0,
            moved: int = 0, recomputed: int = 0, **notes: int) -> None:
        row = self.rows.setdefault(fault, Row())
        row.trials += 1
        row.requests += len(outs)
        row.completed += sum(o.finished for o in outs.values())
        row.migrated += migrated
        row.moved += moved
        row.recomputed += recomputed
        row.errors.update(errors)
        row.leaked += leaked
        row.notes.update({k: v for k, v in notes.items() if v})

    def table(self) -> str:
        head = ("fault", "trials", "requests", "completed", "migrated", "moved", "recomputed", "errors by code",
                "leaked blocks", "notes")
        lines = [head]
        for name, r in self.rows.items():
            errs = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "-"
            notes = ", ".join(f"{k} {v}" for k, v in sorted(r.notes.items())) or "-"
            lines.append((name, str(r.trials), str(r.requests), str(r.completed), str(r.migrated), str(r.moved),
                          str(r.recomputed), errs, str(r.leaked), notes))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"   # noqa: E731
        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([fmt(lines[0]), sep] + [fmt(line) for line in lines[1:]])


def trials(fast: int, full: int, full_run: bool) -> int:
    return full if full_run else int(os.environ.get("CHAOS_FAST_TRIALS", fast))
