import pickle

import pytest
import torch

from kvtransfer import ucx_env
from kvtransfer.engine import PeerInfo
from kvtransfer.layout import KVPoolLayout
from kvtransfer.registry import available_backends, create_engine


def test_layout_from_engine_shaped_pool():
    pool = torch.zeros(8, 30, 2, 3, 16, 64)  # [blocks, layers, 2, kv_heads, block, head_dim]
    layout = KVPoolLayout.from_tensor(pool)
    assert layout.bytes_per_block == 737280 and layout.num_blocks == 8
    assert layout.mem_type == "DRAM" and layout.base_addr == pool.data_ptr()
    assert layout.block_addr(2) == pool[2].data_ptr()
    assert layout.whole_blocks


def test_layout_rejects_views_and_bad_slices():
    with pytest.raises(ValueError, match="contiguous"):
        KVPoolLayout.from_tensor(torch.zeros(4, 8).t())
    with pytest.raises(ValueError, match="inside a block"):
        KVPoolLayout.from_tensor(torch.zeros(4, 8), slice_offset=16, slice_bytes=32)


def test_peer_info_pickles():
    info = PeerInfo("tcp", "p0", KVPoolLayout(4096, 2, 64), host="127.0.0.1", port=5, metadata=b"x")
    assert pickle.loads(pickle.dumps(info)) == info


def test_registry():
    assert "tcp" in available_backends()
    with pytest.raises(ValueError, match="choose one of"):
        create_engine("rdma-magic", "x")
    eng = create_engine("tcp", "t")
    with pytest.raises(ValueError, match="register_pool"):
        eng.peer_info()
    eng.close()


def test_tcp_refuses_wildcard_bind():
    from kvtransfer.tcp_backend import TcpConfig
    with pytest.raises(ValueError, match="not a wildcard"):
        TcpConfig(host="0.0.0.0")


def test_ucx_defaults_never_override_user_env():
    env = {"UCX_TLS": "tcp"}
    applied = ucx_env.apply_defaults(ucx_env.ucx_defaults("127.0.0.1", env), env)
    assert env["UCX_TLS"] == "tcp" and applied == {"UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "512k",
                                                   "UCX_TCP_RX_SEG_SIZE": "512k"}
    assert "UCX_NET_DEVICES" not in ucx_env.ucx_defaults("10.0.0.5")


def test_ucx_tcp_segment_sizes_follow_the_users_choice():
    """UCX's tcp segments are 512k unless the user set one of the two sizes; then both take
    that value (a receive segment smaller than a peer's send segment cannot take it)."""
    env = {"UCX_TCP_TX_SEG_SIZE": "1m"}
    ucx_env.apply_defaults(ucx_env.ucx_defaults("127.0.0.1", env), env)
    assert env["UCX_TCP_RX_SEG_SIZE"] == env["UCX_TCP_TX_SEG_SIZE"] == "1m"
    env = {"UCX_TCP_RX_SEG_SIZE": "64k"}
    ucx_env.apply_defaults(ucx_env.ucx_defaults("127.0.0.1", env), env)
    assert env["UCX_TCP_TX_SEG_SIZE"] == "64k"


@pytest.mark.parametrize("tls,sm_only", [("sm,self", True), ("cma,posix", True), ("cma,tcp,self", False),
                                         ("", False), ("^ib", False), ("rc,sm", False)])
def test_shared_memory_only_detection(tls, sm_only):
    assert ucx_env.shared_memory_only(tls) is sm_only


def test_nixl_config_refuses_busy_spin():
    pytest.importorskip("nixl")
    from kvtransfer.nixl_backend import NixlConfig
    with pytest.raises(ValueError, match="busy-spins"):
        NixlConfig(progress_thread=True, progress_delay_us=0)
