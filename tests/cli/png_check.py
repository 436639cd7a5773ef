#!/usr/bin/env python3
"""png_check.py PNG WIDTH HEIGHT [RGB...]: checks a screenshot with the standard library only.

Passes when the PNG has exactly WIDTH x HEIGHT pixels and its top rows (up to 1000; decoding is
pure Python) are not blank: more than 40 distinct colours and more than 2% of the pixels not
white. Each RGB given as RRGGBB must appear in at least 12 pixels (within +-24 per channel), e.g.
the red of the NaN markers. Prints what it measured; exits 1 on a failed check.
"""
import struct
import sys
import zlib


def rows(path, limit):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG")
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        raise SystemExit(f"{path}: unsupported PNG (depth {depth}, colour type {colour}, interlace {interlace})")
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = zlib.decompressobj().decompress(b"".join(idat), (stride + 1) * min(height, limit))
    prev = bytearray(stride)
    out = []
    for y in range(min(height, limit)):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif f == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out.append(bytes(line))
        prev = line
    return width, height, bpp, out


def main():
    path, want_w, want_h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    wanted = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in sys.argv[4:]]
    width, height, bpp, lines = rows(path, 1000)
    colours, nonwhite, total = set(), 0, 0
    hits = [0] * len(wanted)
    for line in lines:
        for x in range(0, len(line), bpp):
            rgb = (line[x], line[x + 1], line[x + 2])
            colours.add(rgb)
            total += 1
            if rgb != (255, 255, 255):
                nonwhite += 1
                for k, w in enumerate(wanted):
                    if all(abs(a - b) <= 24 for a, b in zip(rgb, w)):
                        hits[k] += 1
    print(f"{path}: {width}x{height}, top {len(lines)} rows: {len(colours)} colours, "
          f"{100.0 * nonwhite / max(total, 1):.1f}% not white, " +
          ", ".join(f"#{h}: {n} px" for h, n in zip(sys.argv[4:], hits)))
    ok = True
    if (width, height) != (want_w, want_h):
        print(f"size {width}x{height}, expected {want_w}x{want_h}")
        ok = False
    if len(colours) <= 40 or nonwhite <= 0.02 * total:
        print("the page looks blank")
        ok = False
    for h, n in zip(sys.argv[4:], hits):
        if n < 12:
            print(f"colour #{h} is missing")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
