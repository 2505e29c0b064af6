"""One scheduler step driven by hand: every sampled sequence gets token 7, a request that has its
max_tokens is finished, integrity is checked; returns the step's (request id, tokens) in order."""
from __future__ import annotations

from engine.request import RequestStatus
from engine.scheduler import Scheduler


def step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    s.check_integrity()
    return [(q.request.request_id, q.num_new_tokens) for q in out.seqs]
