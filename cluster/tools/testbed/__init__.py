"""Test hosts from Linux namespaces: separate machines, as far as UCX and Ray can
tell, on one box (docs/deploy.md "A multi-node session on one machine")."""
from cluster.tools.testbed.bed import TestBed, sweep_stale
from cluster.tools.testbed.host import TestHost

__all__ = ["TestBed", "TestHost", "sweep_stale"]
