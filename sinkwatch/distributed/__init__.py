"""Live probes under data and model parallelism (docs/design.md §7), one module per idea:

- ``layout``: which rank probes, which layouts are refused, and how a sharded model is gathered for a
  probe and given back after it (``ProbeLayout``);
- ``agreement``: the rank protocol, owned by ``ProbeGroup.run`` (the agreements before, during and
  after a probe, the verdict on a fault, the combination of the shares);
- ``forwards``: the probe forwards of ranks that probe together (one agreement before each, faults
  held to its end, equal forward counts);
- ``tensor_parallel``: tensor parallelism, one mechanism for every adapter (``TensorParallel``);
- ``protocol``: the codes an agreement carries and the exceptions of a probe that cannot go on;
- ``testing``: test-only fault injection (``SINKWATCH_TEST_FAULT``).
"""

from .agreement import (
    Outcome,
    ProbeGroup,
    config_token,
    describe,
    fault_signature,
    is_out_of_memory,
    shared_max_steps,
)
from .forwards import GroupForwards
from .layout import (
    ProbeLayout,
    RankFacts,
    check_layout,
    dtype_name,
    eager_forwards,
    fsdp1_param_dtype,
    fsdp2_param_dtype,
    group_device,
    is_fsdp,
    probe_compute_dtype,
    rank_facts,
    reshard,
    tensor_parallel_params,
)
from .protocol import COMBINE, DONE, FAIL, FORWARD, START, PeerFailed, ProbeFaultEverywhere, ProbeForwardBroken, ProbeNotReady
from .tensor_parallel import TensorParallel, hand_sliced_params
from .testing import FAULT_ENV, FAULT_POINTS, InjectedFault, fault_point

__all__ = [
    "COMBINE",
    "DONE",
    "FAIL",
    "FAULT_ENV",
    "FAULT_POINTS",
    "FORWARD",
    "START",
    "TensorParallel",
    "GroupForwards",
    "InjectedFault",
    "Outcome",
    "PeerFailed",
    "ProbeFaultEverywhere",
    "ProbeForwardBroken",
    "ProbeGroup",
    "ProbeLayout",
    "ProbeNotReady",
    "RankFacts",
    "check_layout",
    "config_token",
    "describe",
    "dtype_name",
    "eager_forwards",
    "fault_point",
    "fault_signature",
    "fsdp1_param_dtype",
    "fsdp2_param_dtype",
    "group_device",
    "hand_sliced_params",
    "is_fsdp",
    "is_out_of_memory",
    "probe_compute_dtype",
    "rank_facts",
    "shared_max_steps",
    "reshard",
    "tensor_parallel_params",
]
