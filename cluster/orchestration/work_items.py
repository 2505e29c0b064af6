"""A frontend's GenerateJob as the workers take it (worker_api.messages.WorkItem)."""
from __future__ import annotations

from cluster.orchestration.backend import GenerateJob
from worker_api.messages import WorkItem


def work_item(job: GenerateJob, request_id: str | None = None) -> WorkItem:
    """The job's prompt, sampling and salt under `request_id` (default: the job's own id)."""
    return WorkItem(request_id=request_id or job.request_id, prompt_token_ids=tuple(job.prompt_token_ids),
                    sampling=job.sampling, cache_salt=job.cache_salt)
