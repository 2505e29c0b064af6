"""Chaos suite fixtures: one real local Ray cluster (2 prefill + 2 decode
workers, tcp KV transfer, real gRPC) shared by the fault tests, and a
session report printed as a table at the end.

Fast subset: `pytest tests/chaos -m "not chaos_full"` (part of `make test`);
full counts: `make chaos` (`-m chaos_full`).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # local test clusters on loopback only

from chaos_lib import ChaosReport, ChaosCluster, chaos_config  # noqa: E402

_REPORT = ChaosReport()


@pytest.fixture(scope="session")
def chaos_report() -> ChaosReport:
    return _REPORT


_CLUSTER: dict = {}


@pytest.fixture
def chaos_cluster(tiny_llama_dir, tmp_path_factory):
    """One cluster for all chaos tests, started on first use and shut down after the
    last chaos test (pytest_runtest_teardown): Ray is process-global, and the e2e
    tests that may follow in the same session start their own."""
    if "c" not in _CLUSTER:
        import torch

        torch.set_num_threads(1)
        _CLUSTER["c"] = ChaosCluster(chaos_config(tiny_llama_dir, str(tmp_path_factory.mktemp("ray"))))
    return _CLUSTER["c"]


def pytest_runtest_teardown(item, nextitem):
    here = os.path.dirname(__file__)
    if "c" in _CLUSTER and (nextitem is None or not str(nextitem.path).startswith(here)):
        try:
            _CLUSTER.pop("c").close()
        except Exception as e:   # a broken cluster must not hide the test results
            print(f"chaos cluster shutdown: {type(e).__name__}: {e}")


@pytest.fixture(scope="session")
def hf_model(tiny_llama_dir):
    import torch

    from tiny_models import load_hf_model

    torch.set_num_threads(1)
    return load_hf_model(tiny_llama_dir)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _REPORT.rows:
        return
    table = _REPORT.table()
    terminalreporter.write_sep("=", "chaos suite summary")
    terminalreporter.write_line(table)
    path = os.environ.get("CHAOS_SUMMARY_FILE")
    if path:
        with open(path, "w") as f:
            f.write(table + "\n")
