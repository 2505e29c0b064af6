"""OpenAI-compatible HTTP endpoint; with or without the gRPC one, over the process's one
request runner (validation, admission, deadline, metrics, in-flight tracking).

    from cluster.frontends.http import serve_http
    http = await serve_http(runner, config, api_keys=keys)

See docs/http.md for the routes, fields and error statuses.
"""
from cluster.frontends.http.app import create_app
from cluster.frontends.http.server import HttpServer, serve_http

__all__ = ["HttpServer", "create_app", "serve_http"]
