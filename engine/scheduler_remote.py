"""The decode role's side of the scheduler: prompts whose KV another node
computed. Mixed into :class:`engine.scheduler.Scheduler` (uses its queues,
KV manager and config)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.request_queues import RequestQueues

if TYPE_CHECKING:
    from engine.block_manager import KVCacheManager


@dataclass(frozen=True)
class RemoteAllocation:
    """Blocks reserved on the decode node for a prompt computed elsewhere.
    The first ``num_cached_blocks`` already hold the prompt's KV locally; pull
    only ``blocks_to_pull`` (the prompt's remaining blocks, in order)."""
    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_cached_blocks: int

    @property
    def blocks_to_pull(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]


class RemoteKVMixin:
    # provided by Scheduler
    config: SchedulerConfig
    kv: KVCacheManager
    queues: RequestQueues
    running: list[Request]
    waiting: deque[Request]

    def _register(self, request: Request) -> None:
        raise NotImplementedError

    # ---- remote KV (decode role) ---------------------------------------------

    def add_remote_request(self, request: Request) -> RemoteAllocation | None:
        """Reserve blocks for a prompt whose KV another node computed. Local
        prefix hits are kept; the caller pulls only the rest. None (nothing
        changed) when the pool or ``max_num_seqs`` has no room."""
        self._register(request)
        computed = self.kv.get_computed_blocks(request, max_tokens=request.num_prompt_tokens)
        block_ids = None
        if len(self.running) + len(self.queues.remote) < self.config.max_num_seqs:
            block_ids = self.kv.allocate_slots(
                request, request.num_prompt_tokens - computed.num_computed_tokens, computed)
        if block_ids is None:
            self.queues.unregister(request.request_id)
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = computed.num_computed_tokens
        self.queues.remote[request.request_id] = request
        return RemoteAllocation(request.request_id, tuple(block_ids), computed.num_computed_tokens,
                                len(computed.blocks))

    def remote_kv_ready(self, request_id: str, first_token: int) -> None:
        """The prompt's KV has landed: cache its full blocks and decode on."""
        request = self._take_remote(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.append_output_token(first_token)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        self.queues.start_running(request)

    def remote_kv_failed(self, request_id: str) -> None:
        """The pull failed: free the blocks (pulled ones were never cached) and
        prefill locally, ahead of other waiting requests."""
        request = self._take_remote(request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _take_remote(self, request_id: str) -> Request:
        request = self.queues.remote.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        return request
