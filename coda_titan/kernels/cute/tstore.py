"""Transposed (M-major) 8-bit epilogue outputs stored with ``stmatrix.trans`` (SM90).

quack 0.6.5 stores an 8-bit M-major output through its universal register-to-shared copy, one byte
per instruction: a WGMMA accumulator fragment holds two adjacent columns of rows r and r + 8, and no
two adjacent rows. ``InterleavedTransposedStore`` packs, per column, the bytes of rows r and r + 8 into
one 16-bit unit: that is the 8 x 8 b16 fragment ``stmatrix.trans`` stores, one 16-byte row (16 tokens
of one feature) per lane address, four matrices per instruction.

The price is the order of the tokens: within each group of 16 they land as 0, 8, 1, 9, ..., 7, 15
(``coda_titan.kernels.scaling.interleave16`` is the same order in torch). A weight gradient sums over
the tokens, so it is unchanged when its other operand comes in the same order (docs/fp8.md, "Transposed
8-bit stores through stmatrix.trans").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.copy_utils import swizzle_int
from quack.epilogue.ops import TileStore
from quack.utils import elem_pointer


def _pack_op(kind: str):
    """f32 (r, c), (r + 8, c), (r, c + 1), (r + 8, c + 1) -> one 32-bit word of two b16 units: the low unit
    holds column c, the high unit column c + 1; each unit's low byte is row r, its high byte row r + 8
    (``cvt ... d, a, b`` puts a in the high byte)."""
    asm = ("{.reg .b16 l, h;\n"
           f"cvt.rn.satfinite.{kind}x2.f32 l, $2, $1;\n"
           f"cvt.rn.satfinite.{kind}x2.f32 h, $4, $3;\n"
           "mov.b32 $0, {l, h};}")

    @dsl_user_op
    def pack(r0c0: Float32, r8c0: Float32, r0c1: Float32, r8c1: Float32, *, loc=None, ip=None) -> Int32:
        args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (r0c0, r8c0, r0c1, r8c1)]
        return Int32(llvm.inline_asm(T.i32(), args, asm, "=r,f,f,f,f", has_side_effects=False,
                                     is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    return pack


_PACK = {"e4m3": _pack_op("e4m3"), "e5m2": _pack_op("e5m2")}


@dsl_user_op
def _stmatrix_x4_trans(addr: Int32, w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int32(v).ir_value(loc=loc, ip=ip) for v in (addr, w0, w1, w2, w3)],
                    "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _shared_addr(ptr) -> Int32:
    """The physical shared-memory address of a (possibly swizzled) smem pointer."""
    swz = ptr.type.swizzle_type
    if const_expr(swz is None):
        return ptr.toint()
    return swizzle_int(ptr.toint(), swz.num_bits, swz.num_base, swz.num_shift)


# Where a thread's (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1) sit in its epilogue fragment, per
# 8-column block b: "a" = the WGMMA accumulator's own order (4b .. 4b + 3); "b" = 16-column stmatrix
# atoms whose second matrix is the next 8 columns. ``scripts/probes/fp8_trans_store.py`` decides.
_SLOTS = {
    "a": lambda b: (4 * b, 4 * b + 1, 4 * b + 2, 4 * b + 3),
    "b": lambda b: tuple(8 * (b // 2) + 2 * (b % 2) + o for o in (0, 1, 4, 5)),
}


class InterleavedTransposedStore(TileStore):
    """An 8-bit M-major ``TileStore`` written with ``stmatrix.trans`` (module docstring): tokens in the
    interleaved order within each 16. SM90, one warpgroup (or warpgroups stacked on M) per epilogue
    subtile, subtile N % 32 == 0."""

    def __init__(self, name, slots="a"):
        super().__init__(name)
        self.slots = slots

    def config_key(self):
        return (*super().config_key(), self.slots)

    def store_setup(self, gemm, params, smem_tensor, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl,
                    varlen_manager, tidx):
        dtype = getattr(gemm, self._dtype_gemm_attr())
        layout = getattr(gemm, self._layout_gemm_attr())
        epi_m, epi_n = cute.size(smem_tensor, mode=[0]), cute.size(smem_tensor, mode=[1])
        assert gemm.arch == 90 and dtype.width == 8 and layout.is_m_major_c(), \
            f"{self.name}: an 8-bit M-major output on SM90"
        assert gemm.atom_layout_mnk[1] == 1 and epi_m == 64 * gemm.atom_layout_mnk[0] and epi_n % 32 == 0, \
            f"{self.name}: warpgroups stacked on M, epilogue subtile ({epi_m}, {epi_n}) with N % 32 == 0"
        _, _, copy_out, pred = super().store_setup(gemm, params, smem_tensor, tiled_copy_r2s, tiled_copy_t2r,
                                                   tile_coord_mnkl, varlen_manager, tidx)
        # rank 4 for the driver's [None, None, None, stage]: a unit mode before (M, N, stage)
        staged = cute.make_tensor(smem_tensor.iterator, cute.prepend(smem_tensor.layout, cute.make_layout(1)))
        return (tiled_copy_r2s, staged, copy_out, pred)

    @cute.jit
    def store_convert(self, gemm, tRS_rAuxOut, sr_seed, tidx, tile_coord_mnkl, num_prev_subtiles, epi_idx):
        dtype = getattr(gemm, self._dtype_gemm_attr())
        pack = _PACK["e4m3" if const_expr(dtype == cutlass.Float8E4M3FN) else "e5m2"]
        nblk = cute.size(tRS_rAuxOut) // 4
        words = cute.make_rmem_tensor(nblk, Int32)
        for b in cutlass.range_constexpr(nblk):
            i0, i1, i2, i3 = _SLOTS[self.slots](b)
            words[b] = pack(tRS_rAuxOut[i0], tRS_rAuxOut[i2], tRS_rAuxOut[i1], tRS_rAuxOut[i3])
        return words

    @cute.jit
    def store_r2s(self, gemm, tiled_copy, frag_out, tRS_s_stage, tidx):
        # lane l addresses row l % 8 of matrix l // 8; matrix k of group g is 8-column block 4g + k, and
        # a .trans row is one feature: its 16 bytes are the warp's 16 tokens (rows 16 w ..)
        lane = tidx % 32
        m0 = (tidx // 32) * 16
        for g in cutlass.range_constexpr(cute.size(frag_out) // 4):
            n = (4 * g + lane // 8) * 8 + lane % 8
            addr = _shared_addr(elem_pointer(tRS_s_stage, (0, m0, n)))
            _stmatrix_x4_trans(addr, frag_out[4 * g], frag_out[4 * g + 1], frag_out[4 * g + 2], frag_out[4 * g + 3])
