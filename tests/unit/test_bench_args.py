"""`pccl bench` refuses a bad --local-socket-buffer-size before it starts any process."""

from __future__ import annotations

import pytest

from pccl.tools import bench


@pytest.mark.parametrize("size", ["1K", "65535"])
def test_a_socket_buffer_below_the_minimum_is_a_usage_error(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--peers", "2", "--sizes", "16K", "--local-socket-buffer-size", size])
    assert exit_info.value.code == 2
    assert "local_socket_buffer_size must be 0 (the OS default) or at least 65536 bytes" in capsys.readouterr().err
