"""Load probes: does a pulled artifact actually load? Owns the per-format checks (torch checkpoints,
safetensors, JSON) and guarantees that none of them executes pickle.

torch is optional and imported lazily behind `CheckpointLoader`, so `import controller.probe` works
without it. Without torch a checkpoint probe FAILS: a probe that could not run proves nothing, and
the gate fails closed.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

ProbeKind = Literal["torch", "safetensors", "json", "none"]

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})
SAFETENSORS_SUFFIX = ".safetensors"
JSON_SUFFIX = ".json"

# The safetensors reference implementation refuses headers above this size (HeaderTooLarge).
MAX_SAFETENSORS_HEADER = 100_000_000

# Element sizes in bits, as in the safetensors format (sub-byte float formats included).
_DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_ZIP_MAGIC = b"PK\x03\x04"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DETAIL_MAX = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_WEIGHTS_ONLY_MARK = "WeightsUnpickler error:"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe. `kind` "none" means no probe applies to this file type."""

    path: str
    kind: ProbeKind
    ok: bool
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "ok": self.ok, "detail": self.detail}


class ProbeFailed(Exception):
    """A probe ran and the file did not pass; the message is the detail shown to the user."""


class CheckpointLoader(Protocol):
    """Loads a torch checkpoint without executing pickle; raises on any failure."""

    def load(self, path: Path) -> None: ...


class TorchLoader:
    """The real loader: `torch.load(weights_only=True)`, memory-mapped where the format allows."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def load(self, path: Path) -> None:
        # mmap avoids reading tensor data (verify has just hashed it), but only the zip format can
        # be mapped; a legacy (pre-1.6) file is loaded without mmap, still weights_only. Deciding
        # from the magic instead of catching torch's error keeps one load per file.
        with open(path, "rb") as fh:
            use_mmap = fh.read(4) == _ZIP_MAGIC
        try:
            loaded = self._torch.load(path, weights_only=True, map_location="cpu", mmap=use_mmap)
        except pickle.UnpicklingError as exc:
            raise ProbeFailed(_weights_only_detail(str(exc))) from exc
        del loaded


class UnavailableLoader:
    """Stands in when torch cannot be imported: every checkpoint probe fails with `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def load(self, path: Path) -> None:
        raise ProbeFailed(self.reason)


def default_checkpoint_loader() -> CheckpointLoader:
    """TorchLoader if torch imports, else an UnavailableLoader saying how to get it."""
    # torch warns once when numpy is absent; the probe needs no numpy, and the user needs no noise.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install failing to load its libraries
        return UnavailableLoader(
            f"cannot load-probe checkpoints: torch is not importable ({type(exc).__name__}: {exc}); "
            "install boxwarden[torch]"
        )
    return TorchLoader(torch)


def probe_kind(path: Path | str) -> ProbeKind:
    """Which probe applies to this name (by suffix, case-insensitive)."""
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix in TORCH_SUFFIXES:
        return "torch"
    if suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    if suffix == JSON_SUFFIX:
        return "json"
    return "none"


def probe_file(path: Path, *, loader: CheckpointLoader | None = None) -> ProbeResult:
    """Probe one file. Never raises for a bad file: any failure is `ok=False` with a one-line detail.

    `loader` is used for torch checkpoints; None means `default_checkpoint_loader()`.
    """
    kind = probe_kind(path)
    if kind == "none":
        return ProbeResult(str(path), kind, True, "no probe for this file type")
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ProbeFailed("not a regular file")
        if kind == "torch":
            (loader if loader is not None else default_checkpoint_loader()).load(path)
            detail = "torch.load(weights_only=True) succeeded"
        elif kind == "safetensors":
            detail = check_safetensors(path)
        else:
            detail = check_json(path)
    except ProbeFailed as exc:
        return ProbeResult(str(path), kind, False, _one_line(str(exc)))
    except Exception as exc:  # any failure to load is the finding, not a crash of the verifier
        logger.debug("probe of %s failed", path, exc_info=True)
        return ProbeResult(str(path), kind, False, _one_line(f"{type(exc).__name__}: {exc}"))
    return ProbeResult(str(path), kind, True, detail)


def check_json(path: Path) -> str:
    """The file must be UTF-8 JSON. Returns a detail; raises ProbeFailed."""
    try:
        json.loads(_read_all(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProbeFailed(f"not valid JSON: {exc}") from exc
    return "valid JSON"


def check_safetensors(path: Path) -> str:
    """Validate a safetensors file's structure from its header alone (nothing is executed, the
    safetensors package is not needed). Returns a detail; raises ProbeFailed."""
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise ProbeFailed(f"file of {size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_SAFETENSORS_HEADER:
            raise ProbeFailed(f"header length {n} exceeds {MAX_SAFETENSORS_HEADER}")
        if 8 + n > size:
            raise ProbeFailed(f"header length {n} runs past the end of the {size}-byte file")
        raw = fh.read(n)
    if len(raw) != n:
        raise ProbeFailed("file shrank while reading its header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProbeFailed(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProbeFailed("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ProbeFailed("__metadata__ must map strings to strings")

    spans = sorted(_tensor_span(name, info) for name, info in header.items())
    data_size = size - 8 - n
    cursor = 0
    for begin, end, name in spans:
        # The reference reader requires the tensors to tile the data region exactly: no gap, no
        # overlap, nothing after the last one.
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else "leaves a gap before it"
            raise ProbeFailed(f"tensor {name!r} at offset {begin} {what} (expected {cursor})")
        cursor = end
    if cursor != data_size:
        raise ProbeFailed(f"tensors cover {cursor} bytes but the data region holds {data_size}")
    return f"safetensors header ok ({len(spans)} tensors, {data_size} data bytes)"


def _tensor_span(name: str, info: object) -> tuple[int, int, str]:
    if not isinstance(info, dict):
        raise ProbeFailed(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise ProbeFailed(f"tensor {name!r}: unknown or missing dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ProbeFailed(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ProbeFailed(f"tensor {name!r}: data_offsets must be two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise ProbeFailed(f"tensor {name!r}: data_offsets end {end} is before begin {begin}")
    elements = 1
    for d in shape:
        elements *= d
    bits = elements * _DTYPE_BITS[dtype]
    if bits % 8 or end - begin != bits // 8:
        raise ProbeFailed(
            f"tensor {name!r}: {dtype}{shape} needs {bits / 8:g} bytes, data_offsets span {end - begin}"
        )
    return begin, end, name


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            # json.loads would silently keep the last one; a reader might keep the first.
            raise ProbeFailed(f"header names {key!r} twice")
        result[key] = value
    return result


def _read_all(path: Path) -> bytes:
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _weights_only_detail(message: str) -> str:
    """The unpickler's actual finding, without torch's advice to retry with weights_only=False
    (the one thing a verifier must never suggest)."""
    _, mark, rest = message.partition(_WEIGHTS_ONLY_MARK)
    lines = [line.strip() for line in rest.splitlines() if line.strip()] if mark else []
    finding = lines[0].split(". Please", 1)[0] if lines else "not a plain tensor/container checkpoint"
    return f"refused by torch's weights_only unpickler: {finding}"


def _one_line(text: str) -> str:
    text = _ANSI.sub("", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "failed"
    return first if len(first) <= _DETAIL_MAX else first[: _DETAIL_MAX - 1] + "…"
