"""Images in a prompt -> placeholder tokens and encoder inputs, by the checkpoint's own processor.

The HF processor (``transformers.AutoProcessor``) does all image preprocessing and says how many
placeholder tokens each image takes, by expanding one (Qwen2-VL, whose processor transformers builds
only with torchvision: its image processor, and the image's grid says the count). The prompt
names each image with one placeholder token (``<image>``), expanded here to the image's count;
a run already of that length (a prompt the processor expanded) is kept as it is. Processed images
are cached by content hash (``mm_processor_cache_gb``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import Any

from pagellm.config import MultiModalConfig
from pagellm.mm_inputs import MultiModalFeature

logger = logging.getLogger(__name__)


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
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

        self.config = config
        model_config = AutoConfig.from_pretrained(model_path)
        try:
            hf = AutoProcessor.from_pretrained(model_path)
            self.hf: Any = hf
            self.image_processor: Any = hf.image_processor
            self.image_token: str = hf.image_token
            tokenizer = hf.tokenizer
        except (AttributeError, ImportError) as e:
            # transformers builds Qwen2-VL's processor with its video processor, which needs
            # torchvision; images need only the image processor (the same preprocessing).
            logger.info("using %s's image processor alone (its processor needs %s)", model_path, e)
            self.hf = None
            self.image_processor = AutoImageProcessor.from_pretrained(model_path)
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.image_token = str(tokenizer.convert_ids_to_tokens(model_config.image_token_id))
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(self.image_token)
        # The text that stands for one image in a prompt (the model's own markers around the token).
        start, end = (getattr(model_config, f"vision_{k}_token_id", None) for k in ("start", "end"))
        self.placeholder = self.image_token if start is None or end is None else \
            f"{tokenizer.convert_ids_to_tokens(start)}{self.image_token}{tokenizer.convert_ids_to_tokens(end)}"
        self.cache_bytes = int(config.mm_processor_cache_gb * 2**30)
        # LRU: hash -> (encoder inputs, placeholder tokens, M-RoPE grid)
        self._cache: OrderedDict[str, tuple[dict[str, Any], int, tuple[int, int, int] | None]] = OrderedDict()
        self._cached_bytes = 0

    def max_tokens_per_image(self) -> int:
        """The most placeholder tokens one image can take: a dynamic-resolution processor's largest
        image (``longest_edge`` pixels, in merged patches), else the processor's fixed count."""
        ip = self.image_processor
        size = getattr(ip, "size", None)
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        merge = getattr(ip, "merge_size", None)
        if merge and longest:
            return int(longest) // (ip.patch_size * merge) ** 2
        from PIL import Image

        return self._run(Image.new("RGB", (336, 336)))[1]  # (a fixed count: any image)

    def _process_image(self, image: Any, mm_hash: str) -> tuple[dict[str, Any], int, tuple[int, int, int] | None]:
        """``(encoder inputs, placeholder tokens, M-RoPE grid)`` of one image, from the cache when seen
        before. An image processor that reports a grid (Qwen2-VL's dynamic resolution) says how many
        rows the image makes (``t * h * w / merge^2``); else the processor, run on one placeholder,
        says it by expanding it."""
        hit = self._cache.get(mm_hash)
        if hit is not None:
            self._cache.move_to_end(mm_hash)
            return hit
        entry = self._run(image)
        size = sum(v.nbytes for v in entry[0].values())
        if size <= self.cache_bytes:
            self._cache[mm_hash] = entry
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, (old, _, _) = self._cache.popitem(last=False)
                self._cached_bytes -= sum(v.nbytes for v in old.values())
        return entry

    def _run(self, image: Any) -> tuple[dict[str, Any], int, tuple[int, int, int] | None]:
        image = image.convert("RGB")
        if self.hf is not None:  # the processor itself, on one placeholder: its count is the model's
            out = self.hf(text=self.image_token, images=[image], return_tensors="np")
        else:
            out = self.image_processor(images=[image], return_tensors="np")
        entry: tuple[dict[str, Any], int, tuple[int, int, int] | None]
        if "image_grid_thw" in out:
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            m = self.image_processor.merge_size
            entry = ({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]},
                     t * h * w // m ** 2, (t, h // m, w // m))
        else:
            entry = ({"pixel_values": out["pixel_values"][0]}, int((out["input_ids"][0] == self.image_token_id).sum()),
                     None)
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
            inputs, num, grid = self._process_image(image, mm_hash)
            if length not in (1, num):
                raise ValueError(f"image {len(features)}: {length} placeholder tokens in a run, but the image takes "
                                 f"{num} (give one {self.image_token!r} per image)")
            out += ids[prev:start]
            if self.cache_bytes == 0:  # caching off: this request's images are its own
                mm_hash = f"{mm_hash}:{request_id}"
            features.append(MultiModalFeature(mm_hash, len(out), num, inputs, mrope_grid=grid))
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
