"""Shrinks a CUDA extension's download to one GPU generation: zeroes the device code no Hopper
GPU runs, so the file compresses to a fraction of its size (it is not shortened: offsets stay).

A shared object's ``.nv_fatbin`` section holds one fatbin per compiled source file, each with
machine code (SASS) for several architectures and perhaps PTX. The driver loads, per fatbin,
the SASS of the device's architecture, else JIT-compiles its PTX. So for each fatbin that has
SASS for a kept architecture everything else is zeroed; for one that has none, the PTX stays
(the driver compiles it) and only the other SASS goes. Headers are untouched.

    python prune_fatbin.py FILE.so [FILE.so ...] --keep 90      # in place
    python prune_fatbin.py FILE.so --list                       # bytes per (kind, arch)
"""

from __future__ import annotations

import argparse
import collections
import struct
from collections.abc import Iterator

FATBIN_MAGIC = 0xBA55ED50
PTX, SASS = 1, 2


def _sections(data: bytes) -> dict[str, tuple[int, int]]:
    """ELF64 section name -> (offset, size)."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]
    out = {}
    for name, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_at + name)
        out[data[names_at + name:end].decode()] = (offset, size)
    return out


def fatbins(data: bytes, offset: int, size: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Each fatbin in the section as its entries: (kind, arch, payload offset, payload size)."""
    pos, end = offset, offset + size
    while pos < end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between fatbins
            pos += 8
            continue
        entry, stop, entries = pos + header_size, pos + header_size + body_size, []
        while entry < stop:
            kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append((kind, arch, entry + entry_header, payload))
            entry += entry_header + payload
        yield entries
        pos = stop


def prune(path: str, keep: set[int], list_only: bool = False) -> dict:
    data = bytearray(open(path, "rb").read())
    sections = _sections(data)
    if ".nv_fatbin" not in sections:
        return {"file": path, "fatbin_bytes": 0, "zeroed": 0}
    offset, size = sections[".nv_fatbin"]
    per_arch: collections.Counter = collections.Counter()
    zeroed = 0
    for entries in fatbins(data, offset, size):
        has_sass = any(kind == SASS and arch in keep for kind, arch, _, _ in entries)
        for kind, arch, at, length in entries:
            per_arch[("PTX" if kind == PTX else "SASS", arch)] += length
            drop = (kind == SASS and arch not in keep) or (kind == PTX and has_sass)
            if drop and not list_only:
                data[at:at + length] = bytes(length)
                zeroed += length
    if not list_only:
        open(path, "wb").write(data)
    return {"file": path, "fatbin_bytes": size, "zeroed": zeroed,
            "per_arch": {f"{k} {a}": n for (k, a), n in sorted(per_arch.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--keep", default="90", help="architectures whose SASS stays, e.g. 90 or 90,100")
    parser.add_argument("--list", action="store_true", help="only report the bytes per (kind, arch)")
    args = parser.parse_args()
    keep = {int(a) for a in args.keep.split(",")}
    for path in args.files:
        result = prune(path, keep, args.list)
        print(f"{path}: fatbin {result['fatbin_bytes'] / 2**20:.1f} MiB, zeroed {result['zeroed'] / 2**20:.1f} MiB")
        if args.list:
            for key, n in result.get("per_arch", {}).items():
                print(f"  {key}: {n / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
