"""SM partitions (CUDA green contexts) and the driver streams every GPU owner here runs on.

Why: the codec's Euler solve is ~3,500 small dependent kernels of 16-160 programs each, latency-bound. When the
language model's kernels fill every SM, each of those programs waits for an SM to drain: on an H200 a batch-1 solve
took 10.8 ms alone and 38.4 ms beside a saturating GEMM load, and 18.9 ms with the codec on 72 SMs of its own and
the load on the other 60 (docs/PERF_NOTES.md, session 12). (Those solves were graphs captured at the least priority,
which is what their kernels ran at whatever stream replayed them; captured urgent, the same solve took 24.2 ms
beside the load: engines.graphs.private_stream, session 32.) `split` makes the two partitions; a stream
belongs to one for life, and so does every kernel launched on it, also inside a CUDA graph captured on it
(replayed from any stream, a graph's kernels stay on the SMs of their capture stream's partition).

Streams made by `driver_stream` are created in the partition of the stream given as `like` (default: the current
stream), so an owner that makes its streams (capture streams, side branches) while its partition's stream is
current stays inside it without being told. Without a split every stream is in the device's primary context, as
before.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_RESOURCE_BYTES = 4 + 92 + 48  # CUdevResource (RESOURCE_ABI_VERSION 1): type, padding, union of 48 bytes
_SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount
_RESOURCE_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM: required by cuGreenCtxCreate
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: required by cuGreenCtxStreamCreate


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUresult {rc} ({(msg.value or b'?').decode()})")


def _sm_count_of(resource) -> int:
    return int.from_bytes(bytes(resource)[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little")


def _cu_device(device: torch.device) -> ctypes.c_int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.current_stream(idx).query()  # a runtime call: the device's primary context exists and is current
    dev = ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(dev), idx), "cuDeviceGet")
    return dev


@dataclass(frozen=True)
class SmSplit:
    """Two disjoint SM partitions of one device: `codec_sms` SMs for the codec, the other `lm_sms` for the
    language model and the speech encoder. `codec` and `lm` are green context handles."""

    device: torch.device
    codec_sms: int
    lm_sms: int
    codec: int
    lm: int

    def stream(self, part: str, urgent: bool = False) -> torch.cuda.ExternalStream:
        """A new stream of partition `part` ("codec" or "lm"); `urgent`: the most urgent priority."""
        if part not in ("codec", "lm"):
            raise ValueError(f"partition must be 'codec' or 'lm', got {part!r}")
        return _new_stream(self.codec if part == "codec" else self.lm, self.device,
                           _priority(self.device, 0 if urgent else None))


def split(device: torch.device | str, codec_sms: int) -> SmSplit:
    """Split the device's SMs into a partition of about `codec_sms` (the driver rounds up to its granularity: 8 on
    an H100/H200) and one of the rest. The partitions live as long as the process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"SM partitions need a CUDA device, got {device}")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < codec_sms < total:
        raise ValueError(f"codec SMs must be between 1 and {total - 1} on this GPU ({total} SMs), got {codec_sms}")
    lib, dev = _driver(), _cu_device(device)
    whole = (ctypes.c_ubyte * _RESOURCE_BYTES)()
    _check(lib.cuDeviceGetDevResource(dev, whole, _RESOURCE_SM), "cuDeviceGetDevResource")
    part, rest = (ctypes.c_ubyte * _RESOURCE_BYTES)(), (ctypes.c_ubyte * _RESOURCE_BYTES)()
    groups = ctypes.c_uint(1)
    _check(lib.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, ctypes.c_uint(0),
                                           ctypes.c_uint(codec_sms)), "cuDevSmResourceSplitByCount")
    if groups.value != 1 or _sm_count_of(rest) == 0:
        raise ValueError(f"{codec_sms} codec SMs leave none for the language model on this GPU ({total} SMs)")
    ctxs = []
    for res in (part, rest):
        desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), res, ctypes.c_uint(1)), "cuDevResourceGenerateDesc")
        _check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, ctypes.c_uint(_GREEN_CTX_DEFAULT_STREAM)),
               "cuGreenCtxCreate")
        ctxs.append(ctx.value)
    return SmSplit(device, _sm_count_of(part), _sm_count_of(rest), ctxs[0], ctxs[1])


