"""Overlapped pingpong epilogues (SM90): both consumer warpgroups may run their epilogues at once.

quack 0.6.5's pingpong kernel alternates the two consumer warpgroups' mainloops and also their
epilogues: one ``epi`` barrier pair hands the epilogue over, and everything an epilogue uses is shared
(the C ring, the epilogue ops' shared memory and staged output buffers, the ``Epilogue`` named
barrier), so a warpgroup's epilogue starts only after the other's has drained its stores. Where the
epilogue is longer than the mainloop (B3: three 8-bit outputs, two of them transposed, and a read of
``a``, after a short fp8 or bf16 mainloop; docs/fp8.md "B3's time, split") the tile rate is set by
the epilogue alone. With ``ATTR`` set on a kernel (a post-init attribute: part of its compile key, set
for the calls that ask for it, ``requested``), that kernel gives each warpgroup its own:

* epilogue: the ``epi`` pingpong barriers are no-ops (the mainloops still alternate on ``mma``);
* shared memory for the epilogue ops (two copies of their struct, each warpgroup's tensors offset to
  its own; ``epi_smem_struct`` / ``epi_smem_tensors``), staged output buffers included;
* named barrier: the ids the ``epi`` barriers freed, instead of the shared ``Epilogue`` one;
* half of the C ring: its pipeline states are ``_HalfRingState`` views whose index is offset to the
  warpgroup's half and wraps inside it, derived from the shared state's count (warpgroup w's j-th tile
  starts at count (2j + w) x subtiles); the C stage count is made even;
* A/B stage count, recomputed with the second copy in the budget (``setup_attributes``).

The TMA stores need nothing more: a bulk-async group belongs to the thread that commits it, and each
warpgroup's TMA thread waits only for its own. D's staged buffers (outside the ops' struct) are one
ring that each warpgroup takes half of, with a store pipeline of half the stages (``_half_d_ring``,
``store_pipeline``). Everything here is inert for kernels without ``ATTR``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.pipeline import NamedBarrier, PipelineState

from .patches import add_post_init_attrs

ATTR = "_coda_overlap_epilogues"
_REQUESTED = contextvars.ContextVar("coda_overlap_epilogues", default=False)
WG_THREADS = 128


@contextlib.contextmanager
def requested():
    """quack GEMMs compiled inside this block get ``ATTR`` (``patches.add_post_init_attrs``)."""
    token = _REQUESTED.set(True)
    try:
        yield
    finally:
        _REQUESTED.reset(token)


def enabled(default: bool) -> bool:
    """Whether a program that can (B3 with transposed outputs) asks for it: ``CODA_TITAN_OVERLAP_EPILOGUES``
    = 1 or 0 for every such program, else the program's measured ``default`` (``probe_overlap_…json``,
    ``probe_fp8_configs_…json``: faster on B3's fp8 GEMM, slower on its bf16 GEMM)."""
    env = os.environ.get("CODA_TITAN_OVERLAP_EPILOGUES")
    return default if env is None else env != "0"


@contextlib.contextmanager
def _temporarily(obj, **attrs):
    """``obj``'s attributes set to ``attrs`` inside the block (at trace time), then restored (or removed)."""
    old = {k: obj.__dict__[k] for k in attrs if k in obj.__dict__}
    obj.__dict__.update(attrs)
    try:
        yield
    finally:
        for k in attrs:
            if k in old:
                obj.__dict__[k] = old[k]
            else:
                del obj.__dict__[k]


def _on(gemm) -> bool:
    return bool(getattr(gemm, ATTR, False))


class _HalfRingState(PipelineState):
    """A pipeline state over one warpgroup's half of a ring: ``index`` is ``base`` + the local index,
    which wraps at ``stages`` (the half's length)."""

    def __init__(self, stages: int, count, index, phase, base):
        super().__init__(stages, count, index, phase)
        self._base = base

    @property
    def index(self):
        return self._index + self._base

    def clone(self, *, loc=None, ip=None):
        return _HalfRingState(self._stages, self._count, self._index, self._phase, self._base)

    def advance(self, count=1, *, loc=None, ip=None):
        assert count == 1, "the epilogue advances its C states one stage at a time"
        self._count += 1
        nxt = self._index + 1
        wrap = nxt == self._stages
        self._index = cutlass.select_(wrap, Int32(0), nxt)
        self._phase = cutlass.select_(wrap, self._phase ^ 1, self._phase)

    def __get_mlir_types__(self):
        return [self._count.type, self._index.type, self._phase.type, self._base.type]

    def __extract_mlir_values__(self):
        return [v.ir_value() for v in (self._count, self._index, self._phase, self._base)]

    def __new_from_mlir_values__(self, values):
        return _HalfRingState(self._stages, *(Int32(v) for v in values))


