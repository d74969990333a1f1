"""Bad tar shards, one kind each: every one ends in one line naming the shard (and the
member), up front where the tar index tells (a file that is no tar, a member cut short, a
shard that ends early or holds a corrupt header), else when the sample is read (an image
that does not decode); with errors="skip" bad members are left out and named."""

from __future__ import annotations

import gzip
import io
import re
import tarfile

import pytest

from src.data.shards import TarShards
from src.errors import DataError
from src.runtime.inputs import tell_repeats

SAMPLES = 4


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _shard(path, images: dict[int, bytes] | None = None) -> bytes:
    """SAMPLES jpeg+caption pairs (`images` replaces some samples' image bytes); the tar's bytes."""
    with tarfile.open(path, "w") as tar:
        for i in range(SAMPLES):
            image = (images or {}).get(i, _jpeg(i))
            for name, data in ((f"{i:04d}.jpg", image), (f"{i:04d}.txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def _open(path, errors: str = "fail") -> TarShards:
    return TarShards(str(path), image_size=8, text_len=6, vocab=100, errors=errors)


def _member_offset(raw: bytes, name: str) -> int:
    """Where the header of member `name` starts in a tar's bytes."""
    return raw.index(name.encode())


def _corrupt(path, raw: bytes) -> None:
    at = _member_offset(raw, "0002.jpg")
    path.write_bytes(raw[:at] + b"garbage!" * 64 + raw[at + 512 :])


def _cut_in_data(path, raw: bytes) -> None:
    path.write_bytes(raw[: _member_offset(raw, "0003.jpg") + 512 + 100])  # 100 bytes of its image


def _cut_at_member(path, raw: bytes) -> None:
    path.write_bytes(raw[: _member_offset(raw, "0003.jpg")])  # whole members, no end-of-archive blocks


UP_FRONT = {
    "not a tar": (lambda path, raw: path.write_bytes(b"not a tar at all" * 40), r"shard \S+: not a readable tar file \(ReadError"),
    "empty file": (lambda path, raw: path.write_bytes(b""), r"shard \S+: an empty file \("),
    "truncated gzip": (
        lambda path, raw: path.write_bytes(gzip.compress(raw)[:-200]),
        r"shard \S+: unreadable after member \S+ \((EOFError|ReadError)",
    ),
    "cut in a member's data": (_cut_in_data, r"shard \S+ member 0003\.jpg: cut short: its data ends at byte \d+, the file at \d+"),
    "cut at a member's end": (_cut_at_member, r"shard \S+: ends at byte \d+ after member 0002\.txt, without tar's end-of-archive"),
    "corrupt header": (_corrupt, r"shard \S+: has an unreadable tar header at byte \d+ after member 0001\.txt"),
}


@pytest.mark.parametrize("kind", list(UP_FRONT))
def test_a_bad_shard_is_named_up_front(tmp_path, kind):
    write, line = UP_FRONT[kind]
    path = tmp_path / "bad.tar"
    raw = _shard(tmp_path / "good.tar")
    (tmp_path / "good.tar").unlink()
    write(path, raw)
    with pytest.raises(DataError) as raised:
        _open(path)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message
    assert re.search(line, message), message


@pytest.mark.parametrize(
    "image, reason",
    [
        (b"not an image", r"not a decodable image \(UnidentifiedImageError: cannot identify image file\)"),
        (_jpeg(1)[:200], r"not a decodable image \(OSError: (Truncated File Read|image file is truncated)"),
        (b"", r"not a decodable image \(UnidentifiedImageError"),
    ],
    ids=["not an image", "truncated jpeg", "empty member"],
)
def test_a_member_that_does_not_decode_is_named_when_read(tmp_path, image, reason):
    path = tmp_path / "shard.tar"
    _shard(path, {1: image})
    shards = _open(path)
    shards[0]
    with pytest.raises(DataError) as raised:
        shards[1]
    assert str(raised.value).startswith(f"backend.data: shard {path} member 0001.jpg: ")
    assert re.search(reason, str(raised.value)), str(raised.value)


def test_skip_leaves_bad_members_out_and_names_them(tmp_path, capsys):
    raw = _shard(tmp_path / "a.tar", {1: b"not an image"})
    _cut_in_data(tmp_path / "b.tar", raw)  # its 0001.jpg does not decode either, its 0003.jpg is cut
    shards = _open(tmp_path / "*.tar", errors="skip")
    assert len(shards) == 2 * SAMPLES - 1  # b.tar's cut member is not indexed
    assert shards.skipped == {f"{tmp_path}/b.tar:0003.jpg"}
    reads = [shards[i]["ids"].tolist() for i in range(len(shards))]
    assert reads[1] == reads[2]  # a.tar's 0001 gives way to 0002
    assert shards.skipped == {f"{tmp_path}/b.tar:0003.jpg", f"{tmp_path}/a.tar:0001.jpg", f"{tmp_path}/b.tar:0001.jpg"}
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("backend.data_errors=skip: leaving out shard ") for line in lines)


def test_repeating_samples_to_fill_the_run_is_said_in_one_line(tmp_path, capsys):
    _shard(tmp_path / "small.tar")
    shards = _open(tmp_path / "small.tar")
    tell_repeats(shards, global_batch=SAMPLES, steps=1)
    assert capsys.readouterr().err == ""
    tell_repeats(shards, global_batch=8, steps=12)
    assert capsys.readouterr().err == (
        "backend.data: 4 samples for 12 steps of 8: each sample is read 24 times on average (epochs wrap around)\n"
    )
