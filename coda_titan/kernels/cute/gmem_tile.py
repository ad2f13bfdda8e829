"""A tile-sized epilogue input read from global memory straight into registers, one subtile ahead (SM90).

quack's epilogue inputs (the GEMM's C, ``TileLoad``) travel by TMA into a ring of shared-memory stages
and from there into registers. B3 reads ``a`` (the (gate, up) pre-activations, 8 KiB a 64 x 32
subtile) that way, and the ring costs the mainloop its A/B stages: with the overlapped epilogues B3
keeps 4 A/B stages against 2 C stages a warpgroup, and its mainloop waits on its operands for half of
its samples (docs/fp8.md, "B3's time, profiled"); giving C's stages to the mainloop made it slower,
because C's loads then arrive late (``probe_fp8_configs_b3_stages_…json``).

``GmemTileLoad`` takes C's place as a named epilogue operand with no shared memory at all: each thread
loads its own fragment of the subtile (the accumulator's layout, pairs of adjacent columns: 8 bytes of
fp32, 4 of bf16)
with plain global loads into registers, and issues the next subtile's loads before the current one's
arithmetic, into a second register buffer, so each subtile's data has had the previous subtile's
epilogue to arrive. A tile's first subtile is loaded when its epilogue begins. The fragment is the one
quack's own C path hands the epilogue (``epilog_smem_load_and_partition``: the same tiled copy over the
accumulator's copy atom, its universal copy widened to 64 bits), read from the tile in global memory
instead of a stage, so the epilogue function sees the same values in the same order.

Host side it is a ``TileLoad`` (the same argument schema: an (m, n) tile of the GEMM's output shape);
it declares no shared memory, no TMA atom and no load-pipeline stage.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import const_expr
from quack.epilogue.ops import EpiSmemBytes, TileLoad


class _State(NamedTuple):
    tiled_copy: object  # the universal-copy tiled copy over the accumulator's fragment
    tSR_g: object  # this thread's fragment of every subtile in global memory: (CPY, CPY_M, CPY_N, rest_M, rest_N)
    bufs: tuple  # two register fragments (tRS_rD's layout), alternating by subtile
    views: tuple  # their retiled views, the copy's destinations
    order: object  # the kernel's subtile order: (rest_M, rest_N) -> index


class GmemTileLoad(TileLoad):
    """An (m, n) tile input of 16- or 32-bit elements (``a``'s float32 view for B3, B2's bf16 residual
    gradient and X) loaded from global memory into registers, one subtile ahead; the epilogue function
    receives it per element as it would ``c`` (widened to fp32)."""

    def param_fields(self):
        return [(self.name, object, None)]

    def to_params(self, gemm, args):
        tensor = getattr(args, self.name)
        if tensor.element_type.width not in (16, 32):
            raise ValueError(f"GmemTileLoad {self.name!r}: 16- or 32-bit elements, got {tensor.element_type}")
        return {self.name: tensor}

    def is_tile_load(self):
        return False

    def smem_bytes(self, arg_tensor, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
        return EpiSmemBytes()

    def smem_struct_field(self, gemm, params):
        return None

    def get_smem_tensor(self, gemm, params, storage_epi):
        return None

    def tma_atoms(self, gemm, params):
        return []

    def load_g2s_copy_fn(self, gemm, params, smem_tensor, tile_coord_mnkl, varlen_manager, epi_pipeline):
        return None

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        assert gemm.arch == 90, "GmemTileLoad: the SM90 epilogue path only"
        assert ctx.tRS_rD_layout is not None
        tile_mn = gemm.cta_tile_shape_mnk[:2]
        m_tensor = param if const_expr(cute.rank(param) == 2) else param[None, None, ctx.batch_idx]
        g_tile = cute.local_tile(m_tensor, tile_mn, (ctx.tile_coord_mnkl[0], ctx.tile_coord_mnkl[1]))
        g_subtiles = cute.flat_divide(g_tile, gemm.epi_tile)  # (epi_M, epi_N, rest_M, rest_N)
        # (one load per column pair of the fragment: 64 bits of f32, 32 of bf16)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), param.element_type,
                                   num_bits_per_copy=2 * param.element_type.width)
        tiled_copy = cute.make_tiled_copy_S(atom, gemm.epilog_smem_copy_atom(gemm.tiled_mma))
        thr_copy = tiled_copy.get_slice(ctx.tidx)
        tSR_g = thr_copy.partition_S(g_subtiles)
        bufs = (cute.make_rmem_tensor(ctx.tRS_rD_layout, param.element_type),
                cute.make_rmem_tensor(ctx.tRS_rD_layout, param.element_type))
        views = (thr_copy.retile(bufs[0]), thr_copy.retile(bufs[1]))
        rest = cute.zipped_divide(cute.make_layout(tile_mn), gemm.epi_tile).shape[1]
        order = cute.make_ordered_layout(rest, order=(0, 1) if const_expr(gemm.epi_m_major) else (1, 0))
        state = _State(tiled_copy, tSR_g, bufs, views, order)
        self._load(state, 0)
        return state

    def _load(self, state, idx):
        """Issue subtile ``idx``'s loads (in the kernel's subtile order) into buffer idx % 2."""
        m, n = state.order.get_hier_coord(idx)
        cute.copy(state.tiled_copy, state.tSR_g[None, None, None, m, n], state.views[idx % 2])

    @cute.jit
    def load_s2r(self, gemm, param, state, stage_idx):
        pass

    def begin_loop(self, gemm, state, epi_coord):
        idx = state.order(epi_coord)  # (a static index: the kernel unrolls its subtile loop)
        if const_expr(idx + 1 < cute.size(state.order)):
            self._load(state, idx + 1)
        return state.bufs[idx % 2]
