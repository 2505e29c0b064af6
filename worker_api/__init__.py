"""The seam between orchestration (cluster/) and the workers: the worker API as
typed protocols (protocol.py), the values that cross the Ray boundary
(messages.py) and the base both workers build on (base.py)."""
