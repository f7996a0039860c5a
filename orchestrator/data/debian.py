"""data.corpus=debian_docs: an offline English corpus of ~27M GPT-2 tokens from three Debian packages (the corpus of
experiment=paper_1gpu).

- dict-gcide: the GNU Collaborative International Dictionary of English (usr/share/dictd/gcide.dict.dz, gzip-readable,
  split into its entries by the dictd index next to it; one document per entry);
- linux-doc-6.12: the kernel's reStructuredText documentation (Documentation/**/*.rst.gz, without translations/);
- python3.11-doc: the Python 3.11 documentation sources (html/_sources/**/*.txt).

Each .deb is fetched once with `apt-get download <pkg>=<pinned version>` into <cache>/corpora/debian/ (where apt's
lists no longer carry the pinned version, from its pinned path in the pool of each archive this machine's apt sources
name: a version dropped from the lists can still lie there), checked against its pinned sha256 and read by streaming
`dpkg-deb --fsys-tarfile` into Python's tarfile: nothing is installed or unpacked to disk. Fetching happens only
while documents are read (prepare), never when a config is validated, so a machine that has the prepared folder
needs neither apt nor the packages.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

from flash_forensics.orchestrator.data.cache import cache_dir, sha256_file
from flash_forensics.orchestrator.data.config import Corpus, DataError


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    sha256: str  # of the .deb, as the archive's Packages index lists it
    licence: str  # what the package's usr/share/doc/<pkg>/copyright says
    reader: str  # key of READERS: how its members become documents
    pool: str = ""  # its path under an archive's root (the Packages index's Filename): the fallback when apt's lists
    # lack the version (not part of the corpus fingerprint: where a file comes from, not what it holds)


PACKAGES: Tuple[DebPackage, ...] = (
    DebPackage("dict-gcide", "0.48.5+nmu2", "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
               "GPL-2+ (usr/share/doc/dict-gcide/copyright: GCIDE under the GNU GPL version 2 or any later version; "
               "derived from Webster's Revised Unabridged Dictionary (1913) and WordNet)", "gcide",
               "pool/main/d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb"),
    DebPackage("linux-doc-6.12", "6.12.117-1~deb12u1",
               "6a73937ac1a8ab586b9399b6a67df3cc24e66e637824a97ca97b5f94b47ae40e",
               "GPL-2 (usr/share/doc/linux-doc-6.12/copyright: 'Files: * ... License: GPL-2', Linus Torvalds and "
               "many others)", "linux_doc",
               # a security update: gone from bookworm-security's lists once 6.12.118 came, still in its pool
               "pool/updates/main/l/linux-6.12/linux-doc-6.12_6.12.117-1~deb12u1_all.deb"),
    DebPackage("python3.11-doc", "3.11.2-6+deb12u8", "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
               "PSF License Agreement for Python (usr/share/doc/python3.11-doc/copyright: the Python License, "
               "history and PSF licence text)", "python_doc",
               "pool/main/p/python3.11/python3.11-doc_3.11.2-6+deb12u8_all.deb"),
)
FORMAT_VERSION = 1  # bump when the reading (member selection, entry split, decoding) changes


def _apt_get_download(pkg: DebPackage, dest: Path) -> Path:
    """`apt-get download pkg=version` into dest (no root needed); the path of the .deb it wrote."""
    if shutil.which("apt-get") is None:
        raise DataError(f"data.corpus=debian_docs needs `apt-get` to fetch {pkg.name}={pkg.version} once, and this "
                        f"machine has none: prepare on a Debian/Ubuntu machine (`flash-forensics data prepare "
                        f"data=debian_docs`) and copy the prepared folder (or {debs_dir()}) here")
    try:
        proc = subprocess.run(["apt-get", "download", f"{pkg.name}={pkg.version}"], cwd=dest, capture_output=True,
                              text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"`apt-get download {pkg.name}={pkg.version}` failed: {e}") from e
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        if re.search(r"not found|Unable to locate|Can't select|has no installation candidate", err):
            # what apt knows is its package lists: stale (or emptied, as in container images) they miss a version
            # the archive serves, and `apt-get update` is the fix far more often than a new pin. A version dropped
            # from current lists often still lies in the archive's pool: that path is tried before giving up
            tried = []
            got = _pool_download(pkg, dest, tried)
            if got is not None:
                return got
            pool = (f"; nor does the archives' pool serve {pkg.pool} ({'; '.join(tried)})" if tried else
                    f"; no archive in this machine's apt sources ({APT_ETC}) to fetch {pkg.pool} from" if pkg.pool
                    else "")
            raise DataError(f"{pkg.name}={pkg.version} (pinned in orchestrator/data/debian.py) is not in this "
                            f"machine's apt package lists ({err.splitlines()[-1]}; {_lists_age()}){pool}: run "
                            f"`apt-get update` (as root) and prepare again; only if it is still missing then has the "
                            f"archive dropped it (see `apt-cache policy {pkg.name}`), and a new pin (version + "
                            f"sha256) prepares a new corpus folder")
        raise DataError(f"`apt-get download {pkg.name}={pkg.version}` failed (exit {proc.returncode}): "
                        f"{' | '.join(err.splitlines()[-3:])}")
    debs = sorted(dest.glob("*.deb"))
    if len(debs) != 1:
        raise DataError(f"`apt-get download {pkg.name}={pkg.version}` left {len(debs)} .deb files in {dest}")
    return debs[0]


APT_LISTS = Path("/var/lib/apt/lists")
APT_ETC = Path("/etc/apt")  # sources.list and sources.list.d/: the archives this machine's apt fetches from


def archive_uris() -> list:
    """The archive roots (URIs of `deb` entries) in this machine's apt sources, in their order, each once: one-line
    sources.list / *.list entries and deb822 *.sources stanzas (Types: deb ... URIs: ...)."""
    uris = []
    files = [APT_ETC / "sources.list", *sorted((APT_ETC / "sources.list.d").glob("*.list"))]
    for f in files:
        if f.is_file():
            for line in f.read_text(errors="replace").splitlines():
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()  # options in [...] dropped
                if len(words) >= 2 and words[0] == "deb":
                    uris.append(words[1])
    for f in sorted((APT_ETC / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", f.read_text(errors="replace")):
            fields = dict(m.groups() for m in re.finditer(r"(?m)^([A-Za-z-]+):[ \t]*(.*)$", stanza))
            if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes").lower() != "no":
                uris.extend(fields.get("URIs", "").split())
    return list(dict.fromkeys(u.rstrip("/") for u in uris))


def _pool_download(pkg: DebPackage, dest: Path, tried: list) -> Optional[Path]:
    """pkg's .deb from <archive>/<pkg.pool> under the first of archive_uris() that serves it, into dest (its sha256
    is checked by the caller); None when none does (each failure said in `tried`)."""
    if not pkg.pool:
        return None
    for uri in archive_uris():
        url = f"{uri}/{pkg.pool}"
        out = dest / Path(pkg.pool).name
        try:
            with urllib.request.urlopen(url, timeout=120) as r, open(out, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
            return out
        except (urllib.error.URLError, OSError, ValueError) as e:
            out.unlink(missing_ok=True)
            tried.append(f"{url}: {getattr(e, 'reason', None) or e}")
    return None


def _lists_age() -> str:
    """How old the apt package lists are, in words (their newest Packages file), or that there are none."""
    import time
    lists = list(APT_LISTS.glob("*Packages*")) if APT_LISTS.is_dir() else []
    if not lists:
        return f"{APT_LISTS} holds no package lists"
    days = (time.time() - max(p.stat().st_mtime for p in lists)) / 86400
    return f"the lists in {APT_LISTS} were last updated {days:.0f} days ago"


# The downloader: (package, empty folder) -> the .deb it put there. Tests inject one that copies a local file.
DOWNLOADER: Callable[[DebPackage, Path], Path] = _apt_get_download


def debs_dir() -> Path:
    return cache_dir() / "corpora" / "debian"


def deb_path(pkg: DebPackage) -> Path:
    """The cached, hash-verified .deb of pkg; fetched once with DOWNLOADER when missing."""
    path = debs_dir() / f"{pkg.name}_{pkg.version}.deb"
    if path.is_file():
        if sha256_file(path) == pkg.sha256:
            return path
        path.unlink()  # a stale or partial copy: fetch again rather than read it
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ff-deb-", dir=path.parent) as tmp:
        got = DOWNLOADER(pkg, Path(tmp))
        digest = sha256_file(got)
        if digest != pkg.sha256:
            raise DataError(f"{pkg.name}={pkg.version}: the fetched .deb has sha256 {digest}, but "
                            f"orchestrator/data/debian.py pins {pkg.sha256}; not used (a rebuilt package or a "
                            f"wrong mirror: check `apt-cache show {pkg.name}={pkg.version}`)")
        os.replace(got, path)
    return path


def deb_members(deb: Path, wanted: Callable[[str], bool]) -> Iterator[Tuple[str, bytes]]:
    """(path, bytes) of the regular files in deb's data archive whose path passes wanted, in archive order."""
    if shutil.which("dpkg-deb") is None:
        raise DataError(f"data.corpus=debian_docs reads {deb.name} with `dpkg-deb`, which this machine lacks: "
                        f"install dpkg, or prepare on a Debian/Ubuntu machine and copy the prepared folder here")
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:  # a stream: one pass, nothing on disk
            for m in tar:
                name = m.name[2:] if m.name.startswith("./") else m.name
                if m.isfile() and wanted(name):
                    yield name, tar.extractfile(m).read()
    except tarfile.TarError as e:
        raise DataError(f"{deb}: its data archive is unreadable ({e}); delete it to fetch it again") from e
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace").strip()
        rc = proc.wait()
    if rc != 0:
        raise DataError(f"`dpkg-deb --fsys-tarfile {deb}` failed (exit {rc}): {err}")


