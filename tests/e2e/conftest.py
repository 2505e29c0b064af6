import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # local test clusters on loopback only
