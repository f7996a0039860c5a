"""data=debian_docs through its real path: a tiny .deb built here by `dpkg-deb --build` (the three packages' layouts),
fetched by an injected downloader, hash-checked, streamed through `dpkg-deb --fsys-tarfile` and prepared."""
import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from flash_forensics.orchestrator.data import DataConfig, DataError, debian
from flash_forensics.orchestrator.data.cache import sha256_file
from flash_forensics.orchestrator.data.corpora import open_corpus
from flash_forensics.orchestrator.data.prepare import ensure_prepared
from flash_forensics.orchestrator.data.tokenizer import gpt2_encoding

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None,
                                reason="needs dpkg-deb (Debian/Ubuntu: apt-get install dpkg) to build a test .deb")

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
ENTRIES = ["Abacus \\Ab\"a*cus\\, n. A frame with beads for counting.\n",
           "Abandon \\A*ban\"don\\, v. t. To give up wholly. It\u2019s gone.\n",  # a cp1252 quote, as gcide has
           "Zebra \\Ze\"bra\\, n. A striped African horse.\n"]
KERNEL_DOC = "Memory barriers\n===============\n\nA CPU may reorder loads and stores.\n"
PY_DOC = "The import system\n*****************\n\nPython code in one module gains access to another.\n"


def _b64(n: int) -> str:
    s = ""
    while True:
        s, n = B64[n % 64] + s, n // 64
        if n == 0:
            return s


def _dictd(entries):
    """(dict bytes, index text): a database-info entry first (skipped), an alias headword for the first entry."""
    info = b"00-database-info\n   converted for a test\n"
    blobs = [info] + [e.encode("cp1252") for e in entries]
    off, spans = 0, []
    for b in blobs:
        spans.append((off, len(b)))
        off += len(b)
    names = ["00-database-info", "abacus", "abandon", "zebra"]
    lines = [f"{n}\t{_b64(o)}\t{_b64(ln)}" for n, (o, ln) in zip(names, spans)]
    lines.append(f"abaci\t{_b64(spans[1][0])}\t{_b64(spans[1][1])}")  # same entry, second headword: read once
    return b"".join(blobs), "\n".join(sorted(lines)) + "\n"


@pytest.fixture(scope="module")
def tiny_deb(tmp_path_factory):
    root = tmp_path_factory.mktemp("deb") / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: ff-test-docs\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: test <t@example.invalid>\nDescription: test corpus\n")
    text, index = _dictd(ENTRIES)
    d = root / "usr/share/dictd"
    d.mkdir(parents=True)
    (d / "gcide.dict.dz").write_bytes(gzip.compress(text))
    (d / "gcide.index").write_text(index)
    k = root / "usr/share/doc/linux-doc-6.12/Documentation"
    (k / "core-api").mkdir(parents=True)
    (k / "core-api/barriers.rst.gz").write_bytes(gzip.compress(KERNEL_DOC.encode()))
    (k / "core-api/empty.rst.gz").write_bytes(gzip.compress(b"  \n"))  # whitespace only: no document
    (k / "translations/zh_CN").mkdir(parents=True)
    (k / "translations/zh_CN/barriers.rst.gz").write_bytes(gzip.compress("内存屏障\n".encode()))
    os.symlink("barriers.rst.gz", k / "core-api/link.rst.gz")  # not a regular file: skipped
    p = root / "usr/share/doc/python3.11/html"
    (p / "_sources/reference").mkdir(parents=True)
    (p / "_sources/reference/import.rst.txt").write_text(PY_DOC)
    (p / "reference.html").write_text("<html>not a source</html>")
    deb = root.parent / "ff-test-docs_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    return deb


@pytest.fixture
def pinned(tiny_deb, monkeypatch, tmp_path):
    """The three pins point at the tiny .deb; the downloader copies it (and counts its calls); a fresh cache."""
    sha = sha256_file(tiny_deb)
    pkgs = tuple(debian.DebPackage(p.name, "1.0", sha, p.licence, p.reader) for p in debian.PACKAGES)
    monkeypatch.setattr(debian, "PACKAGES", pkgs)
    calls = []

    def download(pkg, dest):
        calls.append(pkg.name)
        return Path(shutil.copy(tiny_deb, dest / tiny_deb.name))

    monkeypatch.setattr(debian, "DOWNLOADER", download)
    monkeypatch.setenv("FLASH_FORENSICS_CACHE", str(tmp_path / "cache"))
    gpt2_encoding()  # the BPE ranks come from the user cache, read before the cache moves
    return calls


def _cfg(tmp_path, **kw):
    return DataConfig(corpus="debian_docs", root=str(tmp_path / "data"), val_fraction=0.2, **kw)


