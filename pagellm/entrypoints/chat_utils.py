"""Images in chat messages: OpenAI content parts -> the model's placeholders and PIL images.

``{"type": "image_url", "image_url": {"url": ...}}`` (a ``data:`` URL, an ``http(s)`` URL fetched
with a timeout and a size limit unless remote media are off, or a ``file://`` path under
``allowed_local_media_path``) and ``{"type": "image_pil", "image_pil": PIL.Image}`` (offline only).
Where the chat template renders image parts itself (its source names ``image``), each image part
becomes ``{"type": "image"}``; otherwise the content becomes text with one placeholder per image
first, then the text parts, joined by newlines (vLLM's placement for such templates).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any

from pagellm.config import MultiModalConfig

MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 8192 * 8192
FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image part that cannot be used; ``param`` names it (``messages[i].content[j]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaConnector:
    """Loads an image URL under the server's rules (``MultiModalConfig``)."""

    allowed_local_media_path: str | None = None
    allow_remote_media: bool = True
    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def from_config(cls, config: MultiModalConfig) -> MediaConnector:
        return cls(config.allowed_local_media_path, config.allow_remote_media)

    def load_image(self, url: str) -> Any:
        if url.startswith("data:"):
            return decode_image(self._data_url(url))
        if url.startswith(("http://", "https://")):
            return decode_image(self._fetch(url))
        if url.startswith("file://"):
            return decode_image(self._local(url.removeprefix("file://")))
        raise ValueError("the image URL must be a data:, http(s):// or file:// URL")

    def _data_url(self, url: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError("a data: URL must be 'data:image/...;base64,<data>'")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"the data: URL is not valid base64 ({e})") from None
        self._check_size(len(data))
        return data

    def _fetch(self, url: str) -> bytes:
        if not self.allow_remote_media:
            raise ValueError("http(s) image URLs are turned off on this server (--no-allow-remote-media)")
        import httpx

        try:
            with httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=True) as r:
                if r.status_code != 200:
                    raise ValueError(f"fetching the image failed: HTTP {r.status_code}")
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    self._check_size(size)
                    chunks.append(chunk)
        except httpx.HTTPError as e:
            raise ValueError(f"fetching the image failed: {type(e).__name__}: {e}") from None
        return b"".join(chunks)

    def _local(self, path: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise ValueError("file:// image URLs need the server's --allowed-local-media-path")
        real = os.path.realpath(path)
        if os.path.commonpath([real, os.path.realpath(root)]) != os.path.realpath(root):
            raise ValueError(f"file {path!r} is outside --allowed-local-media-path")
        if not os.path.isfile(real):
            raise ValueError(f"file {path!r} does not exist")
        self._check_size(os.path.getsize(real))
        with open(real, "rb") as f:
            return f.read()

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise ValueError(f"the image is larger than {self.max_bytes} bytes")


def decode_image(data: bytes) -> Any:
    """Bytes -> an RGB PIL image, or a ``ValueError`` (not an image; too many pixels)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"the image has {im.width}x{im.height} pixels, more than {MAX_IMAGE_PIXELS}")
            return im.convert("RGB")
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not an image ({type(e).__name__}: {e})") from None


def template_renders_images(chat_template: str | None) -> bool:
    """Whether a chat template renders image parts itself (LLaVA's and Qwen2-VL's do)."""
    return chat_template is not None and "image" in chat_template


def _part_image(part: dict[str, Any], media: MediaConnector | None, param: str) -> Any:
    from PIL import Image

    kind = part.get("type")
    if kind == "image_pil":
        im = part.get("image_pil")
        if not isinstance(im, Image.Image):
            raise MediaError("image_pil must be a PIL.Image.Image", param)
        return im
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise MediaError("image_url needs a 'url' string", param)
    if media is None:
        media = MediaConnector()
    try:
        return media.load_image(url)
    except ValueError as e:
        raise MediaError(str(e), param) from None


def extract_images(messages: list[dict[str, Any]], placeholder: str | None, renders_images: bool,
                   media: MediaConnector | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(messages for the chat template, images in prompt order)``; an image part for a model that
    takes none, or one that cannot be loaded, is a ``MediaError`` naming the part."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(
                isinstance(p, dict) and p.get("type") in ("image_url", "image_pil") for p in content):
            out.append(m)
            continue
        texts, parts, n = [], [], 0
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if part.get("type") in ("image_url", "image_pil"):
                if placeholder is None:
                    raise MediaError("this model takes no images", param)
                images.append(_part_image(part, media, param))
                parts.append({"type": "image"})
                n += 1
            elif part.get("type") == "text":
                texts.append(part.get("text") or "")
                parts.append({"type": "text", "text": part.get("text") or ""})
            else:
                raise MediaError(f"unsupported content part type {part.get('type')!r} (text, image_url, image_pil)",
                                 param)
        content_out: Any = parts if renders_images else "\n".join([placeholder or ""] * n + texts)
        out.append({**m, "content": content_out})
    return out, images
