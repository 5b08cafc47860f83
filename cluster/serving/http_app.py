"""The FastAPI app the router serves, and its errors in OpenAI's shape.

Every error the app answers, its own or the framework's (an unknown path, a wrong
method, a query parameter of the wrong type, a bug), is an OpenAI error object. Also
here: the patch that lets a new router take the port of one that died
(:func:`_rebind_after_a_crash`), applied where this module is imported.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime.

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cluster.serving.validation import ApiError

logger = logging.getLogger("ray.serve")


def _rebind_after_a_crash() -> None:
    """Let a new router take the port of one that died.

    Ray Serve 2.60's direct ingress binds a replica's HTTP port without SO_REUSEADDR.
    When a router dies with connections open (a crash, SIGKILL, or `v41 serve` stopped
    and started again), the kernel keeps those connections' sockets on the port for up
    to a minute (TIME_WAIT, FIN_WAIT2); the replacement's bind fails, and Serve then
    blocks the port for good: no router comes back. This has the router's server bind
    the way Serve's proxy does (SO_REUSEADDR and SO_REUSEPORT). Serve never gives one
    port to two live replicas, so no two routers share it. Runs where this module is
    imported (the router replica, when Serve loads its class); a Ray without that
    function is left alone."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "start_asgi_http_server", None)
    if original is None or getattr(original, "v41_rebinds", False):
        return

    async def start_asgi_http_server(app, http_options, *, event_loop, enable_so_reuseport=False):
        return await original(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_asgi_http_server.v41_rebinds = True
    replica.start_asgi_http_server = start_asgi_http_server


_rebind_after_a_crash()
fastapi_app = FastAPI(title="v41", docs_url=None, redoc_url=None, openapi_url=None)


@fastapi_app.exception_handler(HTTPException)
async def _http_error(request: Request, error: HTTPException):
    """Unknown paths and wrong methods answer in the OpenAI error shape too."""
    if error.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif error.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(error.detail)
    body = ApiError(error.status_code, message).body()
    return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))


@fastapi_app.exception_handler(RequestValidationError)
async def _bad_query(request: Request, error: RequestValidationError):
    """A query parameter of the wrong type (``?limit=x``): a 400 naming it, in the OpenAI shape."""
    first = error.errors()[0]
    param = str(first["loc"][-1]) if first.get("loc") else None
    body = ApiError(400, f"{param}: {first['msg']}", param).body()
    return JSONResponse(body, status_code=400)


@fastapi_app.exception_handler(Exception)
async def _server_error(request: Request, error: Exception):
    """A bug answers in the OpenAI error shape too (and is logged), never as a bare 500."""
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    body = ApiError(500, f"internal error: {type(error).__name__}", kind="server_error").body()
    return JSONResponse(body, status_code=500)


def json_error(error: ApiError) -> JSONResponse:
    """An :class:`ApiError` as the HTTP answer."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
