"""Images in chat requests, on the gateway: OpenAI's content parts onto ChatMessage.parts, and the
checks and URL fetches before a request goes downstream.

  - message_content: a chat message's content (a string, or parts: {"type": "text"} and
    {"type": "image_url", "image_url": {"url", "detail"} or the url string, as vLLM takes it})
    onto the proto: `content` for text alone (the default bytes, unchanged), `parts` in order
    when the message has images. A data: URL is base64-decoded here (a bad one: 400 naming the
    part); an http(s) URL rides as ContentPart.image_url until resolve. The Anthropic and
    Responses APIs map their image blocks onto these parts (anthropic_api.py, responses_api.py).
  - resolve (REST and the public gRPC API, after the model check, before anything is stored or
    sent): the model must take images (ModelInfo.takes_images), at most --limit-mm-per-prompt of
    them, each URL fetched (async httpx, --media-fetch-timeout for the whole fetch, at most
    MAX_IMAGE_BYTES, redirects followed by hand, at most MAX_REDIRECTS, each hop's host checked
    against --allowed-media-domains), and every image's header read by
    model_files/image_processing.open_image (not an image, too many pixels: 400 naming the part).
    The tokenizer decodes and resizes.

Threads: the gateway's event loop; no state but the policy (frozen) and one shared client.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import grpc
import httpx

from pagedserve.gateway.errors import RequestError, bad_request
from pagedserve.model_files.image_processing import MAX_IMAGE_BYTES, open_image
from pagedserve.model_files.prompt_images import decode_data_url
from pagedserve.v1 import generate_pb2

DEFAULT_MAX_IMAGES = 4  # --limit-mm-per-prompt's default (vLLM's {"image": ...})
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    max_images: int = DEFAULT_MAX_IMAGES
    allowed_domains: tuple[str, ...] = ()  # empty: any host
    fetch_timeout_s: float = 5.0
    max_bytes: int = MAX_IMAGE_BYTES


def media_policy(limit_mm_per_prompt: str | None, allowed_domains, fetch_timeout_s: float) -> MediaPolicy:
    """The gateway's flags as a policy; ValueError for a bad --limit-mm-per-prompt."""
    limit = DEFAULT_MAX_IMAGES
    if limit_mm_per_prompt:
        try:
            value = json.loads(limit_mm_per_prompt)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not all(isinstance(v, int) and v >= 0 for v in value.values()):
            raise ValueError(f'--limit-mm-per-prompt must be a JSON object like \'{{"image": 4}}\', '
                             f"got {limit_mm_per_prompt!r}")
        limit = value.get("image", limit)
    if fetch_timeout_s <= 0:
        raise ValueError(f"--media-fetch-timeout must be positive, got {fetch_timeout_s}")
    return MediaPolicy(limit, tuple(d.lower() for d in allowed_domains or ()), fetch_timeout_s)


# ---- the request's parts ------------------------------------------------------------------------
def _image_part(value: Any, where: str) -> generate_pb2.ContentPart:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f'{where} must be {{"url": "data:image/...;base64,..." or "https://..."}}', "messages")
    if url.startswith("data:"):
        try:
            return generate_pb2.ContentPart(image=decode_data_url(url))
        except ValueError as exc:
            raise bad_request(f"{where}: {exc}", "messages") from None
    if urlsplit(url).scheme not in ("http", "https"):
        raise bad_request(f"{where}: an image URL must be http(s) or data:image/...;base64", "messages")
    return generate_pb2.ContentPart(image_url=url)


def _field(part: Any, name: str) -> Any:
    return part.get(name) if isinstance(part, dict) else getattr(part, name, None)


