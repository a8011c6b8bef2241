"""Live monitoring under the settings real runs use (issue 25): backend strings, compile, schedules,
short first batches, skipped probes, early stopping, DeepSpeed's step in backward, mixed precision."""

from __future__ import annotations

from unittest import mock

import pytest

from sinkwatch import distributed


# ---- item 5: the agreements' device comes from the group's device types -------------------------
@pytest.mark.parametrize(
    ("backend", "prefer", "want"),
    [
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # OLMo-core's default string, a CPU model
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),  # ... and a CUDA model: NCCL, never a CPU detour
        ("cuda:nccl", "cpu", "cuda"),  # an NCCL-only group never gets a CPU tensor
        ("nccl", None, "cuda"),
        ("gloo", None, "cpu"),
        ("gloo", "cuda", "cuda"),
    ],
)
def test_probe_group_device_follows_the_groups_device_types(backend, prefer, want):
    with (
        mock.patch("torch.distributed.get_backend", return_value=backend),
        mock.patch.object(distributed, "global_rank", return_value=0),
        mock.patch("torch.cuda.is_available", return_value=False),
    ):
        group = distributed.ProbeGroup(2, prefer=prefer)
    assert group.device.type == want, (backend, prefer, group.device)


def test_an_nccl_only_backend_string_gets_cuda_tensors():
    with (
        mock.patch("torch.distributed.get_backend", return_value="cuda:nccl"),
        mock.patch.object(distributed, "global_rank", return_value=0),
        mock.patch("torch.cuda.is_available", return_value=False),
    ):
        assert distributed.ProbeGroup(2).device.type == "cuda"
