"""THE top-k engine dispatch predicate, its launch table and the preallocated workspace.

One function, :func:`choose_topk_engine`, decides the engine from (requested engine, CuTe-DSL
available, SM version, ``index_topk``, compress ratio); the DSA selector calls it when it is
built and the metadata side (:class:`TopKWorkspace`) sizes its buffers from the same decision,
so the two can never disagree. The decision is a value (:class:`TopKDecision`) that records
why it was taken. Forcing an engine the device cannot run raises ``ValueError``; nothing falls
back silently.

==============  ==========================================================================
engine          runs when
==============  ==========================================================================
``cute_gvr``    CuTe-DSL GVR kernel importable (``cute_dsl_available``), CUDA SM in
                {90, 100, 103}, ``index_topk`` in {512, 1024, 2048}, compress ratio in
                {1, 4}   (``auto`` picks it then)
``gvr``         Triton on any CUDA GPU (``auto`` otherwise), or on CPU under
                ``TRITON_INTERPRET=1`` when forced
``radix``       as ``gvr``; never picked by ``auto`` (the exact baseline)
``torch``       anywhere; ``auto`` on CPU
==============  ==========================================================================
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from ..common import launch
from . import naive

__all__ = ["ENGINES", "CUTE_SMS", "CUTE_TOPKS", "CUTE_COMPRESS_RATIOS", "TopKDecision", "TopKLaunch",
           "TopKWorkspace", "choose_topk_engine", "cute_dsl_available", "device_sm", "run_topk", "topk_launch"]

ENGINES = ("auto", "torch", "radix", "gvr", "cute_gvr")
CUTE_SMS = frozenset({90, 100, 103})
CUTE_TOPKS = frozenset({512, 1024, 2048})
CUTE_COMPRESS_RATIOS = frozenset({1, 4})
GVR_CAPACITY_FACTOR = 4  # candidate scratch per program = 4 * k entries


@dataclass(frozen=True)
class TopKLaunch:
    """Launch parameters of the Triton top-k kernels for one arch key of ``launch.py``."""

    block: int  # row entries per loop trip
    num_warps: int
    programs_per_sm: int  # persistent programs = programs_per_sm * SMs (capped by the rows)


# interpreter: one 4096-wide numpy op per trip beats many small ones.
TOPK_LAUNCH: dict[str, TopKLaunch] = {
    "interpreter": TopKLaunch(block=4096, num_warps=4, programs_per_sm=8),
    "sm90": TopKLaunch(block=1024, num_warps=8, programs_per_sm=4),
    "sm100": TopKLaunch(block=1024, num_warps=8, programs_per_sm=4),
    "other": TopKLaunch(block=1024, num_warps=8, programs_per_sm=2),
}


def topk_launch(arch: str) -> TopKLaunch:
    if arch not in TOPK_LAUNCH:
        raise ValueError(f"arch: expected one of {sorted(TOPK_LAUNCH)}, got {arch!r}")
    return TOPK_LAUNCH[arch]


CUTE_GVR_MODULE = "kvsieve.kernels.topk.cute.host"


def cute_dsl_available() -> bool:
    """Whether a CuTe-DSL GVR kernel can be launched here: the CuTe-DSL package
    (``nvidia-cutlass-dsl``, the ``cute`` extra) is importable *and* the kernel module
    ``CUTE_GVR_MODULE`` is present. ``auto`` also needs a CUDA device of SM 90/100/103."""
    if importlib.util.find_spec("cutlass") is None:
        return False
    try:
        return importlib.util.find_spec(CUTE_GVR_MODULE) is not None
    except ModuleNotFoundError:
        return False


def device_sm(device: torch.device) -> int | None:
    """SM version (``major * 10 + minor``) of a CUDA device, ``None`` for any other device."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@dataclass(frozen=True)
class TopKDecision:
    """What :func:`choose_topk_engine` decided, and why (``reason`` is for humans and logs)."""

    engine: str
    requested: str
    index_topk: int
    device_type: str
    sm: int | None
    reason: str

    @property
    def gvr_capacity(self) -> int:
        return GVR_CAPACITY_FACTOR * self.index_topk


