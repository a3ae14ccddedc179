"""The browser playground: static files shipped in the package, served at /playground/.

The page talks only to this proxy's own /v1 API (same API keys as any client), so it adds no
route that generates anything. Every answer carries a strict Content-Security-Policy: scripts,
styles and connections from this origin only, nothing inline, no frames, no forms.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse, Response

from .errors import ProxyError

STATIC_DIR = Path(__file__).resolve().parent / "static" / "playground"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _files() -> dict[str, Path]:
    """The servable files by name: exactly what the folder holds, nothing from a client path."""
    return {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in MEDIA_TYPES and p.is_file()}


def _serve(name: str) -> Response:
    path = _files().get(name)
    if path is None:
        raise ProxyError(
            f"no playground file '{name}'", status_code=404, error_type="not_found_error"
        )
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)


@router.get("/")
async def root() -> Response:
    return RedirectResponse("playground/", status_code=307)


@router.get("/playground")
async def playground_redirect() -> Response:
    # Relative URLs in the page (its modules, ../v1/...) resolve against the trailing slash.
    return RedirectResponse("playground/", status_code=307)


@router.get("/playground/")
async def playground_page() -> Response:
    return _serve("index.html")


@router.get("/playground/{name}")
async def playground_file(name: str) -> Response:
    return _serve(name)