def _warp_group() -> Int32:
    """This thread's consumer warpgroup (0 or 1; the producer warps map to 0, they use no op smem)."""
    tidx, _, _ = cute.arch.thread_idx()
    return cute.arch.make_warp_uniform((tidx // WG_THREADS) % 2)


def _struct_bytes(struct) -> int:
    return struct.size_in_bytes() if hasattr(struct, "size_in_bytes") else 0


def epi_smem_struct(original):
    def patched(self, params):
        struct = original(self, params)
        if not _on(self) or _struct_bytes(struct) == 0:
            return struct
        padded = -(-_struct_bytes(struct) // 1024) * 1024
        self._coda_op_smem_bytes = padded  # (epi_smem_tensors offsets warpgroup 1's tensors by it)
        fields = {"wg0": struct, "wg1": cute.struct.Align[cute.struct.MemRange[cutlass.Int8, padded], 1024]}
        return cute.struct(type("OverlapEpiSharedStorage", (), {"__annotations__": fields}))
    return patched


def _offset(t, wg, nbytes: int):
    """``t`` moved ``wg`` x ``nbytes`` bytes on, keeping its alignment (a multiple of 1024 bytes)."""
    if t is None:
        return None
    if isinstance(t, (tuple, list)):
        return type(t)(_offset(x, wg, nbytes) for x in t)
    if not isinstance(t, cute.Tensor):
        return t
    elems = nbytes * 8 // t.element_type.width
    return cute.make_tensor(t.iterator + cute.assume(wg * elems, divby=elems), t.layout)


def epi_smem_tensors(original):
    def patched(self, params, storage):
        if not _on(self) or not getattr(self, "_coda_op_smem_bytes", 0):
            return original(self, params, storage)
        tensors = original(self, params, SimpleNamespace(epi=storage.epi.wg0))
        wg = _warp_group()
        return {name: _offset(t, wg, self._coda_op_smem_bytes) for name, t in tensors.items()}
    return patched


def pingpong_barrier(original):
    def patched(self, warp_group_idx, stage, *args, **kwargs):
        if _on(self) and stage == "epi":
            return None  # (each warpgroup's epilogue has its own resources)
        return original(self, warp_group_idx, stage, *args, **kwargs)
    return patched


def setup_attributes(original):
    def patched(self, epilogue_args):
        if not _on(self):
            return original(self, epilogue_args)
        if not self.pingpong or getattr(self, "split_k", 1) != 1:
            raise ValueError("overlapped epilogues: pingpong kernels without split-K only")
        base = type(self)._compute_stages

        def compute(cta, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, args, capacity, occupancy, warp_shape=None,
                    **kw):
            ab, epi, c = base(cta, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, args, capacity, occupancy,
                              warp_shape, **kw)
            op = type(self).epi_smem_bytes(args, cta, epi_tile, warp_shape)
            # D's staged buffers are one ring that the warpgroups halve: 2 stages more than quack's count (at least
            # its minimum, 2), reserved with the second copy of the ops' smem (sized for the most stages it can get)
            extra = 0 if d_dtype is None else 2
            stage_bytes = 0 if d_dtype is None else cute.size(cute.shape(epi_tile)) * d_dtype.width // 8
            most = epi + extra
            copy = -(-(op.unstaged + op.d_stage * most + op.c_stage * c) // 1024) * 1024 + 1024
            reserve = copy + extra * (stage_bytes + op.d_stage)
            ab2, epi2, c2 = base(cta, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, args, capacity - reserve,
                                 occupancy, warp_shape, **kw)
            epi2, c2 = min(epi2 + extra, most), c2 - c2 % 2
            if d_dtype is not None:
                epi2 -= epi2 % 2
            if ab2 < 2 or c2 < 2 or epi2 < (4 if d_dtype is not None else 1):
                raise ValueError(f"overlapped epilogues do not fit: {ab2} A/B, {epi2} store, {c2} C stages")
            return ab2, epi2, c2

        with _temporarily(self, _compute_stages=compute):
            return original(self, epilogue_args)
    return patched


def epilogue(original):
    def patched(self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, epi_read_state,
                epi_producer_state, epi_tile, load_acc_subtile, *args, **kwargs):
        if not _on(self):  # (plain Python at trace time: the branch is the kernel's, not the device's)
            return original(self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, epi_read_state,
                            epi_producer_state, epi_tile, load_acc_subtile, *args, **kwargs)
        wg = _warp_group()
        subtiles = cute.size(self.epi_tile_shape)
        half = self.epi_c_stage // 2
        local = (epi_read_state.count - wg * subtiles) // 2  # this warpgroup's tiles so far x subtiles
        lap = (local // half) % 2
        read = _HalfRingState(half, local, local % half, lap, wg * half)
        produce = _HalfRingState(half, local, local % half, lap ^ 1, wg * half)
        kwargs["epilogue_barrier"] = NamedBarrier(
            barrier_id=Int32(int(_epi_wg0())) + wg, num_threads=WG_THREADS
        )
        kwargs["tile_scheduler"] = SimpleNamespace(num_tiles_executed=local // subtiles)
        stages = {"epi_c_stage": half}  # (the epilogue's C prefetch depth: this warpgroup's half)
        if self.d_dtype is not None:  # D's ring: this warpgroup's half of the staged buffers
            stages["epi_stage"] = self.epi_stage // 2
            _half_d_ring(self, kwargs, wg, self.epi_stage)
        with _temporarily(self, **stages):
            original(self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, read, produce, epi_tile,
                     load_acc_subtile, *args, **kwargs)
        epi_read_state.advance(subtiles)
        epi_producer_state.advance(subtiles)
        return epi_read_state, epi_producer_state
    return patched


def _half_d_ring(gemm, kwargs, wg, stages: int) -> None:
    """Point D's register-to-shared view and its TMA store at warpgroup ``wg``'s half of D's ``stages``
    staged buffers (the epilogue indexes them 0 .. stages / 2 - 1)."""
    half = stages // 2
    per_stage = cute.size(cute.shape(gemm.epi_tile))  # (one staged buffer: the epilogue subtile)
    sD = kwargs["tRS_sD"]
    kwargs["tRS_sD"] = cute.make_tensor(sD.iterator + cute.assume(wg * (half * per_stage), divby=half * per_stage),
                                        sD.layout)
    copy_d = kwargs["copy_D"]
    kwargs["copy_D"] = lambda src_idx, dst_idx, **kw: copy_d(src_idx=src_idx + wg * half, dst_idx=dst_idx, **kw)


def store_pipeline(original):
    def patched(self):
        if not (_on(self) and self.d_dtype is not None):
            return original(self)
        with _temporarily(self, epi_stage=self.epi_stage // 2):  # (each warpgroup's TMA thread: its half of D's)
            return original(self)
    return patched


def _epi_wg0():
    from quack.gemm_base import NamedBarrierGemm

    assert NamedBarrierGemm.EpiWG1 == NamedBarrierGemm.EpiWG0 + 1
    return NamedBarrierGemm.EpiWG0


def _requested_attrs(A):
    return ((ATTR, True),) if _REQUESTED.get() else ()  # (this code's version: kernel_cache's folder)


def install() -> None:
    """Patch quack's SM90 GEMM and epilogue mixin (idempotent); inert unless a kernel carries ``ATTR``."""
    from quack.epilogue.mixin import ComposableEpiMixin
    from quack.gemm_base import GemmBase, GemmTmaBase
    from quack.gemm_sm90 import GemmSm90

    if getattr(GemmBase.epilogue, "_coda_overlap", False):
        return
    add_post_init_attrs(_requested_attrs)
    ComposableEpiMixin.epi_get_smem_struct = epi_smem_struct(ComposableEpiMixin.epi_get_smem_struct)
    ComposableEpiMixin.epi_get_smem_tensors = epi_smem_tensors(ComposableEpiMixin.epi_get_smem_tensors)
    GemmSm90.pingpong_barrier_sync = pingpong_barrier(GemmSm90.pingpong_barrier_sync)
    GemmSm90.pingpong_barrier_arrive = pingpong_barrier(GemmSm90.pingpong_barrier_arrive)
    GemmSm90._setup_attributes = setup_attributes(GemmSm90._setup_attributes)
    GemmBase.epilogue = epilogue(GemmBase.epilogue)
    GemmBase.epilogue._coda_overlap = True
    GemmTmaBase.make_epi_store_pipeline = store_pipeline(GemmTmaBase.make_epi_store_pipeline)
