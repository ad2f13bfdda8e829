"""Transposed (M-major) 8-bit epilogue outputs stored with ``stmatrix.trans`` (SM90).

quack 0.6.5 stores an 8-bit M-major output through its universal register-to-shared copy, one byte
per instruction: a WGMMA accumulator fragment gives each thread two adjacent columns of rows r and
r + 8 (r = lane / 4), and no two adjacent rows. ``TransposedNarrowStore`` converts each 8-column
block's four values to one 32-bit word of bytes [(r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)], then
fetches the words of the two lanes that hold tokens 2r and 2r + 1 (rows 2r, 2r + 1 below 8, else their
"+ 8" rows) with two ``shfl.sync.idx`` and assembles with one ``prmt`` the 16-bit units (2r, 2r + 1) of
columns c and c + 1: the 8 x 8 b16 fragment ``stmatrix.trans`` stores, one 16-byte row (16 tokens of one
feature, in order) per lane address, four 8-column blocks per instruction. The tokens land in their
natural order, so the output is the universal copy's byte for byte.

Where the subtile's geometry does not fit (an SM90 WGMMA warpgroup per 64 rows, warpgroups stacked on
M, a subtile N that is a multiple of 32), the store is quack's own (``TileStore``). Measured in
``scripts/probes/fp8_trans_store.py`` (docs/fp8.md, "B3's time, split").
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


def _asm_i32(asm: str, constraints: str, args, side_effects=False, *, loc=None, ip=None):
    return llvm.inline_asm(T.i32(), [a.ir_value(loc=loc, ip=ip) for a in args], asm, constraints,
                           has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _pack_op(kind: str):
    """f32 (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1) -> one word, those bytes from low to high
    (``cvt ... d, a, b`` puts a in the high byte of d)."""
    asm = ("{.reg .b16 l, h;\n"
           f"cvt.rn.satfinite.{kind}x2.f32 l, $2, $1;\n"
           f"cvt.rn.satfinite.{kind}x2.f32 h, $4, $3;\n"
           "mov.b32 $0, {l, h};}")

    @dsl_user_op
    def pack(r0c0: Float32, r0c1: Float32, r8c0: Float32, r8c1: Float32, *, loc=None, ip=None) -> Int32:
        return Int32(_asm_i32(asm, "=r,f,f,f,f", [Float32(v) for v in (r0c0, r0c1, r8c0, r8c1)], loc=loc, ip=ip))

    return pack


_PACK = {"e4m3": _pack_op("e4m3"), "e5m2": _pack_op("e5m2")}


@dsl_user_op
def _shfl_idx(w: Int32, src: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm_i32("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", [Int32(w), Int32(src)], True,
                          loc=loc, ip=ip))


@dsl_user_op
def _prmt(a: Int32, b: Int32, sel: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm_i32("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [Int32(a), Int32(b), Int32(sel)], loc=loc, ip=ip))


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


class TransposedNarrowStore(TileStore):
    """An 8-bit M-major ``TileStore`` written with ``stmatrix.trans`` where the subtile fits (module
    docstring), quack's universal copy elsewhere."""

    def _fast_attr(self):
        return f"_coda_tstore_fast_{self.name}"

    def store_setup(self, gemm, params, smem_tensor, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl,
                    varlen_manager, tidx):
        setup = super().store_setup(gemm, params, smem_tensor, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl,
                                    varlen_manager, tidx)
        epi_m, epi_n = cute.size(smem_tensor, mode=[0]), cute.size(smem_tensor, mode=[1])
        fast = (gemm.arch == 90 and getattr(gemm, self._dtype_gemm_attr()).width == 8
                and getattr(gemm, self._layout_gemm_attr()).is_m_major_c() and gemm.atom_layout_mnk[1] == 1
                and epi_m == 64 * gemm.atom_layout_mnk[0] and epi_n % 32 == 0)
        setattr(gemm, self._fast_attr(), fast)  # read by store_convert / store_r2s of the same trace
        if not fast:
            return setup
        tiled_copy, _, copy_out, pred = setup
        # rank 4 for the driver's [None, None, None, stage]: a unit mode before (M, N, stage)
        staged = cute.make_tensor(smem_tensor.iterator, cute.prepend(smem_tensor.layout, cute.make_layout(1)))
        return (tiled_copy, staged, copy_out, pred)

    @cute.jit
    def store_convert(self, gemm, tRS_rAuxOut, sr_seed, tidx, tile_coord_mnkl, num_prev_subtiles, epi_idx):
        if const_expr(not getattr(gemm, self._fast_attr())):
            frag = TileStore.store_convert(self, gemm, tRS_rAuxOut, sr_seed, tidx, tile_coord_mnkl, num_prev_subtiles,
                                           epi_idx)
        else:
            e4m3 = getattr(gemm, self._dtype_gemm_attr()) == cutlass.Float8E4M3FN
            pack = _PACK["e4m3" if const_expr(e4m3) else "e5m2"]
            lane = tidx % 32
            r, q = lane // 4, lane % 4
            src0 = (((2 * r) % 8) * 4) + q  # the lanes holding tokens 2r and 2r + 1 (of this warp's 16)
            src1 = (((2 * r + 1) % 8) * 4) + q
            sel = cutlass.select_(r >= 4, Int32(0x7362), Int32(0x5140))  # their "+ 8" bytes, or their own rows'
            nblk = cute.size(tRS_rAuxOut) // 4
            frag = cute.make_rmem_tensor(nblk, Int32)
            for b in cutlass.range_constexpr(nblk):  # slots 4b ..: (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)
                w = pack(tRS_rAuxOut[4 * b], tRS_rAuxOut[4 * b + 1], tRS_rAuxOut[4 * b + 2], tRS_rAuxOut[4 * b + 3])
                frag[b] = _prmt(_shfl_idx(w, src0), _shfl_idx(w, src1), sel)
        return frag

    @cute.jit
    def store_r2s(self, gemm, tiled_copy, frag_out, tRS_s_stage, tidx):
        if const_expr(not getattr(gemm, self._fast_attr())):
            TileStore.store_r2s(self, gemm, tiled_copy, frag_out, tRS_s_stage, tidx)
        else:
            # lane l addresses row l % 8 of matrix l // 8; matrix k of group g is 8-column block 4g + k, and
            # a .trans row is one feature: its 16 bytes are the warp's 16 tokens (rows 16 w ..)
            lane = tidx % 32
            m0 = (tidx // 32) * 16
            for g in cutlass.range_constexpr(cute.size(frag_out) // 4):
                n = (4 * g + lane // 8) * 8 + lane % 8
                addr = _shared_addr(elem_pointer(tRS_s_stage, (0, m0, n)))
                _stmatrix_x4_trans(addr, frag_out[4 * g], frag_out[4 * g + 1], frag_out[4 * g + 2],
                                   frag_out[4 * g + 3])
