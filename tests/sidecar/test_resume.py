"""The checkpoint a restarted job resumes from (sidecar.resume), on real files: the newest durable
one whose bytes on the box are still the claimed ones, a file or an HF-style checkpoint directory,
and a directory only when it is whole."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import blake3

from sidecar import resume
from sidecar.identity import FileIdentity
from sidecar.ledger import ClaimRow


class Box:
    """A watched dir and the claims about its files, as the ledger would hold them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.claims: list[ClaimRow] = []

    def save(self, art: str, data: bytes, *, durable: bool = True, claim: bool = True) -> Path:
        path = self.root / art
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if claim:
            seq = len(self.claims) + 1
            self.claims.append(
                ClaimRow(
                    id=seq,
                    path=art,
                    size=len(data),
                    blake3=blake3.blake3(data).hexdigest(),
                    identity=FileIdentity.of(path.stat()),
                    sealed_at_ns=seq,
                    seq=seq,
                    durable=durable,
                    durable_at_ns=seq if durable else 0,
                    push_error="",
                )
            )
        return path

    def chosen(self, *, unsettled: frozenset[str] = frozenset()) -> str:
        found = resume.candidates(self.claims, ("c/",), lambda a: self.root / a, skip=1, unsettled=unsettled)
        best = resume.newest_loadable(found)
        return "" if best is None else str(best.path.relative_to(self.root))


def torch_file() -> bytes:
    return b"PK\x03\x04" + os.urandom(200)


def safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(8)


def hf_checkpoint(box: Box, step: int, **kw: bool) -> None:
    box.save(f"c/checkpoint-{step}/model.safetensors", safetensors(), **kw)
    box.save(f"c/checkpoint-{step}/trainer_state.json", b'{"global_step": %d}' % step)


def test_the_newest_durable_file_that_is_still_the_claimed_one(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.save("c/step-1.pt", torch_file())
    box.save("c/step-2.pt", torch_file())
    box.save("c/step-3.pt", torch_file(), durable=False)  # not proven yet
    box.save("other/step-9.pt", torch_file())  # another cell's
    assert box.chosen() == "c/step-2.pt"
    (tmp_path / "c/step-2.pt").write_bytes(torch_file())  # written again since it was sealed
    assert box.chosen() == "c/step-1.pt"
    assert box.chosen(unsettled=frozenset({"c/step-1.pt"})) == ""  # being sealed again: not it either
    box.save("c/step-4.pt", b"not a checkpoint")  # durable, the claimed bytes, but no torch file
    box.save("c/notes.txt", b"hello")  # not a checkpoint at all
    assert box.chosen() == "c/step-1.pt"


def test_a_checkpoint_directory_is_named_whole_or_not_at_all(tmp_path: Path) -> None:
    box = Box(tmp_path)
    hf_checkpoint(box, 500)
    assert box.chosen() == "c/checkpoint-500"
    hf_checkpoint(box, 1000, durable=False)  # its shard is not proven yet: the older one
    assert box.chosen() == "c/checkpoint-500"
    hf_checkpoint(box, 1500)
    box.save("c/checkpoint-1500/optimizer.pt", torch_file(), claim=False)  # on the box, not a claim
    assert box.chosen() == "c/checkpoint-500"
    hf_checkpoint(box, 2000)
    assert box.chosen() == "c/checkpoint-2000"
    (tmp_path / "c/checkpoint-2000/model.safetensors").write_bytes(safetensors())  # rewritten
    assert box.chosen() == "c/checkpoint-500"
    box.save("c/checkpoint-2500/trainer_state.json", b"{}")  # no weights in it
    assert box.chosen() == "c/checkpoint-500"