def _decode(data: bytes, stats: Dict[str, int]) -> str:
    """UTF-8; the few legacy bytes (gcide has three cp1252 quotes) decode as cp1252 and are counted, not dropped."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats["docs_not_utf8"] = stats.get("docs_not_utf8", 0) + 1
        return data.decode("cp1252", errors="replace")


# ----------------------------------------------------------------------------------- one reader per package
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(s: str) -> int:
    """dictd's index numbers: base64 digits, most significant first, no padding."""
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def _gcide_docs(deb: Path, stats: Dict[str, int]) -> Iterator[str]:
    files = dict(deb_members(deb, lambda n: n in ("usr/share/dictd/gcide.dict.dz", "usr/share/dictd/gcide.index")))
    if len(files) != 2:
        raise DataError(f"{deb.name} holds no usr/share/dictd/gcide.dict.dz + gcide.index")
    text = gzip.decompress(files["usr/share/dictd/gcide.dict.dz"])  # dictzip is gzip with a seek table
    spans = set()
    for line in files["usr/share/dictd/gcide.index"].decode("utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-database") and not parts[0].startswith("00database"):
            spans.add((_dictd_number(parts[1]), _dictd_number(parts[2])))  # headwords sharing an entry: once
    for off, length in sorted(spans):
        doc = _decode(text[off:off + length], stats)
        if doc.strip():
            yield doc


