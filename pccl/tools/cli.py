"""The ``pccl`` command (also ``python -m pccl``).  The only module that configures logging.

Sub-commands:

* ``pccl master --listen HOST:PORT [--token TOKEN | --token-file FILE]`` runs a master until
  interrupted (Ctrl-C / SIGTERM).  The token may also come from the ``PCCL_TOKEN`` environment
  variable (preferable: command lines are visible to every user of the machine).  The bound
  address is logged as ``master listening on HOST:PORT`` (useful with port 0).  ``--status
  HOST:PORT`` (or ``PORT``: loopback) serves the status page, ``/status.json`` and ``/metrics``;
  ``--tls-cert F --tls-key F [--tls-ca F]`` (or ``$PCCL_TLS_CERT``/``KEY``/``CA``) switch TLS on.
  ``--relay``: the master also relays (peer pairs that cannot connect either way meet at its port).
* ``pccl relay --master HOST:PORT [--listen HOST:PORT] [--advertise ADDR]`` runs a relay of that
  master's run until interrupted (:mod:`pccl.relay`); token and TLS flags as for ``master``.
* ``pccl run --nproc N [--master HOST:PORT] SCRIPT ARGS...`` starts N copies of a script on this
  machine with ``PCCL_MASTER`` set (and a master on loopback when none is given), torchrun-like
  (:mod:`pccl.tools.launch`).
* ``pccl status HOST:PORT`` prints a master's status endpoint as a table (``--json``: the JSON);
  the token as for ``master`` when the run has one.

``pccl demo`` and ``pccl bench`` are described in their modules.  A new sub-command is a parser in
``_build_parser`` and a handler in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence


from ..config import DEFAULT_MASTER_PORT, TLS_ENV, Config
from ..errors import PCCLError

__all__ = ["main"]

log = logging.getLogger("pccl.tools.cli")

_LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="pccl", description="pccl: fault-tolerant collective communications")
    parser.add_argument("--version", action="version", version=f"pccl {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("PCCL_LOG_LEVEL", "INFO"), choices=_LOG_LEVELS,
                        help="logging level (default: $PCCL_LOG_LEVEL or INFO); logs go to stderr")
    # The metavar lists the public sub-commands only: demo-peer is the demo's internal one.
    commands = parser.add_subparsers(dest="command", required=True, metavar="{master,relay,run,status,demo,bench}")

    master = commands.add_parser("master", help="run the master (orchestrator) of a run")
    master.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_MASTER_PORT}", metavar="HOST:PORT",
                        help=f"address to listen on (default 0.0.0.0:{DEFAULT_MASTER_PORT}; port 0 picks a free one)")
    token = master.add_mutually_exclusive_group()
    token.add_argument("--token", help="run token peers must prove (default: $PCCL_TOKEN; none = no authentication)")
    token.add_argument("--token-file", help="read the run token from this file (trailing newline stripped)")
    master.add_argument("--peer-timeout", type=float, default=Config.peer_timeout,
                        help="seconds of silence after which a peer is removed (default %(default)s)")
    master.add_argument("--heartbeat-interval", type=float, default=Config.heartbeat_interval,
                        help="seconds between heartbeats on idle connections (default %(default)s)")
    master.add_argument("--status", metavar="HOST:PORT",
                        help="serve the status page (/), /status.json and Prometheus /metrics here; a bare PORT "
                             "binds loopback (default: off); they require the run token when there is one")
    _add_tls_arguments(master)
    master.add_argument("--relay", action="store_true",
                        help="also relay: peer pairs that cannot connect to each other either way (both behind "
                             "NAT) meet at this master's port (see also `pccl relay`)")

    from ..relay import DEFAULT_RELAY_PORT

    relay = commands.add_parser("relay", help="run a relay for peer pairs that cannot connect either way")
    relay.add_argument("--master", required=True, metavar="HOST:PORT", help="the run's master")
    relay.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_RELAY_PORT}", metavar="HOST:PORT",
                       help=f"address to listen on for peers (default 0.0.0.0:{DEFAULT_RELAY_PORT})")
    relay.add_argument("--advertise", metavar="ADDR",
                       help="where peers reach this relay when that is not --listen (HOST:PORT, HOST or :PORT; "
                            "default: the --listen host, or the address the master sees when it is a wildcard)")
    relay_token = relay.add_mutually_exclusive_group()
    relay_token.add_argument("--token", help="the run token (default: $PCCL_TOKEN)")
    relay_token.add_argument("--token-file", help="read the run token from this file (trailing newline stripped)")
    relay.add_argument("--peer-timeout", type=float, default=Config.peer_timeout,
                       help="seconds of silence after which the master is given up and registered with again "
                            "(default %(default)s; the master's --peer-timeout)")
    relay.add_argument("--heartbeat-interval", type=float, default=Config.heartbeat_interval,
                       help="seconds between the relay's reports to the master (default %(default)s)")
    _add_tls_arguments(relay)

    from .launch import add_parser as _add_run

    _add_run(commands)

    status = commands.add_parser("status", help="print a master's status page as a table (needs master --status)")
    status.add_argument("address", metavar="HOST:PORT", help="the master's --status address")
    status_token = status.add_mutually_exclusive_group()
    status_token.add_argument("--token", help="the run token, when the run has one (default: $PCCL_TOKEN)")
    status_token.add_argument("--token-file", help="read the run token from this file")
    status.add_argument("--json", action="store_true", help="print /status.json as it is")
    status.add_argument("--events", type=int, default=10, help="recent events shown (default %(default)s)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    from . import demo

    demo.add_parsers(commands)

    bench = commands.add_parser("bench", help="all-reduce benchmark: a master and N peers as processes on loopback")
    from .bench import add_arguments as _bench_arguments

    _bench_arguments(bench)
    # --log-level also after the sub-command (``pccl master --log-level DEBUG``); SUPPRESS keeps
    # a sub-command from overwriting a level given before it with a default.
    for sub in {id(p): p for p in commands.choices.values()}.values():
        sub.add_argument("--log-level", default=argparse.SUPPRESS, choices=_LOG_LEVELS,
                         help="logging level (also accepted before the sub-command)")
    return parser


def _add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM certificate (chain): switches TLS on "
                        "(default: $PCCL_TLS_CERT); peers need TLS too (Config.with_tls / $PCCL_TLS_*)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (default: $PCCL_TLS_KEY)")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle to verify the peers' certificates with "
                        "(default: $PCCL_TLS_CA, else the system's CAs)")


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class _TokenFileError(Exception):
    pass


def _token(args: argparse.Namespace) -> str | None:
    """The run token from --token, --token-file or $PCCL_TOKEN (``_TokenFileError``, logged)."""
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().rstrip("\n")
        except (OSError, UnicodeDecodeError) as exc:
            log.error("cannot read the run token from --token-file %s: %s", args.token_file,
                      exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            raise _TokenFileError from exc
    return args.token if args.token is not None else os.environ.get("PCCL_TOKEN") or None


def _master_config(args: argparse.Namespace) -> Config:
    """The master's Config: timeouts from the flags; TLS from --tls-* (each falling back to its
    $PCCL_TLS_* variable)."""
    config = Config(peer_timeout=args.peer_timeout, heartbeat_interval=args.heartbeat_interval)
    env = {name: os.environ.get(name, "") for name in TLS_ENV}
    for flag, name in zip(("tls_cert", "tls_key", "tls_ca"), TLS_ENV):
        if getattr(args, flag):
            env[name] = getattr(args, flag)
    return config.with_tls_from_env(env)


def _run_master(args: argparse.Namespace) -> int:
    from ..master import run_master

    try:
        token = _token(args)
    except _TokenFileError:
        return 2
    run_master(args.listen, token=token, config=_master_config(args), status=args.status, relay=args.relay)
    return 0


def _run_relay(args: argparse.Namespace) -> int:
    from ..relay import run_relay

    try:
        token = _token(args)
    except _TokenFileError:
        return 2
    run_relay(args.master, args.listen, advertise=args.advertise, token=token, config=_master_config(args))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from .status_client import fetch_status
    from ..master import render_table

    try:
        token = _token(args)
    except _TokenFileError:
        return 2
    status = fetch_status(args.address, token=token, timeout=args.timeout)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print(render_table(status, events=args.events), end="")
    return 0


def _run_launcher(args: argparse.Namespace) -> int:
    from .launch import run_launcher

    return run_launcher(args)


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import run_driver

    return run_driver(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"master": _run_master, "relay": _run_relay,
                                                             "status": _run_status, "run": _run_launcher,
                                                             "bench": _run_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pccl`` console script; returns the exit status."""
    from . import demo

    args = _build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    commands = {**_COMMANDS, **demo.COMMANDS}
    try:
        return commands[args.command](args)
    except PCCLError as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