def message_text(content: Any, where: str) -> str:
    """A message's content as text (text parts joined by newlines, as vLLM flattens them); 400 for
    any other part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if _field(part, "type") != "text" or not isinstance(_field(part, "text"), str):
            raise bad_request(f"{where}.content[{j}]: only text parts are supported here, got type "
                              f"{_field(part, 'type')!r}", "messages")
        texts.append(_field(part, "text"))
    return "\n".join(texts)


def message_content(content: Any, where: str, proto: generate_pb2.ChatMessage) -> None:
    """content (a string or OpenAI parts) onto proto.content, or onto proto.parts (one per content
    part, in order) when it has images."""
    if not isinstance(content, list) or all(_field(p, "type") == "text" for p in content):
        proto.content = message_text(content, where)
        return
    for j, part in enumerate(content):
        kind, at = _field(part, "type"), f"{where}.content[{j}]"
        if kind == "text" and isinstance(_field(part, "text"), str):
            proto.parts.add(text=_field(part, "text"))
        elif kind == "image_url":
            proto.parts.append(_image_part(_field(part, "image_url"), f"{at}.image_url"))
        else:
            raise bad_request(f"{at}: content parts must be text or image_url, got type {kind!r}", "messages")


def image_count(chat: generate_pb2.ChatMessages) -> int:
    return sum(1 for m in chat.messages for p in m.parts if p.WhichOneof("part") in ("image", "image_url"))


# ---- resolve: the checks and the fetches ----------------------------------------------------------
async def resolve(chat: generate_pb2.ChatMessages, info: generate_pb2.ModelInfo, policy: MediaPolicy,
                  client: httpx.AsyncClient | None, part_name: str = "content") -> None:
    """Check a chat's images against the model and the policy, fetch its URLs into bytes and read
    every image's header. Raises RequestError (400) naming the part: messages[i].<part_name>[j]."""
    count = image_count(chat)
    if not count:
        return
    if not info.takes_images:
        raise bad_request(f"the model {info.model!r} does not take images (a chat message has {count})", "messages")
    if count > policy.max_images:
        raise bad_request(f"the request has {count} images: at most {policy.max_images} per request "
                          "(--limit-mm-per-prompt)", "messages")
    fetches, wheres = [], []
    for i, m in enumerate(chat.messages):
        for j, part in enumerate(m.parts):
            where = f"messages[{i}].{part_name}[{j}]"
            if part.WhichOneof("part") == "image_url":
                fetches.append(_fetch_into(part, f"{where}.image_url", policy, client))
            elif part.WhichOneof("part") == "image":  # (REST: a data: URL's, decoded by message_content)
                wheres.append((part, where + (".image_url" if part_name == "content" else "")))
    await asyncio.gather(*fetches)
    for part, where in wheres:
        _check(part.image, where)


def _check(data: bytes, where: str) -> None:
    try:
        open_image(data).close()
    except ValueError as exc:
        raise bad_request(f"{where}: {exc}", "messages") from None


async def _fetch_into(part: generate_pb2.ContentPart, where: str, policy: MediaPolicy,
                      client: httpx.AsyncClient | None) -> None:
    url = part.image_url
    try:
        data = await asyncio.wait_for(fetch(url, policy, client), policy.fetch_timeout_s)
    except TimeoutError:
        raise bad_request(f"{where}: fetching {url} took more than {policy.fetch_timeout_s:g} s "
                          "(--media-fetch-timeout)", "messages") from None
    except RequestError as exc:
        raise bad_request(f"{where}: {exc.message}", "messages") from None
    except httpx.HTTPError as exc:
        raise bad_request(f"{where}: fetching {url} failed ({type(exc).__name__}: {exc})", "messages") from None
    _check(data, where)
    part.image = data  # the oneof: image_url is cleared


def _host_allowed(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_request(f"{url} is not an http(s) URL")
    if policy.allowed_domains and parts.hostname.lower() not in policy.allowed_domains:
        raise bad_request(f"the host {parts.hostname} is not allowed (--allowed-media-domains)")


async def fetch(url: str, policy: MediaPolicy, client: httpx.AsyncClient | None = None) -> bytes:
    """The body at url, at most policy.max_bytes, following at most MAX_REDIRECTS redirects (each
    hop's host allowed). RequestError for a refusal, httpx.HTTPError for a transport failure."""
    own = client is None
    client = client or httpx.AsyncClient(follow_redirects=False)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            _host_allowed(url, policy)
            async with client.stream("GET", url, follow_redirects=False) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                if response.status_code != 200:
                    raise bad_request(f"fetching {url} answered HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                    raise bad_request(f"{url} has {declared} bytes: at most {policy.max_bytes} are fetched")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > policy.max_bytes:
                        raise bad_request(f"{url} has more than {policy.max_bytes} bytes: at most that many are "
                                          "fetched")
                return bytes(body)
        raise bad_request(f"fetching the image took more than {MAX_REDIRECTS} redirects")
    finally:
        if own:
            await client.aclose()


def image_room(limit: int, media: MediaPolicy, base64: bool) -> int:
    """A request's size limit on a model that takes images: `limit` (--max-body-bytes; 0: none) and room
    for as many images as a request may carry (--limit-mm-per-prompt), each up to the encoded-image cap
    (in base64 in a JSON body; as bytes in a gRPC message)."""
    if limit <= 0 or not media.max_images:
        return limit
    return limit + media.max_images * (-(-media.max_bytes * 4 // 3) if base64 else media.max_bytes)


async def body_limit(backend) -> int:
    """A REST body's limit: --max-body-bytes, with image_room on a model that takes images."""
    limit, media = backend.admission.limits.max_body_bytes, backend.media
    if limit > 0 and media.max_images:
        try:
            takes_images = (await backend.model_info_rpc()).takes_images
        except grpc.RpcError:
            takes_images = False  # (the request itself meets the tokenizer's error)
        if takes_images:
            return image_room(limit, media, base64=True)
    return limit