def _file_docs(prefix: str, suffix: str, exclude: Optional[str], gz: bool):
    def docs(deb: Path, stats: Dict[str, int]) -> Iterator[str]:
        def wanted(n: str) -> bool:
            return n.startswith(prefix) and n.endswith(suffix) and not (exclude and n.startswith(exclude))

        for _, data in deb_members(deb, wanted):
            doc = _decode(gzip.decompress(data) if gz else data, stats)
            if doc.strip():
                yield doc
    return docs


READERS = {
    "gcide": _gcide_docs,
    "linux_doc": _file_docs("usr/share/doc/linux-doc-6.12/Documentation/", ".rst.gz",
                            "usr/share/doc/linux-doc-6.12/Documentation/translations/", gz=True),
    "python_doc": _file_docs("usr/share/doc/python3.11/html/_sources/", ".txt", None, gz=False),
}


def debian_docs_corpus(cfg):

    pins = [{"package": p.name, "version": p.version, "sha256": p.sha256, "licence": p.licence, "reader": p.reader}
            for p in PACKAGES]
    source = {"kind": "debian_docs", "packages": pins, "format_version": FORMAT_VERSION,
              "fetch": "apt-get download <package>=<version>; read with dpkg-deb --fsys-tarfile"}
    fingerprint = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()
    measured: Dict[str, dict] = {}
    source["measured"] = measured  # filled while reading: the manifest (written after tokenizing) carries it

    def docs() -> Iterator[str]:
        for p in PACKAGES:
            stats = measured.setdefault(p.name, {"documents": 0, "characters": 0})
            for doc in READERS[p.reader](deb_path(p), stats):
                stats["documents"] += 1
                stats["characters"] += len(doc)
                yield doc

    return Corpus("debian_docs", source, fingerprint, docs)
