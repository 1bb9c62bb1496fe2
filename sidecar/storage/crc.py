"""The CRC-32 (zlib's, the one S3 calls CRC32) of a whole object from the CRCs of its parts.

Parts are checksummed in whichever thread uploads them, in any order; the object's CRC is then
combined from them (zlib's crc32_combine, on 32x32 matrices over GF(2)). The operator for a run of
zero bytes of one length is built once per length, so ten thousand equal parts cost ten thousand
32-step products, not ten thousand matrix powers.
"""

from __future__ import annotations

import functools

_POLY = 0xEDB88320  # the reflected polynomial of CRC-32
_Matrix = tuple[int, ...]  # 32 columns; column n is the image of bit n


def _times(mat: _Matrix, vec: int) -> int:
    out, n = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[n]
        vec >>= 1
        n += 1
    return out


def _then(first: _Matrix, second: _Matrix) -> _Matrix:
    """The operator that applies `first`, then `second`."""
    return tuple(_times(second, col) for col in first)


_ONE_BIT: _Matrix = (_POLY, *(1 << n for n in range(31)))
_IDENTITY: _Matrix = tuple(1 << n for n in range(32))


@functools.lru_cache(maxsize=8)
def _zeros(length: int) -> _Matrix:
    """The operator that feeds `length` zero bytes through a CRC register."""
    step = _ONE_BIT
    for _ in range(3):
        step = _then(step, step)  # 2, 4, then 8 zero bits: one zero byte
    out = _IDENTITY
    while length:
        if length & 1:
            out = _then(out, step)
        step = _then(step, step)
        length >>= 1
    return out


def combine(parts: list[tuple[int, int]]) -> int:
    """The CRC-32 of the concatenation of parts given as (crc32, length), in order."""
    crc = 0
    for part_crc, length in parts:
        crc = _times(_zeros(length), crc) ^ part_crc
    return crc
