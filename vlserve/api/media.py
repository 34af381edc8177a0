"""Fetching the media of chat content parts for the server, without blocking the event loop.

- `data:` URLs pass through (decoded later, in the input-processing thread), after a size check;
- `http(s)://` URLs are downloaded with httpx.AsyncClient (timeouts: image 5 s, video 30 s), with a size cap and,
  when `--allowed-media-domains` is set, only from those hosts (redirects are checked hop by hop);
- `file://` URLs are read only inside `--allowed-local-media-path`, after resolving symlinks and `..`;
- anything else (bare paths, other schemes, Python-object part types) is refused.
Every failure is an `APIError(400)` naming the URL and the reason.
"""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urljoin, urlparse

import httpx

from vlserve.api.errors import APIError
from vlserve.engine.chat import is_name_only
from vlserve.multimodal.audio import input_audio_data_url
from vlserve.shorten import shorten

URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
PASSTHROUGH_PARTS = {"input_audio": "audio"}


@dataclass
class MediaConfig:
    """Where media may come from and how much of it."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    timeouts: dict[str, float] = field(default_factory=lambda: {"image": 5.0, "video": 30.0, "audio": 10.0})
    max_bytes: dict[str, int] = field(
        default_factory=lambda: {"image": 20 << 20, "video": 200 << 20, "audio": 50 << 20}
    )
    max_redirects: int = 5
    media_io_kwargs: dict[str, dict[str, Any]] | None = None  # defaults of the per-request field (media_controls)
    max_video_fps: float = 30.0  # bound on media_io_kwargs.video.fps
    enable_mm_embeds: bool = False  # image_embeds content parts


class MediaFetcher:
    """Resolves the media parts of chat messages to payloads the input processor can decode (bytes or data URLs)."""

    def __init__(self, config: MediaConfig | None = None):
        self.config = config or MediaConfig()
        self._client: httpx.AsyncClient | None = None
        domains = self.config.allowed_media_domains
        self._domains = None if domains is None else {d.lower().strip() for d in domains if d.strip()}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)
        return self._client

    # -- messages ----------------------------------------------------------------------------------------------
    @staticmethod
    def media_parts(messages: list[dict]) -> list[tuple[str, dict]]:
        """(part type, part) for every media part, in prompt order; refuses part types HTTP clients may not use."""
        found = []
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype in URL_PARTS or ptype in PASSTHROUGH_PARTS:
                    found.append((ptype, part))
                elif ptype in ("image", "image_pil", "video"):
                    raise APIError(
                        f"content part type {ptype!r} is not accepted over HTTP; use image_url or "
                        f"video_url (data:, http(s):// or file:// URLs)",
                        400,
                        "messages",
                    )
        return found

    async def resolve(self, messages: list[dict]) -> dict[int, Any]:
        """Fetch every media part concurrently -> {id(part): payload} (the first failure cancels the rest)."""
        parts = [(t, p) for t, p in self.media_parts(messages) if not is_name_only(p)]  # uuid alone: cached
        if not parts:
            return {}
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [(id(part), tg.create_task(self.fetch(ptype, part))) for ptype, part in parts]
        except BaseExceptionGroup as eg:
            first = eg.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return {key: t.result() for key, t in tasks}

    # -- one part ----------------------------------------------------------------------------------------------
    async def fetch(self, part_type: str, part: dict) -> Any:
        """The payload of one content part."""
        if part_type in PASSTHROUGH_PARTS:
            try:
                url = input_audio_data_url(part.get(part_type))
            except ValueError as e:
                raise APIError(str(e), 400, "messages") from None
            limit = self.config.max_bytes["audio"]
            if len(url) > limit * 4 // 3 + 1024:
                raise APIError(f"input_audio data is larger than the {limit} byte cap", 400, "messages")
            return url
        kind = URL_PARTS[part_type]
        value = part.get(part_type)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise APIError(f"content part {part_type!r} needs a non-empty 'url'", 400, "messages")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            limit = self.config.max_bytes[kind]
            if len(url) > limit * 4 // 3 + 1024:
                raise APIError(f"{kind} data URL is larger than the {limit} byte cap", 400)
            return url
        if scheme in ("http", "https"):
            return await self._fetch_http(url, kind)
        if scheme == "file":
            return await self._read_local(url, kind)
        raise APIError(f"unsupported {kind} URL {shorten(url, 100)}: use a data:, http(s):// or file:// URL", 400)

    def _check_domain(self, url: str, kind: str) -> None:
        host = (urlparse(url).hostname or "").lower()
        if not host:
            raise APIError(f"{kind} URL {shorten(url, 100)} has no host", 400)
        if self._domains is not None and host not in self._domains:
            raise APIError(f"{kind} URL host {host!r} is not in --allowed-media-domains", 400)

    async def _fetch_http(self, url: str, kind: str) -> bytes:
        timeout = self.config.timeouts[kind]
        try:
            return await asyncio.wait_for(self._download(url, kind, timeout), timeout)
        except (TimeoutError, httpx.TimeoutException):
            raise APIError(f"timed out after {timeout:g} s fetching {kind} {shorten(url, 100)}", 400) from None
        except httpx.HTTPError as e:
            raise APIError(f"could not fetch {kind} {shorten(url, 100)}: {type(e).__name__}: {e}", 400) from None

    async def _download(self, url: str, kind: str, timeout: float) -> bytes:
        limit = self.config.max_bytes[kind]
        for _ in range(self.config.max_redirects + 1):
            if urlparse(url).scheme.lower() not in ("http", "https"):
                raise APIError(f"{kind} URL redirected to a non-http(s) URL {shorten(url, 100)}", 400)
            self._check_domain(url, kind)
            async with self._http().stream("GET", url, timeout=timeout) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = urljoin(url, resp.headers["location"])
                    continue
                if resp.status_code != 200:
                    raise APIError(f"fetching {kind} {shorten(url, 100)} failed: HTTP {resp.status_code}", 400)
                size = resp.headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > limit:
                    raise APIError(f"{kind} at {shorten(url, 100)} is {size} bytes, over the {limit} byte cap", 400)
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > limit:
                        raise APIError(f"{kind} at {shorten(url, 100)} is over the {limit} byte cap", 400)
                if not buf:
                    raise APIError(f"{kind} at {shorten(url, 100)} is empty", 400)
                return bytes(buf)
        raise APIError(f"too many redirects fetching {kind} {shorten(url, 100)}", 400)

    async def _read_local(self, url: str, kind: str) -> bytes:
        root = self.config.allowed_local_media_path
        if root is None:
            raise APIError("file:// URLs are disabled; start the server with --allowed-local-media-path DIR", 400)
        if "\x00" in url or "%00" in url:
            raise APIError(f"file URL {shorten(url, 100)} contains a NUL character", 400, "messages")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise APIError(f"file URL {shorten(url, 100)} must be file:///absolute/path", 400)
        real = os.path.realpath(unquote(parsed.path))
        root = os.path.realpath(root)
        try:
            inside = os.path.commonpath([real, root]) == root
        except ValueError:
            inside = False
        if not inside:
            raise APIError(f"{kind} file {shorten(url, 100)} is outside --allowed-local-media-path", 400)
        limit = self.config.max_bytes[kind]
        return await asyncio.to_thread(_read_capped, real, limit, kind, url)


def _read_capped(path: str, limit: int, kind: str, url: str) -> bytes:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise APIError(f"{kind} file {shorten(url, 100)} not found", 400, "messages") from None
    except OSError as e:
        raise APIError(f"cannot read {kind} file {shorten(url, 100)}: {e.strerror}", 400, "messages") from None
    if stat.S_ISDIR(mode):
        raise APIError(f"{kind} file URL {shorten(url, 100)} names a directory, not a file", 400, "messages")
    if not stat.S_ISREG(mode):
        raise APIError(
            f"{kind} file URL {shorten(url, 100)} is not a regular file (a FIFO, socket or device)", 400, "messages"
        )
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise APIError(f"cannot read {kind} file {shorten(url, 100)}: {e.strerror}", 400) from None
    if len(data) > limit:
        raise APIError(f"{kind} file {shorten(url, 100)} is over the {limit} byte cap", 400)
    if not data:
        raise APIError(f"{kind} file {shorten(url, 100)} is empty", 400)
    return data