def _new_stream(ctx: int | None, device: torch.device, priority: int) -> torch.cuda.ExternalStream:
    """A new non-blocking driver stream of CUDA priority `priority` in green context `ctx` (None: the device's
    primary context)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _cu_device(device)
        if ctx is not None:
            _check(_driver().cuGreenCtxStreamCreate(ctypes.byref(handle), ctypes.c_void_p(ctx),
                                                    ctypes.c_uint(_STREAM_NON_BLOCKING), ctypes.c_int(priority)),
                   "cuGreenCtxStreamCreate")
        else:
            _check(_driver().cuStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(_STREAM_NON_BLOCKING),
                                                        ctypes.c_int(priority)), "cuStreamCreateWithPriority")
    return torch.cuda.ExternalStream(handle.value, device=device)


def _priority(device: torch.device, level: int | None) -> int:
    """The CUDA priority `level` levels below the most urgent (never below the least); None: the least."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    least, greatest = _range(index)
    return least if level is None else min(greatest + level, least)


def green_context(stream: torch.cuda.Stream) -> int | None:
    """The green context (SM partition) `stream` belongs to, or None for the device's primary context."""
    return _green_context(stream.cuda_stream)


def _green_context(handle: int) -> int | None:
    ctx = ctypes.c_void_p()
    _check(_driver().cuStreamGetGreenCtx(ctypes.c_void_p(handle), ctypes.byref(ctx)), "cuStreamGetGreenCtx")
    return ctx.value or None


def level(stream: torch.cuda.Stream) -> int:
    """How many priority levels `stream` is below its context's most urgent (0: the most urgent). Asked first outside
    any capture (a query of a capturing stream's state would invalidate the capture); remembered per stream after
    that."""
    return _stream_level(stream.cuda_stream, stream.device_index)


def is_urgent(stream: torch.cuda.Stream) -> bool:
    """Whether `stream` has its context's most urgent priority."""
    return level(stream) == 0


@functools.cache  # by handle: streams here are never destroyed, and a stream keeps its priority
def _stream_level(handle: int, device_index: int) -> int:
    prio = ctypes.c_int()
    greatest = _range(device_index)[1]  # (asked first: the primary context exists)
    with torch.cuda.device(device_index):
        _check(_driver().cuStreamGetPriority(ctypes.c_void_p(handle), ctypes.byref(prio)), "cuStreamGetPriority")
    return prio.value - greatest


@functools.cache
def _range(device_index: int) -> tuple[int, int]:
    """The device's (least, most) urgent stream priorities (CUDA: lower numbers are more urgent), asked once."""
    device = torch.device("cuda", device_index)
    least, greatest = ctypes.c_int(), ctypes.c_int()
    with torch.cuda.device(device):
        _cu_device(device)  # the primary context exists (the first question may come before any CUDA work)
        _check(_driver().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
               "cuCtxGetStreamPriorityRange")
    return least.value, greatest.value


def driver_stream(device: torch.device | str | None = None, urgent: bool = False,
                  like: torch.cuda.Stream | None = None, level: int | None = None) -> torch.cuda.ExternalStream:
    """A new stream made by the driver (outside PyTorch's stream pool, never freed) in the SM partition of `like`
    (default: the device's current stream); in the primary context when that stream is in none. `urgent`: the most
    urgent priority (else the least); `level`: that many priority levels below the most urgent instead."""
    device = torch.device("cuda") if device is None else torch.device(device)
    with torch.cuda.device(device):
        _cu_device(device)  # the primary context is current before the driver is asked about a stream
        ctx = green_context(like if like is not None else torch.cuda.current_stream(device))
    return _new_stream(ctx, device, _priority(device, level if level is not None else 0 if urgent else None))


@functools.cache
def _green_sms(ctx: int) -> int:
    res = (ctypes.c_ubyte * _RESOURCE_BYTES)()
    _check(_driver().cuGreenCtxGetDevResource(ctypes.c_void_p(ctx), res, _RESOURCE_SM), "cuGreenCtxGetDevResource")
    return _sm_count_of(res)


def sm_count(device: torch.device) -> int:
    """SMs the current stream's kernels can use: its partition's, or the whole device's."""
    stream = torch.cuda.current_stream(device)
    return _stream_sms(stream.cuda_stream, stream.device_index)


@functools.cache  # by handle: streams here are never destroyed, so a handle keeps its partition
def _stream_sms(handle: int, device_index: int) -> int:
    ctx = _green_context(handle)
    return _green_sms(ctx) if ctx is not None else torch.cuda.get_device_properties(device_index).multi_processor_count
