"""What one load trusts of the objects it reads: each object's header (read with layer 0) must
name the block and the key it is read for and, with a tenant key, carry a valid MAC; each layer
read later must match the tag that header carried (layerkv.objects.seal). There is no switch that turns
a check off. `ObjectChecks` keeps, per key of the load (a row), the tags to compare with, the
write's nonce and whether the object failed (to be removed from the pool once its session
ended). It only answers masks; the load job fails the rows. Receive thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from layerkv.errors import HeaderError
from layerkv.objects.header import Header
from layerkv.objects.seal import NONCE_NBYTES, TAG_NBYTES, RowSealers, Sealer, context
from layerkv.store.base import ObjectKey

log = logging.getLogger(__name__)


class ObjectChecks:
    """`headers[g]` verifies the rows of generation g (`generations[row]`; the key that named
    and sealed the object: 0 the current key, higher an older one still in the key file)."""

    def __init__(
        self,
        headers: Header | Sequence[Header],
        keys: Sequence[ObjectKey],
        block_ids: Sequence[bytes],
        num_layers: int,
        generations: Sequence[int] | None = None,
    ) -> None:
        self._headers = (headers,) if isinstance(headers, Header) else tuple(headers)
        self._gens = (
            np.zeros(len(keys), dtype=np.int64) if generations is None else np.asarray(generations, dtype=np.int64)
        )
        if self._gens.shape != (len(keys),) or (
            self._gens.size and not 0 <= self._gens.min() <= self._gens.max() < len(self._headers)
        ):
            raise ValueError(f"generations {self._gens.tolist()} for {len(keys)} keys and {len(self._headers)} headers")
        self._keys = keys
        self._ids = block_ids
        self._tags = np.zeros((len(keys), num_layers, TAG_NBYTES), dtype=np.uint8)
        self._nonces = np.zeros((len(keys), NONCE_NBYTES), dtype=np.uint8)
        self._checked = np.zeros(len(keys), dtype=bool)  # the header verified: tags and nonce known
        self._contexts: dict[int, bytes] = {}  # row -> its tags' context (seal.context), once verified
        self.bad = np.zeros(len(keys), dtype=bool)  # failed verification: remove after the session ends
        self.header_failures = 0
        self.checksum_failures = 0

    @property
    def encrypts(self) -> bool:
        return self._headers[0].sealer.encrypts

    def sealer(self, rows: np.ndarray) -> Sealer | RowSealers:
        """What tags (or decrypts) the layers of `rows`, in that order: the one key's sealer,
        or each row's own after a key rotation."""
        gens = self._gens[rows]
        if len(self._headers) == 1 or not gens.any():
            return self._headers[0].sealer
        return RowSealers([h.sealer for h in self._headers], gens)

    def headers(self, rows: np.ndarray, headers: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """(mask of `rows` whose header `headers[i]` verifies, [(row, reason)] of the others);
        keeps each good row's tags and nonce."""
        if rows.size == 0:
            return np.ones(0, dtype=bool), []
        ok = np.zeros(rows.size, dtype=bool)
        nonces = np.zeros((rows.size, NONCE_NBYTES), dtype=np.uint8)
        tags = np.zeros((rows.size,) + self._tags.shape[1:], dtype=np.uint8)
        gens = self._gens[rows]
        for g in np.unique(gens).tolist():
            idx = np.flatnonzero(gens == g)
            picked = rows[idx].tolist()
            ok[idx], nonces[idx], tags[idx] = self._headers[g].verify_many(
                headers[idx], [self._ids[r] for r in picked], [self._keys[r] for r in picked]
            )
        failures = []
        for i in np.flatnonzero(~ok).tolist():
            row = int(rows[i])
            try:
                self._headers[int(gens[i])].verify(headers[i], self._ids[row], self._keys[row])
                reason = "header mismatch"
            except HeaderError as exc:
                reason = str(exc)
            failures.append((row, reason))
            self.bad[row] = True
        self.header_failures += len(failures)
        good = rows[ok]
        self._tags[good], self._nonces[good], self._checked[good] = tags[ok], nonces[ok], True
        for r in good.tolist():  # once per object, not per layer
            self._contexts[r] = context(self._keys[r], self._nonces[r].tobytes())
        return ok, failures

    def contexts(self, rows: np.ndarray) -> list[bytes]:
        """What binds each row's tags to its key and write (the header verified first)."""
        assert self._checked[rows].all(), "layers are checked only after their object's header"
        return [self._contexts[r] for r in rows.tolist()]

    def expected(self, rows: np.ndarray, layer_idx: int) -> np.ndarray:
        """The tags the headers of `rows` (verified) carry for `layer_idx`: uint8 [rows, 16]."""
        assert self._checked[rows].all(), "layers are checked only after their object's header"
        return self._tags[rows, layer_idx]

    def layers(self, first_layer: int, rows: np.ndarray, tags: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose layers match: `tags[i, j]` (uint8 [16]) is the tag of layer
        first_layer + j as read for row rows[i] (a mismatch marks the object bad)."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        want = self._tags[rows, first_layer : first_layer + tags.shape[1]]
        return self.judge(first_layer, rows, (want != tags).any(axis=2))

    def judge(self, first_layer: int, rows: np.ndarray, differs: np.ndarray) -> np.ndarray:
        """Mask of `rows` none of whose layers first_layer + j failed (`differs[i, j]`: a tag
        mismatch, or a layer that did not decrypt); the others are marked bad."""
        if rows.size == 0:
            return np.ones(0, dtype=bool)
        bad = ~self._checked[rows] | differs.any(axis=1)
        for row, j in zip(rows[bad].tolist(), np.argmax(differs[bad], axis=1).tolist()):
            log.warning(
                "layerkv: layer tag mismatch: key %s layer %d; the block is recomputed and the object removed",
                self._keys[row],
                first_layer + j,
            )
        self.checksum_failures += int(bad.sum())
        self.bad[rows[bad]] = True
        return ~bad
