"""`--log-level`: one level, or a root level with per-logger levels after it,
e.g. `INFO,pdserve.requests=DEBUG` (what each request was routed to and
joined, see cluster/orchestration/handoff.py)."""
from __future__ import annotations

import logging

LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def parse_log_levels(spec: str) -> tuple[str, dict[str, str]]:
    """(root level, {logger name: level}); ValueError says how to write the spec."""
    root, named = "INFO", {}
    for i, part in enumerate(p.strip() for p in spec.split(",")):
        name, _, level = part.rpartition("=")
        level = level.strip().upper()
        if level not in LEVELS or (i == 0) == bool(name) or (i > 0 and not name.strip()):
            raise ValueError(f"log_level {spec!r}: write a level ({', '.join(LEVELS)}) optionally followed by "
                             f"logger=LEVEL pairs, e.g. 'INFO,pdserve.requests=DEBUG'")
        if i == 0:
            root = level
        else:
            named[name.strip()] = level
    return root, named


def configure_logging(spec: str) -> None:
    root, named = parse_log_levels(spec)
    logging.basicConfig(level=root, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, level in named.items():
        logging.getLogger(name).setLevel(level)
