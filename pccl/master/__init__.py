"""The master: its Trio server (:mod:`.server`), the status endpoint (:mod:`.status_endpoint`)
and the page it renders (:mod:`.status_page`).  The consensus rules themselves are sans-IO, in
:mod:`pccl.protocol`."""

from ..protocol.status import SCHEMA as STATUS_SCHEMA
from .server import Master, MasterStatistics, open_master, run_master, serve_master
from .status_endpoint import split_status_address
from .status_page import render_table

__all__ = ["Master", "MasterStatistics", "open_master", "serve_master", "run_master",
           # the status endpoint's face, for clients (``pccl status``)
           "STATUS_SCHEMA", "split_status_address", "render_table"]
