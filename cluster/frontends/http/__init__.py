"""OpenAI-compatible HTTP endpoint beside the gRPC one (same runner, validation, metrics).

    from cluster.frontends.http import serve_http
    http = await serve_http(grpc_server.runner, config, metrics, api_keys=keys)

See docs/http.md for the routes, fields and error statuses.
"""
from cluster.frontends.http.app import create_app
from cluster.frontends.http.server import HttpServer, serve_http

__all__ = ["HttpServer", "create_app", "serve_http"]
