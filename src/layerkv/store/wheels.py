"""The Mooncake wheels layerkv knows, what each can move, and the startup check that a KV cache's
device and the configured data path fit the store.

    distribution                         extra of a checkout  moves device memory
    mooncake-transfer-engine-non-cuda    .[mooncake]          no (host memory only)
    mooncake-transfer-engine             .[mooncake-cuda12]   CUDA 12
    mooncake-transfer-engine-cuda13      .[mooncake-cuda13]   CUDA 13

The three ship the same `mooncake` package: installing one over another replaces it (the
`mooncake` extra over a CUDA install breaks the CUDA engine's own Mooncake use), so the extra
must match what the engine has. layerkv itself hands the store host memory only (its staging;
device KV is copied through pinned host staging and verified there), so any of them serves the
default path; the live cache itself is registered only for host caches.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from layerkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Wheel:
    distribution: str
    extra: str
    cuda: str | None  # the CUDA major version it is built for (None: no device memory)


WHEELS = (
    Wheel("mooncake-transfer-engine-non-cuda", "mooncake", None),
    Wheel("mooncake-transfer-engine", "mooncake-cuda12", "12"),
    Wheel("mooncake-transfer-engine-cuda13", "mooncake-cuda13", "13"),
)
DISTRIBUTIONS = tuple(w.distribution for w in WHEELS)
VERSION = "0.3.13.post1"  # the release tested (pyproject's extras pin it)


def installed() -> list[tuple[Wheel, str]]:
    """(wheel, version) of every known Mooncake distribution installed (two or more clash)."""
    found = []
    for wheel in WHEELS:
        try:
            found.append((wheel, importlib.metadata.version(wheel.distribution)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def torch_cuda() -> str | None:
    """The CUDA version the installed torch is built for ('12.8'), None for a CPU build / no torch."""
    try:
        import torch
    except ImportError:
        return None
    return getattr(torch.version, "cuda", None)


def wheel_for(cuda: str | None) -> Wheel:
    """The wheel that matches a torch built for CUDA `cuda` (None: the non-CUDA one)."""
    major = cuda.split(".")[0] if cuda else None
    return next((w for w in WHEELS if w.cuda == major), WHEELS[0] if major is None else WHEELS[1])


def install_hint(cuda: str | None = None, *, detect: bool = True) -> str:
    """The pip command for the wheel that fits this machine's torch (or CUDA `cuda`), and the extra
    that installs it from a layerkv checkout (layerkv is not published on PyPI)."""
    wheel = wheel_for(cuda if cuda is not None or not detect else torch_cuda())
    return f"pip install '{wheel.distribution}=={VERSION}' (from a layerkv checkout: pip install '.[{wheel.extra}]')"


def clash() -> str | None:
    """A warning when several Mooncake distributions are installed (they overwrite each other's
    files: whichever was installed last is the one that runs), else None."""
    found = installed()
    if len(found) < 2:
        return None
    names = ", ".join(f"{w.distribution} {v}" for w, v in found)
    return f"several Mooncake wheels are installed ({names}); they ship the same files: keep one ({install_hint()})"


def check_device_path(device_type: str, register_kv_cache: bool) -> None:
    """Refuse a setup whose configured path would hand the store device memory: with
    `register_kv_cache` the live cache itself is registered, and layerkv moves device KV only
    through pinned host staging (verified there; a device cache's bytes cannot be checked by
    the host where the store writes them). Host caches, and device caches through staging
    (the default), pass with any store."""
    if device_type == "cpu" or not register_kv_cache:
        return
    cuda = [w for w, _ in installed() if w.cuda is not None]
    wheel = (
        f"the installed {cuda[0].distribution} could register it, but "
        if cuda
        else "registering it would also need Mooncake's CUDA wheel "
        f"({install_hint(torch_cuda() or '12', detect=False)}), and "
    )
    raise ConfigError(
        f"register_kv_cache: true, but the KV caches live on {device_type}: {wheel}layerkv moves device KV only "
        "through pinned host staging, where it is verified and which is the only memory the store sees. "
        "Set register_kv_cache: false (the default); any Mooncake wheel serves that path"
    )
