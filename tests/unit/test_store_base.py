from __future__ import annotations

import logging

import numpy as np
import pytest

from layerkv.store.base import Code, code_name, validate_results, validate_single

MALFORMED = int(Code.MALFORMED)


def test_valid_results_pass_through() -> None:
    assert validate_results([0, -704, 4096], 3, "x") == [0, -704, 4096]
    assert validate_results((1, 0), 2, "x") == [1, 0]
    assert validate_results([np.int64(5)], 1, "x") == [5]
    assert validate_results([(1 << 63) - 1, -(1 << 63)], 2, "x") == [(1 << 63) - 1, -(1 << 63)]  # int64's ends


@pytest.mark.parametrize(
    "results",
    [
        [0, 0],
        [0, 0, 0, 0],
        [True, 0, 0],
        [0, 0.0, 0],
        [0, "0", 0],
        None,
        0,
        "000",
        {0: 0, 1: 0, 2: 0},
        [0, None, 0],
        [np.float32(1), 0, 0],
        [0, 1 << 63, 0],
        [0, -(1 << 63) - 1, 0],
        [1 << 64, 1, 1],
    ],
)
def test_malformed_results_fail_every_key(results: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="layerkv"):
        assert validate_results(results, 3, "batch_put_session_end") == [MALFORMED] * 3
    assert "batch_put_session_end returned a malformed result for 3 keys" in caplog.text


def test_validate_single() -> None:
    assert validate_single(0, "end") == 0
    assert validate_single(True, "end") == MALFORMED
    assert validate_single([0], "end") == MALFORMED
    assert validate_single(1 << 63, "end") == MALFORMED and validate_single((1 << 63) - 1, "end") == (1 << 63) - 1


def test_code_name() -> None:
    assert code_name(-704) == "OBJECT_NOT_FOUND(-704)"
    assert code_name(-12345) == "-12345"
