"""zero_comm.flight_recorder: the recorder is set off only where the user set no size
(what that does to the heap: tests/test_heap_growth.py)."""

from __future__ import annotations

import pytest

from zero_comm.flight_recorder import RECORDER_SIZE_VARIABLES, keep_flight_recorder_off


def test_with_no_size_set_the_recorder_is_set_off() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert keep_flight_recorder_off(env)
    assert env == {"PATH": "/bin", "TORCH_FR_BUFFER_SIZE": "0"}


@pytest.mark.parametrize("name", RECORDER_SIZE_VARIABLES)
@pytest.mark.parametrize("size", ["0", "2000"])
def test_a_size_the_user_set_is_kept(name: str, size: str) -> None:
    env = {name: size}
    assert not keep_flight_recorder_off(env)
    assert env == {name: size}
