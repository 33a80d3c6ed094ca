"""``open_communicator`` without a token reads ``$PCCL_TOKEN``, as ``pccl master`` does, so one
exported variable serves a master and its peers; an explicit token wins over it."""

from __future__ import annotations

import pytest
import trio

import pccl
import pccl.blocking

TOKEN = "run-token-from-the-environment"


async def test_open_communicator_reads_the_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PCCL_TOKEN", TOKEN)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN) as master:
        with trio.fail_after(30):
            async with pccl.open_communicator(master.address) as comm:
                assert comm.world_size == 1


async def test_an_explicit_token_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PCCL_TOKEN", "not-the-run-token")
    async with pccl.open_master("127.0.0.1:0", token=TOKEN) as master:
        with trio.fail_after(30):
            async with pccl.open_communicator(master.address, token=TOKEN) as comm:
                assert comm.world_size == 1
            with pytest.raises(pccl.AuthenticationFailed):
                async with pccl.open_communicator(master.address):
                    pass


async def test_an_empty_variable_means_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PCCL_TOKEN", "")
    async with pccl.open_master("127.0.0.1:0") as master:
        with trio.fail_after(30):
            async with pccl.open_communicator(master.address) as comm:
                assert comm.world_size == 1


async def test_the_blocking_communicator_reads_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PCCL_TOKEN", TOKEN)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN) as master:
        def peer() -> int:
            with pccl.blocking.open_communicator(master.address) as comm:
                return comm.world_size

        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(peer) == 1
