"""pccl: fault-tolerant collective communications over the internet, on Trio."""

from .config import Config
from .errors import (
    AuthenticationFailed,
    CollectiveAborted,
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    MasterUnreachable,
    PCCLError,
    PeerDisconnected,
    ProtocolError,
    RevisionViolation,
    CheckpointError,
    SharedStateSyncFailed,
    TooFewPeers,
    PhaseMismatch,
    TopologyUpdateFailed,
    TransferTimeout,
)
from .types import (CollectiveInfo, DType, Gathered, Lineage, Quantization, QuantKind, ReduceInfo, ReduceOp, Shard,
                    SyncInfo, SyncReason, SyncStrategy)
from .communicator import Communicator, CommunicatorStatistics, open_communicator
from .master import Master, MasterStatistics, open_master, serve_master
from .shared_state import SharedState, Tensor
from . import blocking  # pccl.blocking: the same API for synchronous loops
from . import checkpoint  # pccl.checkpoint.save / load: a shared state on disk

#: The package version: the one string the distribution's metadata and ``pccl --version`` use.
__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "CommunicatorStatistics",
    "Master",
    "MasterStatistics",
    "open_communicator",
    "open_master",
    "serve_master",
    "AuthenticationFailed",
    "CollectiveAborted",
    "CollectiveInfo",
    "Config",
    "DType",
    "Gathered",
    "InvalidArgument",
    "InvalidUsage",
    "Kicked",
    "KickReason",
    "Lineage",
    "MasterUnreachable",
    "PCCLError",
    "PeerDisconnected",
    "ProtocolError",
    "Quantization",
    "QuantKind",
    "ReduceInfo",
    "ReduceOp",
    "RevisionViolation",
    "CheckpointError",
    "SharedState",
    "SharedStateSyncFailed",
    "Shard",
    "SyncInfo",
    "SyncReason",
    "SyncStrategy",
    "Tensor",
    "TooFewPeers",
    "PhaseMismatch",
    "TopologyUpdateFailed",
    "TransferTimeout",
    "__version__",
    "blocking",
    "checkpoint",
]
