"""Images in a prompt -> placeholder tokens and encoder inputs, by the checkpoint's own processor.

The HF processor (``transformers.AutoProcessor``) does all image preprocessing and says how many
placeholder tokens each image takes (``_get_num_multimodal_tokens``, as vLLM asks it). The prompt
names each image with one placeholder token (``<image>``), expanded here to the image's count;
a run already of that length (a prompt the processor expanded) is kept as it is. Processed images
are cached by content hash (``mm_processor_cache_gb``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from pagellm.config import MultiModalConfig
from pagellm.mm_inputs import MultiModalFeature


def image_hash(image: Any) -> str:
    """A content hash of a PIL image (mode, size and pixels): equal images share their encoder output."""
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def as_images(value: Any, what: str = "multi_modal_data['image']") -> list[Any]:
    """One PIL image or a list of them, checked."""
    from PIL import Image

    images = value if isinstance(value, list | tuple) else [value]
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"{what}[{i}] must be a PIL.Image.Image, got {type(im).__name__}")
    return list(images)


class MultiModalProcessor:
    def __init__(self, model_path: str, config: MultiModalConfig) -> None:
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_path)
        self.config = config
        self.image_token: str = self.hf.image_token
        self.image_token_id: int = self.hf.tokenizer.convert_tokens_to_ids(self.image_token)
        self.cache_bytes = int(config.mm_processor_cache_gb * 2**30)
        self._cache: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()  # LRU: hash -> (inputs, tokens)
        self._cached_bytes = 0

    def _process_image(self, image: Any, mm_hash: str) -> tuple[dict[str, Any], int]:
        """``(encoder inputs, placeholder tokens)`` of one image, from the cache when seen before."""
        hit = self._cache.get(mm_hash)
        if hit is not None:
            self._cache.move_to_end(mm_hash)
            return hit
        inputs = dict(self.hf.image_processor(images=[image.convert("RGB")], return_tensors="np"))
        num = int(self.hf._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)]).num_image_tokens[0])
        entry = ({k: v[0] if k == "pixel_values" else v for k, v in inputs.items()}, num)
        size = sum(getattr(v, "nbytes", 0) for v in entry[0].values())
        if size <= self.cache_bytes:
            self._cache[mm_hash] = entry
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, (old, _) = self._cache.popitem(last=False)
                self._cached_bytes -= sum(getattr(v, "nbytes", 0) for v in old.values())
        return entry

    def process(self, ids: list[int], images: list[Any], request_id: str) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each image's placeholder expanded, and its images in prompt order."""
        limit = self.config.limit_mm_per_prompt.get("image", 0)
        if len(images) > limit:
            raise ValueError(f"{len(images)} images in one prompt; limit_mm_per_prompt allows {limit}")
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholders ({self.image_token!r}) for "
                             f"{len(images)} images: put one where each image goes")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for (start, length), image in zip(runs, images, strict=True):
            mm_hash = image_hash(image)
            inputs, num = self._process_image(image, mm_hash)
            if length not in (1, num):
                raise ValueError(f"image {len(features)}: {length} placeholder tokens in a run, but the image takes "
                                 f"{num} (give one {self.image_token!r} per image)")
            out += ids[prev:start]
            if self.cache_bytes == 0:  # caching off: this request's images are its own
                mm_hash = f"{mm_hash}:{request_id}"
            features.append(MultiModalFeature(mm_hash, len(out), num, inputs))
            out += [self.image_token_id] * num
            prev = start + length
        return out + ids[prev:], features


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
