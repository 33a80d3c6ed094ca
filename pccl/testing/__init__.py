"""pccl's test harness, as :mod:`trio.testing` is for trio: what pccl's own tests (and the
simulator) use instead of private names.  Not part of the public face (``import pccl`` does
not import it) and without any compatibility promise.

- Transports: :class:`MemoryNetwork`, :func:`memory_stream_pair`, :func:`memory_ring`, :func:`memory_mesh`
  (:mod:`pccl.testing.streams`); the transport contract every :class:`~pccl.net.base.Network`
  must pass, :mod:`pccl.testing.conformance`.
- Whole runs in the test's process: :func:`open_test_cluster`, :func:`admit`, :func:`each`,
  :func:`master_in_thread` (:mod:`pccl.testing.cluster`).
- Narrow hooks into a communicator (:mod:`pccl.testing.hooks`): its phase, ring lanes and ports
  as frozen snapshots; a forced re-wire; a call held on its way to its tag; raw messages to the master or on a lane; a broken
  lane; faults planted on its master link.
- Hooks into a master (:mod:`pccl.testing.master_hooks`): :func:`master_snapshot`, and for the
  simulator :func:`master_state` and :func:`install_master_state`.
- Faults planted in the data path for the tests that check the checkers
  (:mod:`pccl.testing.faults`).
- The runtime's pure parts, for their unit tests: :mod:`pccl.testing.units`.
"""

from __future__ import annotations

from . import conformance
from .cluster import MasterThread, TestCluster, admit, each, master_in_thread, open_test_cluster
from .faults import (
    PlantedFault,
    force_broadcast_algorithm,
    plant_attempt_fault,
    plant_backup_fault,
    plant_execute_fault,
    plant_kind_fault,
    plant_serving_fault,
    plant_staging_fault,
)
from .hooks import (
    AdmissionCounts,
    PhaseSnapshot,
    RingLanes,
    admission_counts,
    after_master_link_sends,
    break_lane,
    close_route,
    drop_master_link,
    fail_master_send,
    failure_of,
    force_rewire,
    hold_call_before_route,
    intercept_master_sends,
    lanes_from_predecessor,
    listener_address,
    open_route,
    peer_admission_limits,
    phase_of,
    hold_point_answers,
    hold_point_acks_sent,
    points_under_way,
    probe,
    probe_bound,
    receive_on_lane,
    ring_lanes,
    run_kind,
    send_data_on_lane,
    send_on_lane,
    send_raw,
)
from .master_hooks import MasterSnapshot, install_master_state, master_snapshot, master_state
from .streams import MemoryListener, MemoryNetwork, MemoryStream, memory_mesh, memory_ring, memory_stream_pair

__all__ = [
    "conformance",
    "MemoryStream", "MemoryListener", "MemoryNetwork", "memory_stream_pair", "memory_ring", "memory_mesh",
    "TestCluster", "open_test_cluster", "admit", "each", "MasterThread", "master_in_thread",
    "PhaseSnapshot", "phase_of", "failure_of", "force_rewire", "hold_call_before_route",
    "RingLanes", "ring_lanes", "send_on_lane", "send_data_on_lane", "receive_on_lane", "lanes_from_predecessor",
    "break_lane",
    "send_raw", "open_route", "close_route", "drop_master_link", "intercept_master_sends",
    "after_master_link_sends", "fail_master_send",
    "AdmissionCounts", "listener_address", "admission_counts", "peer_admission_limits",
    "points_under_way", "hold_point_answers", "hold_point_acks_sent", "probe", "probe_bound", "run_kind",
    "MasterSnapshot", "master_snapshot", "master_state", "install_master_state",
    "PlantedFault", "force_broadcast_algorithm", "plant_kind_fault", "plant_execute_fault", "plant_backup_fault", "plant_staging_fault", "plant_attempt_fault",
    "plant_serving_fault",
]
