"""Request errors as OpenAI reports them: a message, a type, and the offending field (``param``)."""
from __future__ import annotations

import json


class InvalidRequestError(ValueError):
    """A request the engine refuses (HTTP 400 unless ``status`` says otherwise); ``field`` names the
    offending field, ``message`` says why."""
    status = 400

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message


class UnknownModelError(InvalidRequestError):
    """The request names a model this pool does not serve (HTTP 404)."""
    status = 404


class RequestTooLargeError(InvalidRequestError):
    """The request body is over the server's limit (HTTP 413)."""
    status = 413


def error_body(message: str, status: int, param: str | None = None,
               etype: str = "invalid_request_error") -> dict:
    """OpenAI's error object: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": etype, "param": param or None, "code": status}}


def error_event(message: str, status: int = 500, **extra) -> bytes:
    """One SSE event carrying OpenAI's error object (``server_error``), for a stream that cannot go
    on; ``extra`` fields are added to the error object (the router's ``reason``)."""
    body = error_body(message, status, None, "server_error")
    body["error"].update(extra)
    return b"data: " + json.dumps(body).encode() + b"\n\n"
