"""The dashboard as a browser draws it: Debian's headless chromium (dump the DOM after the page's
polling ran, or a screenshot), a small DOM parsed from the dump, and a PNG check. Used by
tests/test_dashboard.py and tests/stack/test_dashboard_stack.py."""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--hide-scrollbars",
         "--no-first-run", "--mute-audio")


# ---- headless chromium -------------------------------------------------------------------------

def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed (no `chromium` on PATH). `make` installs it "
                    "(as root: apt-get install -y chromium); the dashboard tests draw the page in it.")
    return path


def run_chromium(url: str, *args: str, budget_ms: int = 3000) -> str:
    """One headless run on a throwaway profile; its stdout. Virtual time runs the page's polling
    `budget_ms` ahead (it waits while fetches are pending), then chromium dumps or shoots."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *args, url]
        proc = subprocess.run(cmd, capture_output=True, timeout=90)
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-2000:]}"
    return out


def dump_dom(url: str, budget_ms: int = 3000) -> Node:
    html = run_chromium(url, "--dump-dom", budget_ms=budget_ms)
    assert "<html" in html, html[:500]
    return parse(html)


def screenshot(url: str, path: Path, width: int = 1400, height: int = 1000, budget_ms: int = 3000) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    run_chromium(url, f"--screenshot={path}", f"--window-size={width},{height}", budget_ms=budget_ms)
    assert path.exists(), "chromium wrote no screenshot"
    return path.read_bytes()


def check_png(data: bytes, width: int, height: int) -> None:
    """A valid PNG of that size whose pixels are not all alike (a blank page would be)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        chunks.setdefault(kind, []).append(body)
        pos += 12 + length
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    assert (w, h) == (width, height)
    assert b"IEND" in chunks
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    assert len(raw) == h * (1 + w * channels * depth // 8)
    assert len(set(raw)) > 64, "the screenshot is nearly uniform"
    assert len(data) > 20_000, f"only {len(data)} bytes: a nearly empty page"


# ---- a small DOM ---------------------------------------------------------------------------------

class Node:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Node | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node] = []
        self.texts: list[str] = []

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    @property
    def text(self) -> str:
        return "".join(self.texts) + "".join(child.text for child in self.children)

    def all(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if (tag is None or child.tag == tag) and (cls is None or cls in child.classes):
                found.append(child)
            found.extend(child.all(tag, cls))
        return found

    def by_id(self, ident: str) -> Node:
        hits = [n for n in self.all() if n.attrs.get("id") == ident]
        assert hits, f"no element #{ident}"
        return hits[0]


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.node = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.node)
        self.node.children.append(node)
        if tag not in VOID:
            self.node = node

    def handle_startendtag(self, tag, attrs):
        self.node.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.node))

    def handle_endtag(self, tag):
        node = self.node
        while node.parent is not None and node.tag != tag:
            node = node.parent
        if node.parent is not None:
            self.node = node.parent

    def handle_data(self, data):
        self.node.texts.append(data)


def parse(html: str) -> Node:
    parser = _Parser()
    parser.feed(html)
    return parser.root


def queue_ids(dom: Node, name: str) -> list[str]:
    return [li.attrs["data-request"] for li in dom.by_id(f"queue-{name}").all("li") if "data-request" in li.attrs]


def queue_count(dom: Node, name: str) -> int:
    return int(dom.by_id(f"queue-{name}").all(cls="count")[0].text)