def choose_topk_engine(requested: str, *, device: torch.device | str, index_topk: int, compress_ratio: int = 1,
                       cute_available: bool | None = None, sm: int | None = None) -> TopKDecision:
    """The dispatch predicate (see the module table). ``cute_available``/``sm`` default to what
    this process sees; tests pass them to exercise other machines."""
    if requested not in ENGINES:
        raise ValueError(f"topk_engine: expected one of {list(ENGINES)}, got {requested!r}")
    if index_topk < 1:
        raise ValueError(f"index_topk: expected >= 1, got {index_topk}")
    if compress_ratio < 1:
        raise ValueError(f"compress_ratio: expected >= 1, got {compress_ratio}")
    dev = torch.device(device)
    cute = cute_dsl_available() if cute_available is None else cute_available
    if sm is None:
        sm = device_sm(dev)
    cuda = dev.type == "cuda"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    cute_blockers = [why for ok, why in (
        (cute, "the CuTe-DSL GVR kernel is unavailable (needs pip install 'kvsieve[cute]' and the "
               f"{CUTE_GVR_MODULE} module, which this build does not ship)"),
        (cuda and sm in CUTE_SMS, f"needs a CUDA device with SM in {sorted(CUTE_SMS)}, got {dev.type} SM {sm}"),
        (index_topk in CUTE_TOPKS, f"index_topk must be in {sorted(CUTE_TOPKS)}, got {index_topk}"),
        (compress_ratio in CUTE_COMPRESS_RATIOS,
         f"compress_ratio must be in {sorted(CUTE_COMPRESS_RATIOS)}, got {compress_ratio}"),
    ) if not ok]

    def decide(engine: str, reason: str) -> TopKDecision:
        return TopKDecision(engine, requested, index_topk, dev.type, sm, reason)

    if requested == "auto":
        if not cute_blockers:
            return decide("cute_gvr", "auto: CuTe-DSL GVR predicate holds")
        if cuda:
            return decide("gvr", "auto: Triton GVR (CuTe-DSL GVR: " + "; ".join(cute_blockers) + ")")
        return decide("torch", f"auto: {dev.type} device, torch.topk")
    if requested == "torch":
        return decide("torch", "forced")
    if requested == "cute_gvr":
        if cute_blockers:
            raise ValueError("topk_engine='cute_gvr' cannot run here: " + "; ".join(cute_blockers))
        return decide("cute_gvr", "forced")
    if not (cuda or interp):
        raise ValueError(f"topk_engine={requested!r} is a Triton kernel: it needs a CUDA device or "
                         f"TRITON_INTERPRET=1 (tests), got device {dev.type}")
    return decide(requested, "forced")


class TopKWorkspace:
    """Buffers an engine needs, preallocated once for ``max_rows`` rows (CUDA-graph safe).

    ``gvr``: candidate scratch ``[2, P, 4 * index_topk]`` int32 for ``P`` persistent programs;
    the other engines need none. ``out [max_rows, index_topk]`` int32 receives the result.
    """

    def __init__(self, decision: TopKDecision, max_rows: int, device: torch.device | str) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows: expected >= 1, got {max_rows}")
        dev = torch.device(device)
        self.decision = decision
        self.max_rows = max_rows
        self.arch = launch.detect_arch(dev)
        self.launch = topk_launch(self.arch)
        self.programs = max(1, min(max_rows, self.launch.programs_per_sm * launch.NUM_SMS[self.arch]))
        self.out = torch.empty(max_rows, decision.index_topk, dtype=torch.int32, device=dev)
        self.scratch = None
        if decision.engine == "gvr":
            self.scratch = torch.empty(2, self.programs, decision.gvr_capacity, dtype=torch.int32, device=dev)


def run_topk(workspace: TopKWorkspace, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Top-``index_topk`` of each row with the decided engine, into ``workspace.out`` (a view of
    its first rows is returned). Arguments as in ``naive``."""
    d = workspace.decision
    rows = scores.shape[0]
    if rows > workspace.max_rows:
        raise ValueError(f"scores: {rows} rows exceed the workspace's max_rows={workspace.max_rows}")
    out = workspace.out[:rows]
    k, cfg = d.index_topk, workspace.launch
    if d.engine == "torch":
        out.copy_(naive.torch_topk(scores, lengths, k))
        return out
    from . import triton as triton_topk  # decorates the Triton kernels on first use (TRITON_INTERPRET is read then)

    if d.engine == "radix":
        return triton_topk.radix_topk(scores, lengths, k, block=cfg.block, num_programs=workspace.programs,
                                 num_warps=cfg.num_warps, out=out)
    if d.engine == "gvr":
        return triton_topk.gvr_topk(scores, lengths, k, d.gvr_capacity, workspace=workspace.scratch,
                               block=cfg.block, num_warps=cfg.num_warps, out=out)
    cute_kernel = importlib.import_module(CUTE_GVR_MODULE)  # present whenever the predicate chose it
    return cute_kernel.gvr_topk(scores, lengths, k, out=out)
