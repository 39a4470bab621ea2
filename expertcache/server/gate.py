"""Who may reach which route: the one ASGI middleware in front of every route, before a body byte is read.

In order, each refusal an OpenAI error object:
1. Host (as Starlette's TrustedHostMiddleware): the Host header's name must be one the server answers
   to: the loopback names (localhost, 127.0.0.1, ::1) when bound to loopback, else `--allowed-hosts`
   ('*' = any). A page on another site that resolves its own name to 127.0.0.1 (DNS rebinding) sends
   its own name: 400.
2. Origin: a browser request from another origin (its Origin header's host:port differs from Host)
   gets 403: no web page the user visits can drive the server.
3. API key (when --api-key is set): every route but PUBLIC_PATHS (/health; /metrics with
   --public-metrics; the browser UI's static files, which hold no data and ask for the key) needs
   'Authorization: Bearer KEY': else 401.
4. Content type: a POST to a JSON route needs 'Content-Type: application/json' (a form or text/plain
   body, the kind a page may send cross-site without asking, gets 415).

The client's identity (its key, else its address) is left in scope["expertcache.who"] for the
per-key limit.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from .errors import ApiError

LOOPBACK_BIND = ("127.0.0.1", "localhost", "::1")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
UI_PATHS = ("/", "/favicon.ico")
UI_PREFIX = "/ui/"


@dataclass
class Access:
    """The access settings of one server (from `serve`'s flags)."""

    api_key: str | tuple[str, ...] | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES  # '*' in it = any Host
    public_metrics: bool = False
    api_docs: bool = False  # /docs, /redoc, /openapi.json exist (behind the key when one is set)
    public_paths: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        self.allowed_hosts = tuple(h.lower().strip("[]") for h in self.allowed_hosts)
        self.public_paths = ("/health", "/metrics") if self.public_metrics else ("/health",)

    @classmethod
    def for_bind(cls, host: str, allowed_hosts: list[str] | None, **kw) -> "Access":
        """The default Host names for a bind address: the loopback names on loopback; otherwise
        --allowed-hosts is required (ConfigError naming it)."""
        from ..errors import ConfigError

        if allowed_hosts:
            return cls(allowed_hosts=tuple(allowed_hosts), **kw)
        if host in LOOPBACK_BIND:
            return cls(**kw)
        raise ConfigError(
            f"--host {host} is not loopback: name the host names clients use with --allowed-hosts "
            "(e.g. --allowed-hosts myserver.lan,10.0.0.5, or '*' for any)"
        )

    def is_public(self, path: str) -> bool:
        return path in self.public_paths or path in UI_PATHS or path.startswith(UI_PREFIX)

    def who(self, headers: dict[bytes, bytes], client: tuple | None) -> str:
        """-> the caller's identity: the API key given, or the client's address without a key;
        ApiError 401 for a wrong or missing key."""
        if not self.api_key:
            return client[0] if client else "?"
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        token_bytes = token.strip().encode()
        keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key
        # every key compared (constant time each): no early exit that times which one matched
        matches = [k for k in keys if hmac.compare_digest(token_bytes, k.encode())]
        if scheme.lower() != "bearer" or not matches:
            raise ApiError(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )
        return matches[0]


def _host_name(host: str) -> str:
    """'name:port', '[::1]:port' or 'name' -> the lower-case name."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


def _origin_authority(origin: str) -> str | None:
    """'https://name:port' -> 'name:port' (lower case), None for 'null' or no scheme."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    return rest.rstrip("/") if sep and scheme in ("http", "https") else None


class Gate:
    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    def check(self, scope) -> str:
        """-> the caller's identity, or ApiError (400 host, 403 origin, 401 key, 415 content type)."""
        a = self.access
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if "*" not in a.allowed_hosts and _host_name(host) not in a.allowed_hosts:
            raise ApiError(
                f"Host {host!r} is not one this server answers to (--allowed-hosts)",
                status=400,
                code="invalid_host",
            )
        origin = headers.get(b"origin")
        if origin is not None:
            authority = _origin_authority(origin.decode("latin-1"))
            if authority is None or authority != host.strip().lower():
                raise ApiError(
                    "cross-origin requests are refused: the Origin header names another site",
                    status=403,
                    code="cross_origin",
                )
        path = scope["path"]
        who = "?" if a.is_public(path) and a.api_key else a.who(headers, scope.get("client"))
        if scope["method"] == "POST" and path in JSON_ROUTES:
            ctype = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(
                    f"{path} takes a JSON body: send 'Content-Type: application/json' (got "
                    f"{ctype or 'none'!r})",
                    status=415,
                    code="unsupported_media_type",
                )
        return who

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            scope["expertcache.who"] = self.check(scope)
        except ApiError as e:
            return await e.response()(scope, receive, send)
        return await self.app(scope, receive, send)
