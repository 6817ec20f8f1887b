"""The `kvdbg window` picture as a PNG, written with the standard library only (zlib + struct; no torch).

It rasterises kvdbg.render.drawing's layout: rectangles as they are, labels in
a small 5x7 pixel font (upper case; lower case is drawn as upper case).
"""

from __future__ import annotations

import struct
import zlib

from kvdbg.picture import Picture
from kvdbg.render.drawing import BACKGROUND, CHAR_W, Drawing, layout

# 5x7 glyphs: seven rows, five bits each (bit 4 is the left column), as hex bytes.
_GLYPHS = {
    "0": "0E1113151911 0E", "1": "040C04040404 0E", "2": "0E1101020408 1F", "3": "1F0204020111 0E",
    "4": "02060A121F02 02", "5": "1F101E010111 0E", "6": "0608101E1111 0E", "7": "1F0102040808 08",
    "8": "0E11110E1111 0E", "9": "0E11110F0102 0C",
    "A": "0E11111F1111 11", "B": "1E11111E1111 1E", "C": "0E1110101011 0E", "D": "1C1211111112 1C",
    "E": "1F10101E1010 1F", "F": "1F10101E1010 10", "G": "0E1110171111 0F", "H": "1111111F1111 11",
    "I": "0E0404040404 0E", "J": "070202020212 0C", "K": "111214181412 11", "L": "101010101010 1F",
    "M": "111B15151111 11", "N": "111119151311 11", "O": "0E1111111111 0E", "P": "1E11111E1010 10",
    "Q": "0E1111111512 0D", "R": "1E11111E1412 11", "S": "0F10100E0101 1E", "T": "1F0404040404 04",
    "U": "111111111111 0E", "V": "11111111110A 04", "W": "111111151515 0A", "X": "11110A040A11 11",
    "Y": "1111110A0404 04", "Z": "1F0102040810 1F",
    " ": "000000000000 00", ".": "00000000000C 0C", ",": "000000000C04 08", ":": "000C0C000C0C 00",
    ";": "000C0C000C04 08", "-": "0000001F0000 00", "_": "000000000000 1F", "(": "020408080804 02",
    ")": "080402020204 08", "/": "000102040810 00", "=": "00001F001F00 00", "<": "020408100804 02",
    ">": "080402010204 08", "|": "040404040404 04", "+": "0004041F0404 00", "!": "040404040400 04",
    "'": "040408000000 00", "*": "0004150E1504 00", "[": "0E0808080808 0E", "]": "0E0202020202 0E",
    "%": "181902040813 03", "…": "000000000015 15", "×": "00110A040A11 00", "?": "0E1101020400 04",
    "→": "0004021F0204 00", "#": "0A0A1F0A1F0A 0A",
}
FONT = {ch: [int(code.replace(" ", "")[i:i + 2], 16) for i in range(0, 14, 2)] for ch, code in _GLYPHS.items()}
UNKNOWN = [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F]


class Raster:
    """An RGB image in one bytearray."""

    def __init__(self, width: int, height: int, background=BACKGROUND):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill(self, x: int, y: int, w: int, h: int, color) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + max(1, w)), min(self.height, y + max(1, h))
        if x1 <= x0 or y1 <= y0:
            return
        line = bytes(color) * (x1 - x0)
        for row in range(y0, y1):
            start = (row * self.width + x0) * 3
            self.pixels[start:start + len(line)] = line

    def text(self, x: int, y: int, text: str, color, scale: int = 1) -> None:
        for index, ch in enumerate(text):
            glyph = FONT.get(ch.upper(), UNKNOWN)
            left = x + index * CHAR_W * scale
            for row, bits in enumerate(glyph):
                for col in range(5):
                    if bits & (0x10 >> col):
                        self.fill(left + col * scale, y + row * scale, scale, scale, color)

    def png(self) -> bytes:
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[r * stride:(r + 1) * stride]) for r in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def rasterise(d: Drawing) -> Raster:
    image = Raster(d.width, d.height)
    for r in d.rects:
        image.fill(r.x, r.y, r.w, r.h, r.color)
    for label in d.labels:
        image.text(label.x, label.y, label.text, label.color, label.scale)
    return image


def png_bytes(p: Picture) -> bytes:
    return rasterise(layout(p)).png()


__all__ = ["FONT", "Raster", "png_bytes", "rasterise"]
