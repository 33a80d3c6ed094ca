"""TLS switched on from the command line: ``pccl master --tls-cert/--tls-key/--tls-ca`` as a real
process, peers configured from the same kind of PEM files (``Config.with_tls``); a peer that
does not trust the run's CA is refused with a TLS error that says so; bad files are pccl errors
naming the file, never an ssl traceback."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import trio
import trustme

import pccl
from pccl import Config

TOKEN = "tls-run-token"
BASE = Config(peer_timeout=10.0, heartbeat_interval=0.2, connect_timeout=10.0, master_reconnect_timeout=0.0)


def write_pki(directory: pathlib.Path, ca: trustme.CA, name: str) -> dict[str, str]:
    """CA bundle, certificate (for 127.0.0.1) and key of one party, as PEM files."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": directory / f"{name}-ca.pem", "cert": directory / f"{name}-cert.pem",
             "key": directory / f"{name}-key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return {k: str(v) for k, v in paths.items()}


def _master_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--peer-timeout", "10",
            "--heartbeat-interval", "0.2", *args]


async def _start_master(cmd: list[str], env: dict[str, str]) -> tuple[trio.Process, str, list[bytes]]:
    proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    log: list[bytes] = []
    with trio.fail_after(30):
        buffer = b""
        while b"master listening on" not in buffer:
            chunk = await proc.stderr.receive_some()
            assert chunk, b"master exited: " + buffer
            buffer += chunk
    log.append(buffer)
    address = re.search(rb"master listening on (\S+)", buffer).group(1).decode()  # type: ignore[union-attr]
    return proc, address, log


async def test_tls_from_the_command_line_end_to_end(tmp_path: pathlib.Path) -> None:
    run_ca, stranger_ca = trustme.CA(), trustme.CA()
    master_files = write_pki(tmp_path, run_ca, "master")
    env = {**os.environ, "PCCL_TOKEN": TOKEN}
    proc, address, _ = await _start_master(_master_cmd("--tls-cert", master_files["cert"], "--tls-key",
                                                       master_files["key"], "--tls-ca", master_files["ca"]), env)
    try:
        peer_files = [write_pki(tmp_path, run_ca, f"peer{i}") for i in range(2)]
        configs = [BASE.with_tls(cert=f["cert"], key=f["key"], ca=f["ca"]) for f in peer_files]
        results: list[np.ndarray] = []
        with trio.fail_after(60):
            async with pccl.open_communicator(address, token=TOKEN, config=configs[0]) as first:
                async with trio.open_nursery() as nursery:
                    async def second() -> None:
                        async with pccl.open_communicator(address, token=TOKEN, config=configs[1]) as comm:
                            x = np.full(1000, 2.0, np.float32)
                            await comm.all_reduce(x)
                            results.append(x)

                    nursery.start_soon(second)
                    while not await first.are_peers_pending():
                        await trio.sleep(0.05)
                    await first.update_topology()
                    x = np.full(1000, 1.0, np.float32)
                    await first.all_reduce(x)  # over TLS between the peers too
                    results.append(x)
        assert len(results) == 2 and all(np.all(r == 3.0) for r in results)

        # A peer holding a certificate of another CA, which does not trust the run's CA either:
        stranger = write_pki(tmp_path, stranger_ca, "stranger")
        config = BASE.with_tls(cert=stranger["cert"], key=stranger["key"], ca=stranger["ca"])
        with trio.fail_after(30), pytest.raises(pccl.PCCLError) as refused:
            async with pccl.open_communicator(address, token=TOKEN, config=config):
                pass
        # open_communicator names the TLS failure: "cannot reach the master at …: TLS connection to …
        # failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer …"
        assert isinstance(refused.value, pccl.MasterUnreachable), refused.value
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value) or "certificate verify failed" in str(refused.value)

        # A peer without TLS at all gets nowhere either (the master expects a TLS handshake).
        with trio.fail_after(30), pytest.raises(pccl.PCCLError):
            async with pccl.open_communicator(address, token=TOKEN, config=BASE):
                pass
        assert proc.returncode is None  # the master shrugged all of it off
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            await proc.wait()
    assert proc.returncode == 0


@pytest.mark.parametrize("problem", ["missing cert", "mismatched key", "not pem", "missing ca", "env half set"])
def test_bad_tls_files_are_a_clear_error_naming_the_file(tmp_path: pathlib.Path, problem: str) -> None:
    ca = trustme.CA()
    files = write_pki(tmp_path, ca, "master")
    other = write_pki(tmp_path, ca, "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    args = {"cert": files["cert"], "key": files["key"], "ca": files["ca"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_TLS_")}
    named = ""
    if problem == "missing cert":
        args["cert"] = named = str(tmp_path / "nope.pem")
    elif problem == "mismatched key":
        args["key"] = named = other["key"]
    elif problem == "not pem":
        args["cert"] = named = str(junk)
    elif problem == "missing ca":
        args["ca"] = named = str(tmp_path / "no-ca.pem")
    flags = ["--tls-cert", args["cert"], "--tls-key", args["key"], "--tls-ca", args["ca"]]
    if problem == "env half set":
        flags, env["PCCL_TLS_CERT"], named = [], files["cert"], "PCCL_TLS_KEY"
    result = subprocess.run(_master_cmd(*flags), capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "ERROR" in result.stderr
