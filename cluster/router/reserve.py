"""When a hand-off's decode KV blocks are reserved as it is routed (`reserve_decode_blocks`): the
one rule the live cluster (cluster/orchestration/handoff.py) and the simulator
(cluster/tools/sim/cluster_sim.py) both apply.

A reservation pays off when its prefill starts soon: the join after the prefill then pulls at
once. Reserved for a prompt queued behind a prefill backlog, the blocks sit idle for as many
prefill steps as the backlog is long, while hand-offs whose prefill did finish find no room on
that decode node, their prefill nodes keep holding the KV and prefill slows further
(docs/simulator.md, "Autoscaling", resv29). So: reserve only when the tokens queued ahead of the
prompt on its prefill node fit in one engine step's token budget, i.e. its prefill starts with
the prefill node's next step; otherwise the join allocates after the prefill, as with
`reserve_decode_blocks` off. The queued tokens are the router's own view of the chosen prefill
node when it decided (`decision.prefill_inputs.load`: the node's last report plus the prompt
tokens this router sent it since), in the Python and the C decider alike.
"""
from __future__ import annotations

from cluster.router.policy import DecisionKind, RoutingDecision


def reserve_at_routing(decision: RoutingDecision, step_tokens: int) -> bool:
    """Whether to reserve ``decision``'s decode blocks now: a remote prefill whose prefill node
    has fewer than ``step_tokens`` (its engine's `max_num_batched_tokens`) queued ahead."""
    if step_tokens <= 0:
        raise ValueError(f"the prefill step's token budget must be > 0 (max_num_batched_tokens), got {step_tokens}")
    inputs = decision.prefill_inputs
    if decision.kind is not DecisionKind.REMOTE_PREFILL or inputs is None:
        return False
    return inputs.load.queued_prefill_tokens < step_tokens
