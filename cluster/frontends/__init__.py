"""Serving frontends: gRPC (grpc/) and OpenAI-compatible HTTP (http/), each independent of the
other, over one shared request runner (runner.py: admission, deadline, streaming) and the
validation of requests into `GenerateJob`s. They talk to orchestration only through
`cluster.orchestration.backend.GenerationBackend`."""
