"""Real image-caption pairs from webdataset-style tar shards.

A shard is a tar file whose members are grouped by key: `<key>.jpg|.jpeg|.png` (the image)
and `<key>.txt` (the caption). Shards are indexed once (member headers only) so any global
sample index can be read, in shard order. Images are resized to the model's size and
normalised per channel; captions are byte-level tokens folded into the vocabulary,
padded with 0 or cut to the text length.
"""

from __future__ import annotations

import glob
import io
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from src.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class _Sample:
    shard: Path
    image: str
    caption: str


def _index_shard(path: Path) -> list[_Sample]:
    with tarfile.open(path) as tar:
        members: dict[str, dict[str, str]] = {}
        for member in tar.getmembers():
            if not member.isfile():
                continue
            key, dot, suffix = member.name.rpartition(".")
            if dot:
                members.setdefault(key, {})["." + suffix.lower()] = member.name
    samples = []
    for key in sorted(members):
        files = members[key]
        image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)
        if image is not None and ".txt" in files:
            samples.append(_Sample(path, image, files[".txt"]))
    return samples


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    """A regular member's bytes (the index keeps regular files only)."""
    handle = tar.extractfile(name)
    assert handle is not None, f"{name} is not a regular file"
    return handle.read()


def tokenize(text: str, length: int, vocab: int) -> torch.Tensor:
    """Byte-level tokens (1 + byte, folded into the vocabulary; 0 pads)."""
    ids = [1 + (b % (vocab - 1)) for b in text.encode("utf-8")][:length]
    return torch.tensor(ids + [0] * (length - len(ids)), dtype=torch.long)


@dataclass
class TarShards:
    pattern: str
    image_size: int
    text_len: int
    vocab: int
    _samples: list[_Sample] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        paths = sorted(Path(p) for p in glob.glob(self.pattern))
        if not paths:
            raise ConfigError(f"backend.data={self.pattern!r} matches no tar shards")
        self._samples = [s for p in paths for s in _index_shard(p)]
        if not self._samples:
            raise ConfigError(f"backend.data={self.pattern!r}: {len(paths)} shards but no image+caption pairs")

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, caption = self.read(index)
        return {"images": pixels(image, self.image_size), "ids": tokenize(caption, self.text_len, self.vocab)}

    def read(self, index: int) -> tuple[Any, str]:
        """The sample's decoded RGB image (a PIL image) and its caption."""
        from PIL import Image  # only shard runs need it

        sample = self._samples[index % len(self._samples)]  # epochs wrap around
        with tarfile.open(sample.shard) as tar:
            image_bytes = _member(tar, sample.image)
            caption = _member(tar, sample.caption).decode("utf-8", errors="replace")
        return Image.open(io.BytesIO(image_bytes)).convert("RGB"), caption


def pixels(image: Any, size: int) -> torch.Tensor:
    """A PIL image resized to size x size, as (3, size, size), normalised per channel."""
    resized = image.resize((size, size))
    values = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).float()
    values = values.reshape(size, size, 3).permute(2, 0, 1) / 255.0
    return (values - values.mean(dim=(1, 2), keepdim=True)) / (values.std(dim=(1, 2), keepdim=True) + 1e-6)
