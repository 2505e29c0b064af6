"""Serving frontends: gRPC (grpc/) and OpenAI-compatible HTTP (http/), each independent of the
other, over the process's one request runner (runner.py: validation, admission, the deadline,
metrics, in-flight tracking for drain; pump.py: the typed queue from the backend) and the
transport-neutral API keys and TLS files (auth.py). They talk to orchestration only through
`cluster.orchestration.backend.GenerationBackend`."""