def test_prepares_from_a_real_deb_fetched_once(pinned, tmp_path):
    folder = ensure_prepared(_cfg(tmp_path), 50304)
    m = json.loads((folder / "manifest.json").read_text())
    assert folder.name.startswith("debian_docs-") and m["corpus"] == "debian_docs"
    measured = m["source"]["measured"]
    # gcide: 3 entries (the database-info entry skipped, the alias read once), 1 of them cp1252
    assert measured["dict-gcide"]["documents"] == 3 and measured["dict-gcide"]["docs_not_utf8"] == 1
    assert measured["linux-doc-6.12"]["documents"] == 1  # translations/, the symlink and the blank file left out
    assert measured["python3.11-doc"]["documents"] == 1  # only html/_sources/**/*.txt
    assert measured["python3.11-doc"]["characters"] == len(PY_DOC)
    assert [(p["package"], p["version"], p["sha256"]) for p in m["source"]["packages"]] == \
        [(p.name, p.version, p.sha256) for p in debian.PACKAGES]
    assert sorted(pinned) == sorted(p.name for p in debian.PACKAGES)  # one download per package
    assert sum(m["split"]["docs"].values()) == 3 + 1 + 1  # each reader takes only its package's files

    ids = np.concatenate([np.fromfile(folder / "train.bin", np.uint16), np.fromfile(folder / "val.bin", np.uint16)])
    text = gpt2_encoding().decode(ids.astype(np.int64).tolist())
    assert "It\u2019s gone" in text and "A CPU may reorder" in text and "gains access to another" in text
    assert "内存屏障" not in text and "converted for a test" not in text and "not a source" not in text

    for p in debian.PACKAGES:  # cached, verified
        cached = debian.debs_dir() / f"{p.name}_{p.version}.deb"
        assert sha256_file(cached) == p.sha256
    pinned.clear()
    again = ensure_prepared(_cfg(tmp_path), 50304, force=True)
    assert again == folder and pinned == []  # the cache serves a second prepare: no fetch


def test_validation_time_opens_without_fetching(pinned, tmp_path, monkeypatch):
    def no_fetch(pkg, dest):
        raise AssertionError("fetched at open")

    monkeypatch.setattr(debian, "DOWNLOADER", no_fetch)
    a = open_corpus(_cfg(tmp_path))
    assert a.name == "debian_docs"
    pkgs = list(debian.PACKAGES)
    pkgs[0] = debian.DebPackage(pkgs[0].name, "2.0", pkgs[0].sha256, pkgs[0].licence, pkgs[0].reader)
    monkeypatch.setattr(debian, "PACKAGES", tuple(pkgs))
    assert open_corpus(_cfg(tmp_path)).fingerprint != a.fingerprint  # a new pin prepares a new folder


def test_hash_mismatch_is_refused_and_not_cached(pinned, tmp_path, monkeypatch):
    pkgs = list(debian.PACKAGES)
    pkgs[1] = debian.DebPackage(pkgs[1].name, pkgs[1].version, "0" * 64, pkgs[1].licence, pkgs[1].reader)
    monkeypatch.setattr(debian, "PACKAGES", tuple(pkgs))
    with pytest.raises(DataError,
                       match=r"linux-doc-6.12=1.0: the fetched .deb has sha256 [0-9a-f]{64}, but .* pins 0+"):
        ensure_prepared(_cfg(tmp_path), 50304)
    assert not (debian.debs_dir() / "linux-doc-6.12_1.0.deb").exists()
    assert not list((tmp_path / "data").glob("debian_docs-*"))  # nothing half-prepared


def _fake_bin(tmp_path, name, script):
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (b / name).write_text("#!/bin/sh\n" + script)
    (b / name).chmod(0o755)
    return b


def test_no_apt_get_says_where_to_prepare(pinned, tmp_path, monkeypatch):
    monkeypatch.setattr(debian, "DOWNLOADER", debian._apt_get_download)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(DataError,
                       match="needs `apt-get`.*prepare on a Debian/Ubuntu machine.*copy the prepared folder"):
        debian.deb_path(debian.PACKAGES[0])


