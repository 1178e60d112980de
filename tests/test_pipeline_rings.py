"""No product of ours reads a shared-memory ring slot that the loop may refill while it reads (see
`pipeline_rings`): the split weight-gradient kernels with their bias sums, compiled for sm_90 as the
GPU's launches specialise them, in the tiles tuning offers them (128 x 128 with 8 warps and 3 stages,
64 x 64 with 4 warps and 4 stages), for each element type and product precision they serve.

The check needs only Triton's compiler, so it runs on the CPU too. Each kernel's TTGIR must show
pipelined rings, and some variant of each a ring that a product reads, so a change in the IR's text
cannot make the check pass by finding nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_rings import Ring, async_products, rings

HERE = Path(__file__).parent
TILES = ((128, 128, 8, 3), (64, 64, 4, 4))
# class -> its module
BIAS_SUM_KERNELS = {
    "Conv2dPointwiseDw": "nnkernels.ops.conv2d.pointwise",
    "Conv2dGemmDw": "nnkernels.ops.conv2d.gemm_dw",
    "Conv2dGemmClDw": "nnkernels.ops.conv2d.channels_last",
    "Conv2dTmaDw": "nnkernels.ops.conv2d.tma_dw",
    "Conv2dWinogradProducts": "nnkernels.ops.conv2d.winograd_products",
}
VARIANTS = (("float32", True), ("float32", False), ("bfloat16", True))


def specs(class_name):
    """[module, class, constants, dtype, warps, stages] of each variant of `class_name` with bias sums."""
    found = []
    for dtype, tf32 in VARIANTS:
        for block_m, block_n, warps, stages in TILES:
            constants = {"HAS_BIAS": True, "TF32": tf32, "BLOCK_M": block_m, "BLOCK_N": block_n}
            if class_name != "Conv2dTmaDw":  # its BLOCK_K is the box's pixels, not a tile's reduction
                constants["BLOCK_K"] = 32 if dtype == "float32" else 64
            found.append([BIAS_SUM_KERNELS[class_name], class_name, constants, dtype, warps, stages])
    return found


def compiled_rings(batch):
    """`pipeline_rings`' report of each spec, compiled in a child process that runs Triton compiled."""
    done = subprocess.run([sys.executable, str(HERE / "pipeline_rings.py")], input=json.dumps(batch), text=True,
                          capture_output=True, env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))},
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("class_name", list(BIAS_SUM_KERNELS))
def test_no_ring_is_refilled_while_a_product_may_read_it(class_name):
    batch = specs(class_name)
    read_by_products = False
    for spec, report in zip(batch, compiled_rings(batch)):
        found = [Ring(**ring) for ring in report["rings"]]
        assert found, f"{spec}: no pipelined ring found in the TTGIR"
        read_by_products |= any(ring.feeds_dot for ring in found)
        racing = [ring for ring in found if report["async"] and ring.feeds_dot and ring.ahead >= ring.slots]
        assert not racing, f"{spec}: a product reads a ring refilled while it may still read it: {racing}"
    assert read_by_products, f"{class_name}: no variant's TTGIR shows a ring that a product reads"


# Lines of Triton 3.6's sm_90 TTGIR of the bias-summing 1x1 dw as it was (bf16, 128 x 128, 8 warps, 3 stages),
# cut to what `rings` reads: the dy ring (2 slots, 2 copies ahead) feeds an async wgmma and registers.
RACING_TTGIR = """
    %dy_tile_48 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable> loc(#loc121)
    %x_tile_49 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared1, #smem, mutable> loc(#loc122)
    %dy_tile_70 = ttg.memdesc_index %dy_tile_48[%c0_i32] : !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable>
    %dy_tile_73 = ttg.async_copy_global_to_local %dy_tile_69, %dy_tile_70 mask %dbias_72 other %cst_1 : tensor<>
    %x_tile_87 = ttg.memdesc_index %x_tile_49[%c0_i32] : !ttg.memdesc<3x64x128xbf16, #shared1, #smem, mutable>
    %x_tile_90 = ttg.async_copy_global_to_local %x_tile_86, %x_tile_87 mask %dbias_89 other %cst_2 : tensor<>
    %dy_tile_116 = ttg.memdesc_index %dy_tile_48[%c1_i32] : !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable>
    %dy_tile_119 = ttg.async_copy_global_to_local %dy_tile_115, %dy_tile_116 mask %dbias_118 other %cst_1 : tensor<>
    %x_tile_133 = ttg.memdesc_index %x_tile_49[%c1_i32] : !ttg.memdesc<3x64x128xbf16, #shared1, #smem, mutable>
    %x_tile_136 = ttg.async_copy_global_to_local %x_tile_132, %x_tile_133 mask %dbias_135 other %cst_2 : tensor<>
    %dbias_138:10 = scf.for %dbias_146 = %first to %end_32 step %c1_i32 iter_args(%acc = %cst) -> () : i32 {
      %dy_tile_163 = ttg.memdesc_index %dy_tile_48[%dbias_161] : !ttg.memdesc<2x128x64xbf16, #shared, #smem>
      %dy_tile_164 = ttg.local_load %dy_tile_163 token %dy_tile_162 : !ttg.memdesc<128x64xbf16> -> tensor<>
      %x_tile_165 = ttg.memdesc_index %x_tile_49[%dbias_158] : !ttg.memdesc<3x64x128xbf16, #shared1, #smem>
      %acc_166 = ttng.warp_group_dot %dy_tile_163, %x_tile_165, %acc {inputPrecision = 0 : i32, isAsync = true}
      %acc_167:3 = ttng.warp_group_dot_wait %acc_166, %dy_tile_163, %x_tile_165 {pendings = 1 : i32} : tensor<>
"""


def test_rings_reads_the_racing_ttgir():
    assert rings(RACING_TTGIR) == [Ring(slots=2, ahead=2, feeds_dot=True, to_registers=True),
                                   Ring(slots=3, ahead=2, feeds_dot=True, to_registers=False)]
    assert async_products(RACING_TTGIR)
