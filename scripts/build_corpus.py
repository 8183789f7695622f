"""Build ``jobs/data/corpus.txt``: an offline English corpus for workloads and tokenizers.

The corpus ships with the package so that tokenizer training (:mod:`jobs.modelgen.generator`) and
workload generation (:mod:`jobs.load.workload`) never need a download. It is built once from
text available on any Debian/Ubuntu machine with CPython:

* the docstrings of a fixed list of Python standard-library modules (and of their public
  classes and functions): technical prose, similar to system prompts and documentation;
* a fixed list of licence texts from ``/usr/share/common-licenses``: long-form legal prose.

Paragraphs are normalised (whitespace collapsed, code and table lines dropped), de-duplicated
and written one paragraph per line, separated by blank lines. The output is capped at
``--max-bytes`` (default 300 000). The result depends on the CPython version and the licence
files present; the committed file is the reference, rebuilding is only needed to change it.

Usage::

    python scripts/build_corpus.py [--out jobs/data/corpus.txt] [--max-bytes 300000]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

#: Standard-library modules whose docstrings are mostly English prose.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio.events", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.tasks", "base64", "bisect", "bz2", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "email.utils",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt",
    "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
    "http.cookiejar", "http.server", "imaplib", "inspect", "io", "ipaddress", "json",
    "json.decoder", "json.encoder", "logging", "logging.handlers", "lzma", "mailbox",
    "mimetypes", "multiprocessing.pool", "multiprocessing.queues", "netrc", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil",
    "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil",
    "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat", "statistics",
    "string", "subprocess", "sysconfig", "tabnanny", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "tracemalloc", "typing",
    "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    "zipimport",
)  # fmt: skip

#: Licence texts (relative to /usr/share/common-licenses) appended after the docstrings.
LICENSES: tuple[str, ...] = (
    "Apache-2.0", "MPL-2.0", "GPL-3", "LGPL-2.1", "Artistic", "GFDL-1.3", "CC0-1.0",
)  # fmt: skip

LICENSE_DIR = Path("/usr/share/common-licenses")

_WORD = re.compile(r"[A-Za-z]{2,}")


def _docstrings(module_name: str) -> Iterator[str]:
    """Yield the module docstring, then those of its public classes, methods and functions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - an unavailable module is simply skipped
            return
    if module.__doc__:
        yield module.__doc__
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            yield doc
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") or not inspect.isfunction(member):
                    continue
                mdoc = inspect.getdoc(member)
                if mdoc:
                    yield mdoc


def _paragraphs(text: str) -> Iterator[str]:
    """Split ``text`` on blank lines and yield the paragraphs that read as English prose."""
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.splitlines()]
        if any(ln.startswith((">>>", "...", "$ ", "|", "+-", "--", "==", "::")) for ln in lines):
            continue
        para = " ".join(ln for ln in lines if ln)
        para = re.sub(r"\s+", " ", para).strip()
        if len(para) < 80 or not para[0].isupper() or para[-1] not in ".:;)\"'":
            continue
        words = _WORD.findall(para)
        letters = sum(len(w) for w in words)
        if len(words) < 12 or letters < 0.7 * len(para):
            continue
        yield para


def _select(sources: list[str], budget: int, seen: set[str]) -> list[str]:
    """Return the new prose paragraphs of ``sources``, in order, within ``budget`` bytes."""
    out: list[str] = []
    size = 0
    for text in sources:
        for para in _paragraphs(text):
            para = para.encode("ascii", errors="ignore").decode("ascii")
            if para in seen or para.endswith("::"):
                continue
            if size + len(para) + 2 > budget:
                return out
            seen.add(para)
            out.append(para)
            size += len(para) + 2
    return out


def build(max_bytes: int, docstring_share: float = 0.6) -> str:
    """Return the corpus text (paragraphs separated by one blank line, newline-terminated).

    About ``docstring_share`` of ``max_bytes`` goes to standard-library docstrings, the rest
    (plus whatever the docstrings left unused) to licence texts.
    """
    seen: set[str] = set()
    docs: list[str] = []
    for module_name in STDLIB_MODULES:
        docs.extend(_docstrings(module_name))
    licences = [
        (LICENSE_DIR / name).read_text(encoding="utf-8", errors="replace")
        for name in LICENSES
        if (LICENSE_DIR / name).is_file()
    ]
    first = _select(docs, int(max_bytes * docstring_share), seen)
    used = sum(len(p) + 2 for p in first)
    second = _select(licences, max_bytes - used, seen)
    return "\n\n".join(first + second) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; writes the corpus and prints its size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent.parent / "jobs" / "data" / "corpus.txt"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--max-bytes", type=int, default=300_000)
    args = parser.parse_args(argv)
    text = build(args.max_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="ascii")
    n_paras = text.count("\n\n") + 1
    print(f"wrote {args.out}: {len(text)} bytes, {n_paras} paragraphs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
