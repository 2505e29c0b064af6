"""Orchestration: what serves a `GenerateJob` behind the frontends. backend.py states the
interface; local.py runs one engine in-process; the Ray cluster runs pools of prefill and
decode worker actors, a per-request hand-off between them, and the router that picks them."""
