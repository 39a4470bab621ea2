"""The OpenAI error object and the exception that carries it out of a handler.

Every failure a client can cause ends as an `ApiError`, which app.py turns into
`{"error": {"message", "type", "param", "code"}}` with the given HTTP status; nothing a
client sends may raise anything else out of a handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # errors.py stays light: `serve`'s flags import limits.py and gate.py, which import it
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> "JSONResponse":
        from fastapi.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union-branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in (
            "str",
            "int",
            "list[int]",
            "list[str]",
            "list[list[int]]",
            "function-after",
        ) or "[" in str(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(e: "ValidationError") -> ApiError:
    """The first problem pydantic found, phrased with the parameter's name first."""
    err = e.errors()[0]
    param = _loc_to_param(tuple(err.get("loc", ())))
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err.get("type") == "missing":
        return ApiError(f"'{param}' is a required parameter", param)
    if err.get("type") == "extra_forbidden":
        return ApiError(f"unknown parameter '{param}'", param)
    got = err.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return ApiError(f"invalid value for '{param}': {msg} (got {shown})", param)
