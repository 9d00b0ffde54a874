"""Build the offline English corpus of the small LM comparison (docs/results.md).

Source: the Debian package ``python3.11-doc`` (3.11.2-6+deb12u9, Debian 12), which ships the
reStructuredText sources of the Python 3.11 documentation under
``usr/share/doc/python3.11/html/_sources/``.  One JSON line per source file (``{"text": ...,
"path": ...}``); ``whatsnew/`` (release notes and the changelog) is left out so the corpus is
reference prose and examples.  The trainer splits it into train / validation by document.

    apt-get download python3.11-doc              # needs the package index, not root
    python experiments/prepare_python_docs.py python3.11-doc_*.deb data/python-docs.jsonl

Prints the number of documents and bytes (= byte-level tokens before BOS/EOS).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

SOURCES = "usr/share/doc/python3.11/html/_sources"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("deb", help="path to python3.11-doc_*.deb, or a folder it was unpacked into")
    p.add_argument("out", help="output .jsonl path")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.deb
        if os.path.isfile(args.deb):
            subprocess.run(["dpkg-deb", "-x", args.deb, tmp], check=True)
            root = tmp
        src = os.path.join(root, SOURCES)
        files = sorted(f for f in glob.glob(os.path.join(src, "**", "*.rst.txt"), recursive=True)
                       if not os.path.relpath(f, src).startswith("whatsnew" + os.sep))
        if not files:
            print(f"error: no .rst.txt sources under {src}; is {args.deb} the python3.11-doc package?",
                  file=sys.stderr)
            return 2
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        n_bytes = 0
        with open(args.out + ".tmp", "w", encoding="utf-8") as fh:
            for f in files:
                with open(f, encoding="utf-8") as g:
                    text = g.read()
                n_bytes += len(text.encode("utf-8"))
                fh.write(json.dumps({"text": text, "path": os.path.relpath(f, src)}) + "\n")
        os.replace(args.out + ".tmp", args.out)
    print(f"{args.out}: {len(files)} documents, {n_bytes:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
