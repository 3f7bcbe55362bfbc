"""What identifies a model's KV values beyond its id: a fingerprint of the checkpoint files and
a digest of the settings that change KV bytes. Pure functions (file reads only), any thread;
engine adapters call them once at startup to fill `Deployment.model_fingerprint` /
`Deployment.model_settings`.

A checkpoint fingerprint reads, per weights file (sorted by name): its name and size, its
safetensors header (tensor names, dtypes, shapes, offsets), and three 64 KiB samples of its data
at fixed fractions. Two fine-tunes of one architecture share headers but not weights, so the
samples tell them apart; reading ~200 KiB per file keeps it fast for any model size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_SAMPLE_NBYTES = 64 << 10
_SAMPLE_FRACTIONS = (0.0, 0.5, 0.999)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MAX_HEADER_NBYTES = 100 << 20


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """A 32-hex-digit fingerprint of the weights files in directory `path` (or of the one file
    `path`); '' when there are none (the caller then relies on a revision or a pinned value)."""
    root = Path(path)
    files = (
        sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        if root.is_dir()
        else ([root] if root.is_file() else [])
    )
    if not files:
        return ""
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size};".encode())
        with file.open("rb") as f:
            data_start = _safetensors_header(f, size, digest) if file.suffix == ".safetensors" else 0
            span = size - data_start
            for fraction in _SAMPLE_FRACTIONS:
                f.seek(data_start + int(max(0, span - _SAMPLE_NBYTES) * fraction))
                digest.update(f.read(_SAMPLE_NBYTES))
    return digest.hexdigest()[:32]


def _safetensors_header(f: Any, size: int, digest: Any) -> int:
    """Hash a safetensors file's JSON header; return where its data starts."""
    raw = f.read(8)
    if len(raw) < 8:
        return 0
    (header_nbytes,) = struct.unpack("<Q", raw)
    if header_nbytes > min(size - 8, _MAX_HEADER_NBYTES):
        return 0  # not a safetensors header: sample the file as bytes
    digest.update(f.read(header_nbytes))
    return 8 + header_nbytes


def settings_digest(settings: Mapping[str, Any]) -> str:
    """A 32-hex-digit digest of `settings` (canonical JSON; non-JSON values by their repr)."""
    text = json.dumps(settings, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
