"""Block-table-aware KV transfer: layout -> descriptors -> backend (nixl / ucxx / tcp).

Knows memory regions, block ids and byte sizes, never models. See docs/kvtransfer.md.
"""
from kvtransfer.descriptors import Descriptor, build_descriptors
from kvtransfer.engine import Notification, PeerInfo, TransferEngine, TransferHandle, TransferStatus
from kvtransfer.layout import KVPoolLayout
from kvtransfer.leases import Lease, LeaseTable, ReleaseCause
from kvtransfer.registry import available_backends, create_engine

__all__ = ["Descriptor", "build_descriptors", "Notification", "PeerInfo", "TransferEngine",
           "TransferHandle", "TransferStatus", "KVPoolLayout", "Lease", "LeaseTable", "ReleaseCause",
           "available_backends", "create_engine"]
