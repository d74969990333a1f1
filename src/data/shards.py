"""Real image-caption pairs from webdataset-style tar shards.

A shard is a tar file whose members are grouped by key: `<key>.jpg|.jpeg|.png` (the image)
and `<key>.txt` (the caption). Shards are indexed once (member headers only) so any global
sample index can be read, in shard order. Images are resized to the model's size and
normalised per channel; captions are byte-level tokens folded into the vocabulary,
padded with 0 or cut to the text length.

Bad data is named, never trained around unsaid. What the index can tell is checked up
front: a file that is no tar, a member cut short, a shard that ends before tar's
end-of-archive blocks (a truncated copy: tarfile itself would silently read fewer
samples). A member that does not decode fails at the step that reads it. Either is a
DataError naming the shard and member, unless `errors="skip"` (webdataset's habit): then
the bad member is left out (a sample that cannot be read gives way to the next one in
shard order) and named in `skipped`, which the run's summary counts.
"""

from __future__ import annotations

import glob
import io
import re
import sys
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from src.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
ERRORS = ("fail", "skip")
END_BLOCKS = 1024  # tar ends with two 512-byte blocks of zeros
# What reading a shard raises when its bytes are not what they claim to be.
UNREADABLE = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError, SyntaxError)


@dataclass(frozen=True)
class _Sample:
    shard: Path
    image: str
    caption: str
    # Each member's (data offset, size) in an uncompressed shard, read directly; None in a
    # compressed one, which is read through tarfile.
    spans: tuple[tuple[int, int], tuple[int, int]] | None = None


def _reason(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0].rstrip(":")
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", text)  # PIL names the buffer it could not identify
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _members(path: Path) -> tuple[list[tarfile.TarInfo], dict[str, str], str | None, bool]:
    """A shard's whole members, its cut ones (name -> why), why the rest of the shard
    cannot be read (if it cannot), and whether it is uncompressed. tarfile stops without
    a word at a header it cannot read (past the first), so an uncompressed shard's end is
    checked here: tar's two blocks of zeros must follow the last member."""
    members: list[tarfile.TarInfo] = []
    with tarfile.open(path) as tar:
        compressed = not isinstance(tar.fileobj, io.BufferedReader)  # offsets then count decompressed bytes
        try:
            for member in tar:
                members.append(member)
            broken = None
        except UNREADABLE as err:  # a cut or corrupt stream
            broken = _reason(err)
        last = f"after member {members[-1].name}" if members else "at its start"
        if compressed:
            # Where a compressed stream breaks, its last member may be cut: it is not kept.
            return members[:-1] if broken else members, {}, broken and f"unreadable {last} ({broken})", False
        size = path.stat().st_size
        cut = {
            m.name: f"cut short: its data ends at byte {m.offset_data + m.size}, the file at {size}"
            for m in members
            if m.offset_data + m.size > size
        }
        if cut:
            return [m for m in members if m.name not in cut], cut, None, True
        assert tar.fileobj is not None
        tar.fileobj.seek(tar.offset)
        tail = tar.fileobj.read(END_BLOCKS)
    if len(tail) < END_BLOCKS:
        return members, {}, f"ends at byte {size} {last}, without tar's end-of-archive blocks: a truncated copy", True
    if tail.strip(b"\0"):
        return members, {}, f"has an unreadable tar header at byte {tar.offset} {last}: a corrupt or truncated copy", True
    return members, {}, None, True


def _index_shard(path: Path, errors: str, skipped: set[str]) -> list[_Sample]:
    def bad(where: str, why: str, skip_as: str) -> None:
        if errors == "fail":
            raise DataError(f"backend.data: {where}: {why} (backend.data_errors=skip leaves bad members out)")
        skipped.add(skip_as)
        print(f"backend.data_errors=skip: leaving out {where}: {why}", file=sys.stderr, flush=True)

    try:
        members, cut, broken, plain = _members(path)
    except UNREADABLE as err:
        empty = path.is_file() and path.stat().st_size == 0
        bad(f"shard {path}", "an empty file" if empty else f"not a readable tar file ({_reason(err)})", str(path))
        return []
    for name, why in cut.items():
        bad(f"shard {path} member {name}", why, f"{path}:{name}")
    if broken:
        bad(f"shard {path}", broken, f"{path}:(what follows its last whole member)")
    grouped: dict[str, dict[str, str]] = {}
    for member in members:
        key, dot, suffix = member.name.rpartition(".")
        if member.isfile() and dot:
            grouped.setdefault(key, {})["." + suffix.lower()] = member.name
    spans = {m.name: (m.offset_data, m.size) for m in members} if plain else None
    samples = []
    for key in sorted(grouped):
        files = grouped[key]
        image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)
        if image is not None and ".txt" in files:
            at = (spans[image], spans[files[".txt"]]) if spans is not None else None
            samples.append(_Sample(path, image, files[".txt"], at))
    return samples


