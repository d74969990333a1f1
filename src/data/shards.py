"""Real image-caption pairs from webdataset-style tar shards.

A shard is a tar file whose members are grouped by key: `<key>.jpg|.jpeg|.png` (the image)
and `<key>.txt` (the caption). An MLLM's shards (`images="several"`) group members by the
name up to its first dot, as webdataset does: a sample is `<key>.txt` and any number of
images `<key>.<i>.jpg` (or `<key>.jpg`), in name order; one without text is bad data.
Shards are indexed once (member headers only) so any global sample index can be read, in
shard order. Images are resized to the model's size and normalised per channel; captions
are byte-level tokens folded into the vocabulary, padded with 0 or cut to the text length.

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
from typing import Any, Callable

import torch

from src.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
ERRORS = ("fail", "skip")
END_BLOCKS = 1024  # tar ends with two 512-byte blocks of zeros
# What reading a shard raises when its bytes are not what they claim to be.
UNREADABLE = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError, SyntaxError)


IMAGES = ("one", "several")  # per sample: an image-caption pair, or an MLLM's sequence


@dataclass(frozen=True)
class _Sample:
    shard: Path
    images: tuple[str, ...]
    caption: str
    # Each member's (data offset, size) in an uncompressed shard, read directly, the
    # caption's last; None in a compressed one, which is read through tarfile.
    spans: tuple[tuple[int, int], ...] | None = None


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


def _index_shard(path: Path, errors: str, skipped: set[str], images: str = "one") -> list[_Sample]:
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
    spans = {m.name: (m.offset_data, m.size) for m in members} if plain else None
    if images == "several":
        return _several(path, members, spans, bad)
    grouped: dict[str, dict[str, str]] = {}
    for member in members:
        key, dot, suffix = member.name.rpartition(".")
        if member.isfile() and dot:
            grouped.setdefault(key, {})["." + suffix.lower()] = member.name
    samples = []
    for key in sorted(grouped):
        files = grouped[key]
        image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)
        if image is not None and ".txt" in files:
            at = (spans[image], spans[files[".txt"]]) if spans is not None else None
            samples.append(_Sample(path, (image,), files[".txt"], at))
    return samples


def _several(path: Path, members: list[tarfile.TarInfo], spans: dict | None, bad: Callable[[str, str, str], None]) -> list[_Sample]:
    """An MLLM shard's samples: a key's text and its images (none to several)."""
    grouped: dict[str, list[str]] = {}
    for member in members:
        if member.isfile() and "." in member.name.rpartition("/")[2]:
            directory, _, base = member.name.rpartition("/")
            grouped.setdefault(f"{directory}/{base.split('.')[0]}" if directory else base.split(".")[0], []).append(member.name)
    samples = []
    for key in sorted(grouped):
        names = sorted(grouped[key])
        images = tuple(n for n in names if n.lower().endswith(IMAGE_SUFFIXES))
        caption = next((n for n in names if n.lower().endswith(".txt")), None)
        if caption is None:
            if images:
                bad(f"shard {path} sample {key}", f"{len(images)} image(s) but no text ({key}.txt)", f"{path}:{key}")
            continue
        at = tuple(spans[n] for n in (*images, caption)) if spans is not None else None
        samples.append(_Sample(path, images, caption, at))
    return samples


def _read_members(sample: _Sample) -> list[bytes]:
    """The sample's images' and caption's bytes (the caption's last); a shard read short
    is an error (it changed or was cut after it was indexed)."""
    names = (*sample.images, sample.caption)
    if sample.spans is None:
        with tarfile.open(sample.shard) as tar:
            handles = [tar.extractfile(name) for name in names]
            assert all(handles), "the index keeps regular files only"
            return [h.read() for h in handles]  # type: ignore[union-attr]
    out = []
    with open(sample.shard, "rb") as shard:
        for offset, size in sample.spans:
            shard.seek(offset)
            data = shard.read(size)
            if len(data) < size:
                raise EOFError(f"read {len(data)} of its {size} bytes at byte {offset}")
            out.append(data)
    return out


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
    images: str = "one"  # one | several (an MLLM's sequences: none to several images)
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
        self._samples = [s for p in paths for s in _index_shard(p, self.errors, self.skipped, self.images)]
        if not self._samples:
            raise DataError(f"backend.data={self.pattern!r}: {len(paths)} shard(s) but no readable image+caption pairs")

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        (image,), caption = self.read(index)
        return {"images": pixels(image, self.image_size), "ids": tokenize(caption, self.text_len, self.vocab)}

    def where(self, index: int) -> str:
        sample = self._samples[index % len(self._samples)]
        return f"shard {sample.shard} sample {sample.caption.rpartition('.')[0]}"

    def image_count(self, index: int) -> int:
        """How many images sample `index` holds, from the index (no decoding)."""
        return len(self._samples[index % len(self._samples)].images)

    def read(self, index: int) -> tuple[list[Any], str]:
        """The sample's decoded RGB images (PIL images) and its caption; epochs wrap around.
        Skipping bad members, the first readable sample from `index` on, in shard order."""
        for offset in range(len(self._samples)):
            sample = self._samples[(index + offset) % len(self._samples)]
            try:
                return _decoded(sample)
            except _BadMember as err:
                if self.errors == "fail":
                    raise DataError(str(err)) from None  # the public class: it names the error line and pickles to a trainer
                if f"{sample.shard}:{err.member}" not in self.skipped:
                    self.skipped.add(f"{sample.shard}:{err.member}")
                    where = str(err).removeprefix("backend.data: ")
                    print(f"backend.data_errors=skip: leaving out {where}", file=sys.stderr, flush=True)
        raise DataError(f"backend.data={self.pattern!r}: none of its {len(self._samples)} samples can be read")


class _BadMember(DataError):
    def __init__(self, sample: _Sample, member: str, why: str) -> None:
        super().__init__(f"backend.data: shard {sample.shard} member {member}: {why}")
        self.member = member


def _decoded(sample: _Sample) -> tuple[list[Any], str]:
    from PIL import Image  # only shard runs need it

    try:
        *image_bytes, caption_bytes = _read_members(sample)
    except UNREADABLE as err:
        first = sample.images[0] if sample.images else sample.caption
        raise _BadMember(sample, first, f"cannot be read ({_reason(err)})") from None
    images = []
    for name, data in zip(sample.images, image_bytes):
        try:
            # Decoded here, in full: PIL opens lazily and would fail later, wherever pixels are first read.
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
        except (*UNREADABLE, Image.DecompressionBombError) as err:
            raise _BadMember(sample, name, f"not a decodable image ({_reason(err)})") from None
    return images, caption_bytes.decode("utf-8", errors="replace")


def pixels(image: Any, size: int) -> torch.Tensor:
    """A PIL image resized to size x size, as (3, size, size), normalised per channel."""
    resized = image.resize((size, size))
    values = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).float()
    values = values.reshape(size, size, 3).permute(2, 0, 1) / 255.0
    return (values - values.mean(dim=(1, 2), keepdim=True)) / (values.std(dim=(1, 2), keepdim=True) + 1e-6)
