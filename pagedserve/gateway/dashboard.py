"""The live dashboard: one HTML page and its script and style sheet, read from the package's
static/ folder. The page polls GET /v1/engine/stats and draws the KV block pool, the queues, the
step budget utilisation and a latency waterfall of recent requests (no framework, no CDN).

The page and its assets hold no data and answer without a key; the data stays behind the key
(an ordinary key sees its own requests, the operator's all). The key reaches the page in the URL
fragment (#key=…), never sent to a server. Every asset goes out with a strict CSP (own origin
only, no framing), no Referer and nosniff."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

# name -> media type; nothing else under static/ is served.
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

# 'unsafe-inline' styles only: the script sets element styles and builds SVG with style attributes.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter(include_in_schema=False)


def read_asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no dashboard asset {name!r}")
    # no-cache: revalidate on every load, so a new version of the page is never mixed with an old script.
    return Response(read_asset(name), media_type=ASSETS[name],
                    headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})


@router.get("/dashboard")
async def dashboard() -> Response:
    return _asset("dashboard.html")


@router.get("/dashboard/static/{name}")
async def dashboard_static(name: str) -> Response:
    return _asset(name)
