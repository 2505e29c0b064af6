"""The multi-host serve the e2e and chaos tests drive: it lives in cluster/tools/testbed/multi_host.py
(benchmarks use it too)."""
from cluster.tools.testbed.multi_host import RAY_PORT, MultiHostServe, host_env, ray_start

__all__ = ["MultiHostServe", "RAY_PORT", "host_env", "ray_start"]
