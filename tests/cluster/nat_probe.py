"""Tiny TCP server and client that the NAT harness tests run inside namespaces (stdlib only, so
it starts fast with ``python -S``).

``serve HOST PORT NAME``: listen, print ``listening HOST PORT`` (flushed) once bound; to every
connection send its own name and the peer address it sees (``NAME IP PORT\\n``), then read
until EOF and answer with the number of bytes read (``COUNT\\n``).

``dial TIMEOUT HOST:PORT [HOST:PORT ...]``: connect to every target at once (one thread each,
each with ``TIMEOUT`` seconds), print one JSON list: per target ``{"target", "outcome", "seen",
"local"}`` with outcome ``connected`` / ``timeout`` / ``refused`` / ``unreachable`` /
``error: ...``, ``seen`` the server's line (its name, the address it saw), ``local`` the
client's own address.

``blast HOST:PORT NBYTES``: connect, send NBYTES, print JSON ``{"bytes", "seconds"}``: the time
from the first byte sent to the server's count received.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host, int(port)


def _reader(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def serve(host: str, port: int, name: str) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    print("listening", *listener.getsockname(), flush=True)

    def handle(conn: socket.socket, peer: tuple[str, int]) -> None:
        with conn:
            try:
                conn.sendall(f"{name} {peer[0]} {peer[1]}\n".encode())
                count = 0
                while chunk := conn.recv(1 << 16):
                    count += len(chunk)
                conn.sendall(f"{count}\n".encode())
            except OSError:
                pass  # a dialler that hung up after reading the address

    while True:
        conn, peer = listener.accept()
        threading.Thread(target=handle, args=(conn, peer), daemon=True).start()


def _dial_one(target: str, timeout: float) -> dict[str, object]:
    result: dict[str, object] = {"target": target, "outcome": None, "seen": None, "local": None}
    sock = socket.socket()
    sock.settimeout(timeout)
    try:
        sock.connect(_split(target))
        result["local"] = "{} {}".format(*sock.getsockname())
        result["seen"] = _reader(sock)
        result["outcome"] = "connected"
    except socket.timeout:
        result["outcome"] = "timeout"
    except ConnectionRefusedError:
        result["outcome"] = "refused"
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            result["outcome"] = "unreachable"
        else:
            result["outcome"] = f"error: {exc}"
    finally:
        sock.close()
    return result


def dial(timeout: float, targets: list[str]) -> None:
    results: list[dict[str, object]] = [{} for _ in targets]

    def one(i: int) -> None:
        results[i] = _dial_one(targets[i], timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results))


def blast(target: str, nbytes: int) -> None:
    sock = socket.create_connection(_split(target), timeout=60)
    with sock:
        _reader(sock)  # the address line
        block = b"x" * (1 << 16)
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            sent = sock.send(block[: min(left, len(block))])
            left -= sent
        sock.shutdown(socket.SHUT_WR)
        count = int(_reader(sock))
        print(json.dumps({"bytes": count, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "serve":
        serve(args[0], int(args[1]), args[2])
    elif command == "dial":
        dial(float(args[0]), args[1:])
    elif command == "blast":
        blast(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown command {command!r}")
