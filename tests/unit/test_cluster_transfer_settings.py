"""What the launcher hands every worker for KV transfer: in a cluster of several
machines no host (each worker binds its own node's address, which is what lets
workers on other machines start), on a local cluster the configured address, and
the deployment's side-channel secret."""
from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from cluster.orchestration.launcher import cluster_secret, transfer_settings
from kvtransfer.settings import TransferSettings


def test_workers_bind_their_own_node_not_the_heads_host():
    s = transfer_settings(ServeConfig(host="10.1.2.3", address="10.1.2.3:6379", transfer_backend="tcp"))
    assert s.host == ""
    assert transfer_settings(ServeConfig(host="0.0.0.0")).host == ""       # every interface: the node's IP
    assert transfer_settings(ServeConfig()).host == "127.0.0.1"            # a local cluster on loopback
    assert s.on_node("10.9.9.9").host == "10.9.9.9"
    assert TransferSettings(host="127.0.0.1").on_node("10.9.9.9").host == "127.0.0.1"   # a set host stays
    with pytest.raises(ValueError, match=r"call on_node"):
        s.create("w")


def test_secret_is_random_per_deployment_or_read_from_a_file(tmp_path):
    a, b = cluster_secret(ServeConfig()), cluster_secret(ServeConfig())
    assert a != b and len(a) == 64
    f = tmp_path / "secret"
    f.write_text("0123456789abcdef0123\n")
    assert transfer_settings(ServeConfig(cluster_secret_file=str(f))).secret == "0123456789abcdef0123"
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        cluster_secret(ServeConfig(cluster_secret_file=str(f)))
    with pytest.raises(ValueError, match="cannot be read"):
        cluster_secret(ServeConfig(cluster_secret_file=str(tmp_path / "missing")))
