"""The gRPC frontend: pdserve.v1.Generation, health and reflection."""
