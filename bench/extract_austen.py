"""Rebuild ``ui/data/austen.txt`` (the studio's examples and the RULER haystack) from Debian's
r-cran-janeaustenr package (public-domain novels).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/jane
    pip install rdata && python -m bench.extract_austen /tmp/jane

The package stores the novels as an R lazy-load database (Rdata.rdx index, Rdata.rdb records); each record is a
4-byte length, then zlib data (or a type byte for bzip2/xz) of an R-serialized character vector of lines.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import sys
import zlib
from pathlib import Path

NOVELS = ("prideprejudice", "persuasion")
KEEP_CHARS = 160_000  # per novel: enough for 8K-token haystacks, small enough to commit


def _record(blob: bytes) -> bytes:
    kind = blob[4:5]
    if kind == b"Z":
        return lzma.decompress(blob[5:])
    if kind == b"2":
        return bz2.decompress(blob[5:])
    if kind == b"0":
        return blob[5:]
    return zlib.decompress(blob[4:])


def paragraphs(lines: list[str]) -> list[str]:
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return out


def main(root: str) -> None:
    import rdata

    base = Path(root) / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((base.with_suffix(".rdx")).read_bytes())))
    db = base.with_suffix(".rdb").read_bytes()
    texts = []
    for name in NOVELS:
        offset, length = (int(v) for v in index["variables"][name])
        lines = [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(_record(db[offset:offset + length])))]
        text = "\n\n".join(paragraphs(lines))
        texts.append(text[:text.rfind("\n\n", 0, KEEP_CHARS)])
    out = Path(__file__).resolve().parents[1] / "ui" / "data" / "austen.txt"
    out.write_text("\n\n".join(texts) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/jane")