def test_version_gone_is_named(pinned, tmp_path, monkeypatch):
    b = _fake_bin(tmp_path, "apt-get", "echo \"E: Version '1.0' for 'dict-gcide' was not found\" >&2; exit 100\n")
    monkeypatch.setattr(debian, "DOWNLOADER", debian._apt_get_download)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    lists = tmp_path / "lists"
    monkeypatch.setattr(debian, "APT_LISTS", lists)
    # stale or emptied lists: `apt-get update` comes first in the advice (it was all a stale machine needed)
    with pytest.raises(DataError, match=r"dict-gcide=1.0 .* is not in this machine's apt package lists .*holds no "
                                        r"package lists\): run `apt-get update` .*apt-cache policy dict-gcide"):
        debian.deb_path(debian.PACKAGES[0])
    lists.mkdir()
    (lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages").write_text("")
    old = __import__("time").time() - 40 * 86400
    os.utime(lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages", (old, old))
    with pytest.raises(DataError, match=r"last updated 40 days ago\): run `apt-get update`"):
        debian.deb_path(debian.PACKAGES[0])


def test_apt_get_download_runs_with_the_pinned_version(pinned, tiny_deb, tmp_path, monkeypatch):
    """The real downloader asks apt-get for name=version in the folder it is given (a fake apt-get records it)."""
    log = tmp_path / "argv"
    b = _fake_bin(tmp_path, "apt-get", f"echo \"$@\" > {log}; cp {tiny_deb} ./x_1.0_all.deb\n")
    monkeypatch.setattr(debian, "DOWNLOADER", debian._apt_get_download)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    got = debian.deb_path(debian.PACKAGES[2])
    assert log.read_text().split() == ["download", "python3.11-doc=1.0"]
    assert sha256_file(got) == debian.PACKAGES[2].sha256


def test_pins_are_the_packages_the_brief_names():
    names = {p.name: p for p in debian.PACKAGES}
    assert set(names) == {"dict-gcide", "linux-doc-6.12", "python3.11-doc"}
    assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 and p.version for p in debian.PACKAGES)
    assert set(p.reader for p in debian.PACKAGES) == set(debian.READERS)


def _apt_etc(tmp_path, monkeypatch, list_text="", sources_text=None):
    etc = tmp_path / "etc-apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(list_text)
    if sources_text is not None:
        (etc / "sources.list.d" / "debian.sources").write_text(sources_text)
    monkeypatch.setattr(debian, "APT_ETC", etc)
    return etc


def test_archive_uris_read_both_source_formats(tmp_path, monkeypatch):
    _apt_etc(tmp_path, monkeypatch,
             "# a comment\ndeb [arch=amd64 signed-by=/k.gpg] http://a.example/debian bookworm main\n"
             "deb-src http://src.example/debian bookworm main\ndeb http://a.example/debian/ bookworm-updates main\n",
             "Types: deb\nURIs: http://b.example/debian\nSuites: bookworm\n\n"
             "Types: deb deb-src\nURIs: http://c.example/sec http://d.example/sec\nSuites: bookworm-security\n\n"
             "Types: deb\nURIs: http://off.example/x\nEnabled: no\n")
    assert debian.archive_uris() == ["http://a.example/debian", "http://b.example/debian", "http://c.example/sec",
                                     "http://d.example/sec"]


def test_a_version_gone_from_the_lists_is_fetched_from_the_archives_pool(pinned, tiny_deb, tmp_path, monkeypatch):
    """apt-get says the pinned version is not found (a security update superseded in the lists); the pinned pool path
    under the second archive of the machine's apt sources still serves it: fetched from there, its sha256 checked."""
    b = _fake_bin(tmp_path, "apt-get", "echo \"E: Version '1.0' for 'linux-doc-6.12' was not found\" >&2; exit 100\n")
    monkeypatch.setattr(debian, "DOWNLOADER", debian._apt_get_download)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    pool = "pool/updates/main/l/linux-6.12/linux-doc-6.12_1.0_all.deb"
    sec = tmp_path / "archive-security"
    (sec / pool).parent.mkdir(parents=True)
    shutil.copy(tiny_deb, sec / pool)
    _apt_etc(tmp_path, monkeypatch, f"deb file://{tmp_path / 'archive-main'} bookworm main\n",
             f"Types: deb\nURIs: file://{sec}\nSuites: bookworm-security\n")
    pkg = dataclasses.replace(debian.PACKAGES[1], pool=pool)
    got = debian.deb_path(pkg)
    assert got == debian.debs_dir() / "linux-doc-6.12_1.0.deb" and sha256_file(got) == pkg.sha256
    # a pool file that is not the pinned one is refused, as apt's would be
    (sec / pool).write_bytes(b"not the pinned deb")
    got.unlink()
    with pytest.raises(DataError, match="has sha256 .* but orchestrator/data/debian.py pins"):
        debian.deb_path(pkg)
    # served nowhere: the error names the pool path and every archive tried, then the advice as before
    (sec / pool).unlink()
    with pytest.raises(DataError, match=r"not in this machine's apt package lists .*nor does the archives' pool serve "
                                        rf"{re.escape(pool)} \(file://.*archive-main/pool.*; file://.*archive-secu"
                                        r"rity/pool.*\): run `apt-get update`"):
        debian.deb_path(pkg)


def test_every_pin_names_its_pool_path():
    for p in debian.PACKAGES:
        assert p.pool.startswith("pool/") and p.pool.endswith(f"/{p.name}_{p.version}_all.deb"), p
