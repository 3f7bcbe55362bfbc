"""`layerkv keygen FILE`: a new tenant key file (32 random bytes as hex, mode 0600), or with
`--rotate` a new key put first in an existing one (the older keys stay after it and still verify).
Prints the file and the key ids (hashes of the keys, safe to share), never a key."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keygen",
        help="write a tenant key file (config tenant_key_file)",
        description="Write a new tenant key (32 random bytes, hex) to FILE with mode 0600; refuses an existing "
        "file unless --rotate, which puts a new key first and keeps the older ones after it (they still verify). "
        "Give the file to every engine of the tenant (config tenant_key_file or $LAYERKV_TENANT_KEY_FILE).",
    )
    parser.add_argument("file", type=Path, help="the key file to write")
    parser.add_argument("--rotate", action="store_true", help="add a new current key to an existing file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layerkv.objects.tenant_key import write_key_file

    keys = write_key_file(args.file, rotate=args.rotate)
    ids = ", ".join(k.key_id for k in keys.all)
    print(f"layerkv keygen: {args.file} holds {len(keys.all)} key(s), ids {ids} (the first writes)")
    return 0
