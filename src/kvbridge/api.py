"""kvbridge's public API: what engines, tools and examples import.

Everything here is stable within a minor version; anything imported from elsewhere in
the package is internal. ``import kvbridge`` gives the same names, loaded on first use.

Describe the model        load_model, from_hf_config (a config.json's dict), ModelSpec,
                          Group, Layer, Kind, DType, Parallel and one builder per cache
                          kind (attention, mla, mamba2, mamba1, gated_deltanet,
                          kimi_delta, state_tensor), group_by_kind
Say where it lives        SideConfig (one instance's shape), build_layout, layout_names,
                          register_layout, RankLayout, View;
                          engine tensors: RegionSet, TensorDesc, tensor_views;
                          where memory lives: MemKind (host or a GPU's)
Plan (no I/O)             Geometry, Side, Bound, Plan; block tables: Tables,
                          checked_tables
Move bytes                make_transport, register_transport, transport_names,
                          Transport, Region, XferHandle, XferState; read_runs (post a
                          plan's runs by READ in requests, wait for them by a deadline);
                          local copies where the memory is (CPU or GPU): byte_tensor
                          (a Region as a uint8 tensor aliasing it: the caller keeps the
                          memory alive), rows_copy (equal-length runs, each checked inside
                          its tensor; overlapping destination runs are the caller's bug)
Connect P and D           Producer, ProducerWorker, Consumer, TransferHandle, Outcome,
                          Mode, Policy, LoadState, Keys, RankInfo
Errors                    KVBridgeError and its subclasses
"""

from kvbridge import _API
from kvbridge.connector import (
    Consumer,
    LoadState,
    Mode,
    Outcome,
    Policy,
    Producer,
    ProducerWorker,
    TransferHandle,
)
from kvbridge.connector.movers.device_copies import rows_copy
from kvbridge.connector.movers.pull import read_runs
from kvbridge.control.messages import RankInfo
from kvbridge.control.security import Keys
from kvbridge.errors import (
    ConfigError,
    IdentityError,
    IncompatibleError,
    KVBridgeError,
    LayoutError,
    LeaseExpired,
    PeerError,
    PlanError,
    PromptMismatch,
    SpecError,
    TopologyError,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from kvbridge.layout import (
    RankLayout,
    SideConfig,
    View,
    build_layout,
    layout_names,
    register_layout,
)
from kvbridge.layout.tensor import MemKind, RegionSet, TensorDesc, tensor_views
from kvbridge.plan import Bound, Geometry, Plan, Side
from kvbridge.plan.tables import Tables, checked_tables
from kvbridge.spec import (
    DType,
    Group,
    Kind,
    Layer,
    ModelInfo,
    ModelSpec,
    Parallel,
    Segment,
    Stream,
    attention,
    from_hf_config,
    gated_deltanet,
    group_by_kind,
    kimi_delta,
    load_model,
    mamba1,
    mamba2,
    mla,
    parse_dtype,
    shard_interval,
    state_tensor,
)
from kvbridge.transport import (
    Region,
    Transport,
    XferHandle,
    XferState,
    make_transport,
    register_transport,
    transport_names,
)
from kvbridge.transport.memory import byte_tensor

__all__ = sorted(_API)
"""The names listed in :data:`kvbridge._API`, each imported above."""
