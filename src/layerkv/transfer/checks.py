"""What one load trusts of the objects it reads: each object's header (read with layer 0) must
name the block it is read for, and each layer read later must match the checksum that header
carried. `ObjectChecks` keeps, per key of the load (a row), the checksums to compare with and
whether the object failed (to be removed from the pool once its session ended). It only
answers masks; the load job fails the rows. Receive thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from layerkv.errors import HeaderError
from layerkv.header import Header
from layerkv.messages import BlockHash
from layerkv.store.base import ObjectKey

log = logging.getLogger(__name__)


class ObjectChecks:
    def __init__(self, header: Header, keys: Sequence[ObjectKey], block_hashes: Sequence[BlockHash], num_layers: int,
                 verify_checksums: bool) -> None:
        self._header = header
        self._keys = keys
        self._hashes = block_hashes
        self.enabled = verify_checksums  # False: headers are still checked, layer sums are not
        self._sums = np.zeros((len(keys), num_layers), dtype=np.uint64)
        self._has_sums = np.zeros(len(keys), dtype=bool)  # the header carried checksums
        self.bad = np.zeros(len(keys), dtype=bool)  # failed verification: remove after the session ends
        self.header_failures = 0
        self.checksum_failures = 0

    def headers(self, rows: np.ndarray, headers: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """(mask of `rows` whose header `headers[i]` matches, [(row, reason)] of the others);
        keeps each good row's layer checksums."""
        if rows.size == 0:
            return np.ones(0, dtype=bool), []
        ok, has_sums, sums = self._header.verify_many(headers, [self._hashes[r] for r in rows.tolist()])
        failures = []
        for i in np.flatnonzero(~ok).tolist():
            row = int(rows[i])
            try:
                self._header.verify(headers[i], self._hashes[row])
                reason = "header mismatch"
            except HeaderError as exc:
                reason = str(exc)
            failures.append((row, reason))
            self.bad[row] = True
        self.header_failures += len(failures)
        keep = ok & has_sums
        if self.enabled and keep.any():
            self._has_sums[rows[keep]] = True
            self._sums[rows[keep]] = sums[keep]
        return ok, failures

    def layers(self, first_layer: int, rows: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose layers match: `sums[i, j]` is the checksum of layer
        first_layer + j as read for row rows[i]; rows whose header carried checksums must
        match them (a mismatch marks the object bad)."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        want = self._sums[rows, first_layer : first_layer + sums.shape[1]]
        bad = self._has_sums[rows] & (want != sums).any(axis=1)
        for row, j in zip(rows[bad].tolist(), np.argmax(want[bad] != sums[bad], axis=1).tolist()):
            log.warning("layerkv: checksum mismatch: key %s layer %d; the block is recomputed and the object removed",
                        self._keys[row], first_layer + j)
        self.checksum_failures += int(bad.sum())
        self.bad[rows[bad]] = True
        return ~bad
