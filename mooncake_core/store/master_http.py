"""The store master's HTTP port: ``/metrics``, ``/health``, ``/role``, ``/query_key``,
``/segments``, ``/stats``, ``/tenants`` and (unless disabled) the HTTP metadata server."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from mooncake_core.store import protocol as P
from mooncake_core.store.metrics import Metrics, render
from mooncake_core.store.state import MasterState, error_tuple


class MasterView(Protocol):
    """What the HTTP port reads from :class:`~mooncake_core.store.master.MasterServer`."""

    metrics: Metrics
    state: MasterState
    role: str
    id: str
    leader_hint: str
    kv_events: Any
    serve_metadata: bool


__all__ = ["build_http_app"]


def build_http_app(master: MasterView) -> web.Application:
    """The aiohttp application the master serves on its HTTP port."""
    app = web.Application()

    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(
            text=render(master.metrics, master.state, master.role), content_type="text/plain"
        )

    async def health(_r: web.Request) -> web.Response:
        ok = master.role in ("leader", "standby")
        return web.json_response(
            {"status": "ok" if ok else master.role, "role": master.role}, status=200 if ok else 503
        )

    async def role(_r: web.Request) -> web.Response:
        return web.json_response(
            {"role": master.role, "id": master.id, "leader": master.leader_hint}
        )

    async def query_key(r: web.Request) -> web.Response:
        key = r.query.get("key", "")
        try:
            return web.json_response(master.state.query_key(key))
        except Exception as exc:
            code, msg = error_tuple(exc)
            return web.json_response(
                {"error": msg}, status=404 if code == P.Code.NOT_FOUND else 400
            )

    async def segments(_r: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "name": s.name,
                    "client": s.client_id,
                    "peer": s.peer,
                    "size": s.size,
                    "used": s.allocator.used,
                    "objects": len(s.keys),
                }
                for s in master.state.segments.values()
            ]
        )

    async def stats(_r: web.Request) -> web.Response:
        out = master.state.stats()
        if master.kv_events is not None:
            out = {**out, "kv_events": master.kv_events.stats()}
        return web.json_response(out)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/role", role)
    app.router.add_get("/query_key", query_key)
    app.router.add_get("/segments", segments)
    app.router.add_get("/stats", stats)

    async def tenants(_r: web.Request) -> web.Response:
        return web.json_response(master.state.tenant_stats())

    app.router.add_get("/tenants", tenants)
    if master.serve_metadata:
        from mooncake_core.metadata.http import add_metadata_routes

        add_metadata_routes(app)
    return app
