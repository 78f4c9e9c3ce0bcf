"""Rewrites Babel's wheel with the locale data of Tandem's own languages only (the carry to the
lent GPU machine is at most 64 MiB, and Babel's data for every locale is 10 MB of it):
    python3 bench/trim_babel_wheel.py .devcarry/wheels312/babel-*.whl"""

import sys
import zipfile
from pathlib import Path

KEEP = ("root", "en", "de", "es", "fr", "it", "ja", "ko", "pt", "zh")  # locales/ and their parents


def kept(name: str) -> bool:
    if "/locale-data/" not in name:
        return True
    stem = Path(name).stem
    return stem.split("_")[0] in KEEP


def main(path: str) -> None:
    src = Path(path)
    tmp = src.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if not kept(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # drop the rows of the files left out
                rows = data.decode().splitlines()
                data = "\n".join(r for r in rows if kept(r.split(",")[0])).encode() + b"\n"
            zout.writestr(info, data)
    tmp.replace(src)
    print(f"{src.name}: {src.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