def _read_members(sample: _Sample) -> tuple[bytes, bytes]:
    """The sample's image and caption bytes; a shard read short is an error (it changed
    or was cut after it was indexed)."""
    if sample.spans is None:
        with tarfile.open(sample.shard) as tar:
            handles = [tar.extractfile(name) for name in (sample.image, sample.caption)]
            assert all(handles), "the index keeps regular files only"
            return handles[0].read(), handles[1].read()  # type: ignore[union-attr]
    out = []
    with open(sample.shard, "rb") as shard:
        for offset, size in sample.spans:
            shard.seek(offset)
            data = shard.read(size)
            if len(data) < size:
                raise EOFError(f"read {len(data)} of its {size} bytes at byte {offset}")
            out.append(data)
    return out[0], out[1]


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
    errors: str = "fail"  # fail | skip (backend.data_errors)
    # Members left out so far (`shard:member`; a whole shard by its path): at indexing, in
    # every process alike; at reading, in the process that read them.
    skipped: set[str] = field(default_factory=set)
    _samples: list[_Sample] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.errors not in ERRORS:
            raise ConfigError(f"backend.data_errors={self.errors!r}; choose one of {list(ERRORS)}")
        paths = sorted(Path(p) for p in glob.glob(self.pattern))
        if not paths:
            raise ConfigError(f"backend.data={self.pattern!r} matches no tar shards")
        self._samples = [s for p in paths for s in _index_shard(p, self.errors, self.skipped)]
        if not self._samples:
            raise DataError(f"backend.data={self.pattern!r}: {len(paths)} shard(s) but no readable image+caption pairs")

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, caption = self.read(index)
        return {"images": pixels(image, self.image_size), "ids": tokenize(caption, self.text_len, self.vocab)}

    def read(self, index: int) -> tuple[Any, str]:
        """The sample's decoded RGB image (a PIL image) and its caption; epochs wrap around.
        Skipping bad members, the first readable sample from `index` on, in shard order."""
        for offset in range(len(self._samples)):
            sample = self._samples[(index + offset) % len(self._samples)]
            try:
                return _decoded(sample)
            except DataError as err:
                if self.errors == "fail":
                    raise
                if f"{sample.shard}:{sample.image}" not in self.skipped:
                    self.skipped.add(f"{sample.shard}:{sample.image}")
                    where = str(err).removeprefix("backend.data: ")
                    print(f"backend.data_errors=skip: leaving out {where}", file=sys.stderr, flush=True)
        raise DataError(f"backend.data={self.pattern!r}: none of its {len(self._samples)} samples can be read")


def _decoded(sample: _Sample) -> tuple[Any, str]:
    from PIL import Image  # only shard runs need it

    where = f"shard {sample.shard} member {sample.image}"
    try:
        image_bytes, caption_bytes = _read_members(sample)
    except UNREADABLE as err:
        raise DataError(f"backend.data: {where}: cannot be read ({_reason(err)})") from None
    try:
        # Decoded here, in full: PIL opens lazily and would fail later, wherever pixels are first read.
        return Image.open(io.BytesIO(image_bytes)).convert("RGB"), caption_bytes.decode("utf-8", errors="replace")
    except (*UNREADABLE, Image.DecompressionBombError) as err:
        raise DataError(f"backend.data: {where}: not a decodable image ({_reason(err)})") from None


def pixels(image: Any, size: int) -> torch.Tensor:
    """A PIL image resized to size x size, as (3, size, size), normalised per channel."""
    resized = image.resize((size, size))
    values = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).float()
    values = values.reshape(size, size, 3).permute(2, 0, 1) / 255.0
    return (values - values.mean(dim=(1, 2), keepdim=True)) / (values.std(dim=(1, 2), keepdim=True) + 1e-6)
