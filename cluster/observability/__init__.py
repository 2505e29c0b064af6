"""Metrics (Prometheus, including the vllm:* names gateways read), their HTTP server, log levels."""
