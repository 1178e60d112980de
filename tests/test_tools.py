"""tools/: the parts that run without a GPU."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
TOOLS = ROOT / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuning_table_reads_the_tuners_log():
    log = ("conv2d backward launches conv2d_gemm_cl_dw__bf16__3_3\n"
           "tuning conv2d_dw (32, 64, 'torch.bfloat16', True): {\"Choice(algorithm='cl_dw', config=GemmConfig("
           "block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, split=30))\": 0.0778, \"Choice("
           "algorithm='tma_dw', config=GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=8, num_stages=3, "
           "split=30))\": 0.0728}\n"
           "tuning batch_norm_train_forward_grouped (32, 2048, 49, 'torch.float32'): {'GroupedConfig(block_b=32, "
           "block_j=256, channels=4, num_warps=8)': 0.0131}\n")
    assert _tool("tuning_table").table(log).splitlines() == [
        "conv2d_dw (32, 64, 'torch.bfloat16', True)",
        "   0 cl_dw 64,64,64,4,3,30             77.8 us",
        "  *1 tma_dw 64,64,64,8,3,30            72.8 us",
        "batch_norm_train_forward_grouped (32, 2048, 49, 'torch.float32')",
        "  *0 32,256,4,8                        13.1 us",
    ]


def test_step_profile_groups_kernels_by_name():
    group_of = _tool("resnet_step_profile").group_of
    assert group_of("batch_norm2d_train_backward_dx_entry_point") == "batch norm"
    assert group_of("conv2d_gemm_cl_dx_entry_point") == "conv dx"
    assert group_of("conv2d_pointwise_dw_entry_point") == "conv dw"
    assert group_of("sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16") == "conv dw"
    assert group_of("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>") == "layout copy"
    assert group_of("conv2d_gemm_cl_forward_entry_point") == "conv fwd"
    assert group_of("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == "other"


def test_kernel_sass_counts_opcodes_of_a_compiled_kernel():
    tool = _tool("kernel_sass")
    listing = ("        /*0040*/                   LDG.E.U16 R3, desc[UR4][R4.64] ;\n"
               "        /*0050*/              @!P0 LDG.E R5, desc[UR4][R6.64+0x4] ;\n"
               "        /*10060*/                  FFMA R7, R3, R5, R7 ;\n")  # past 64 KiB of code
    assert tool.opcode_counts(listing) == {"LDG": 2, "FFMA": 1}
    assert tool.registers(" Function k:\n  REG:40 STACK:0 SHARED:0") == 40
    report = tool.main(["Conv2dDwReduce", "fp32", "False", "1", "1", "8", "256"]).splitlines()
    assert report[0] == "conv2d_dw_reduce__fp32__0__1__1__8__256"
    count, regs = re.fullmatch(r"(\d+) instructions, (\d+) registers per thread", report[1]).groups()
    assert int(count) > 0 and int(regs) > 0
    assert "LDG" in report[2] and "STG" in report[2]  # the partial rows read, dw written
    assert tool.memory_counts(listing) == {"LDG.E.U16": 1, "LDG.E": 1}
    assert ".128" not in report[3]  # assuming nothing of the pointers: no 16-byte vectors
    # Specialised as an aligned launch, in a process of its own (this one runs the interpreter).
    aligned = subprocess.run([sys.executable, str(TOOLS / "kernel_sass.py"), "Conv2dDwReduce", "fp32", "False", "1",
                              "1", "8", "256", "--aligned", "--size", "N_DW=112"], capture_output=True, text=True,
                             check=True, env=dict(os.environ, TRITON_INTERPRET="0"), cwd=ROOT).stdout.splitlines()
    assert aligned[3].startswith("memory: ") and "LDG.E.128" in aligned[3]


def test_ship_tuning_keeps_the_current_kernels_choices_only(tmp_path):
    from nnkernels import tuning

    tool = _tool("ship_tuning")
    current = f"|kernels {tuning.kernels_fingerprint('conv2d_dw')}|{tuning.CHOICES_FORMAT}"
    cache = tmp_path / "tuning.json"
    cache.write_text(json.dumps({"conv2d_dw|(1,)|NVIDIA H200|triton 3.6.0" + current: {"algorithm": "tma_dw"},
                                 "conv2d_dw|(1,)|NVIDIA H200|triton 3.6.0|kernels 0123|choices 2": {"x": 1}}))
    into = tmp_path / "tuned.json"
    assert tool.main([str(cache), "--into", str(into)]).endswith("1 choices")
    assert list(json.loads(into.read_text())) == ["conv2d_dw|(1,)|NVIDIA H200|triton 3.6.0" + current]


def test_compare_bench_lists_the_rows_that_moved(tmp_path):
    header = "suite,case,dtype,direction,ours_ms,torch_ms,speedup,unit,ours_rate,torch_rate\n"
    before, after = tmp_path / "before.csv", tmp_path / "after.csv"
    before.write_text(header + "s,a,bf16,forward,2.0,2.0,1.000,,,\n" + "s,b,bf16,forward,1.0,1.0,1.000,,,\n"
                      + "s,c,bf16,forward,1.0,1.0,1.000,,,\n")
    after.write_text(header + "s,a,bf16,forward,1.0,2.0,2.000,,,\n" + "s,b,bf16,forward,1.0,1.3,1.300,,,\n"
                     + "s,d,bf16,forward,1.0,1.0,1.000,,,\n")
    report = _tool("compare_bench").main([str(before), str(after), "--noise", "0.1"]).splitlines()
    # b: our time the same, PyTorch's moved; a: ours twice as fast. Slowest first.
    assert report[2] == "| b | bf16 | forward | 1.0000 | 1.0000 | 1.00 | 1.00x | 1.30x |"
    assert report[3] == "| a | bf16 | forward | 2.0000 | 1.0000 | 2.00 | 1.00x | 2.00x |"
    assert report[5].startswith("2 rows in both runs, 2 moved by more than 10%; geometric means: speed 1.414")
    assert report[6:] == ["only before: c bf16 forward", "only after: d bf16 forward"]


def test_ttir_digests_see_the_program_not_its_names_and_compare_runs(tmp_path):
    """Source locations, the names Triton gives values (after Python variables) and the order constants are
    hoisted in are not the program; an operation is."""
    tool = _tool("ttir_digests")
    ttir = ('#loc = loc("a.py":3:1)\n'
            'tt.func @k(%x: !tt.ptr<f32> loc("x"(#loc))) {\n'
            '  %c8_i32 = arith.constant 8 : i32 loc(#loc1)\n'
            '  %c1_i32 = arith.constant 1 : i32 loc(#loc1)\n'
            '  %sum = arith.addi %c8_i32, %c1_i32 : i32 loc(#loc2)\n'
            '  %b = arith.muli %sum, %sum : i32 loc(callsite(#loc3 at #loc4))\n}')
    renamed = (ttir.replace("%sum", "%total").replace("%b ", "%b_3 ").replace('"a.py":3:1', '"b.py":9:1')
               .replace("  %c8_i32 = arith.constant 8 : i32 loc(#loc1)\n  %c1_i32 = arith.constant 1 : i32 loc(#loc1)",
                        "  %c1_i32 = arith.constant 1 : i32 loc(#loc5)\n  %c8_i32 = arith.constant 8 : i32 loc(#loc1)"))
    assert tool.ttir_digest(ttir) == tool.ttir_digest(renamed)
    assert tool.ttir_digest(ttir) != tool.ttir_digest(ttir.replace("arith.muli", "arith.addi"))
    assert tool.ttir_digest(ttir) != tool.ttir_digest(ttir.replace("constant 8", "constant 9"))
    # MLIR numbers two sibling loops' values from the same count; a helper's variable names them apart instead.
    loops = ("tt.func @k(%x: i32) {\n"
             "  %0 = scf.for %i = %x to %x step %x iter_args(%a = %x) -> (i32) : i32 {\n"
             "    %7 = arith.addi %a, %i : i32\n    scf.yield %7 : i32\n  }\n"
             "  %1 = scf.for %i = %x to %x step %x iter_args(%a = %0) -> (i32) : i32 {\n"
             "    %7 = arith.muli %a, %i : i32\n    scf.yield %7 : i32\n  }\n}")
    first, second = loops.split("  %1 = ")
    named = first.replace("%7", "%row") + "  %1 = " + second.replace("%7", "%row_2")
    assert tool.ttir_digest(loops) == tool.ttir_digest(named)
    assert tool.ttir_digest(loops) != tool.ttir_digest(loops.replace("arith.muli %a, %i", "arith.muli %i, %a"))
    built = tool.shipped_kernels({"Conv2dGroupedWeight", "BatchNorm2dPartialStats"})
    assert {kid.split("__")[0] for kid in built} == {"conv2d_grouped_weight", "batch_norm2d_partial_stats"}
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"a": "1", "b": "2", "c": "3"}))
    after.write_text(json.dumps({"a": "1", "b": "5", "d": "4"}))
    assert tool.main(["--compare", str(before), str(after)]).splitlines() == [
        "2 kernels in both, 1 compile differently, 2 in one only", "  differs: b", "  one only: c", "  one only: d"]


def test_the_shipped_table_holds_only_choices_of_the_current_kernels():
    """Every choice in `nnkernels/tuned.json` names the current code of its layer's kernels: a kernel changed
    without a new tuning run on the GPU drops its layer's entries (`tools/ship_tuning.py` does), leaving none that
    no lookup could match."""
    from nnkernels import tuning

    table = json.loads(tuning.SHIPPED_TABLE.read_text())
    assert table
    assert _tool("ship_tuning").current_entries(table) == table


def test_host_profile_counts_the_stubbed_launches_of_a_case():
    """In a process of its own: the tool stubs every launch out for the rest of its process."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "tools" / "host_profile.py"),
                           "--stub-launches", "--calls", "20", "--top", "5", "avg_pool2d 3x3 s2 p1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"avg_pool2d 3x3 s2 p1: nnkernels [\d.]+ µs per forward \+ backward \(2 launches, stubbed\)",
                     done.stdout), done.stdout[:500]
    assert "function calls" in done.stdout


def test_grouped_convs_takes_the_grouped_layers_only():
    from nnkernels.layer_calls import ConvShape

    def shape(c_in, c_out, groups):
        return ConvShape((2, c_in, 8, 8), (c_out, c_in // groups, 3, 3), (1, 1), (1, 1), (1, 1), groups, False)

    dense, grouped, depthwise, multiplier = shape(16, 16, 1), shape(16, 16, 4), shape(16, 16, 16), shape(16, 32, 16)
    assert _tool("grouped_convs").grouped_layers([dense, grouped, depthwise, multiplier]) == [grouped, multiplier]


def test_conv_candidates_takes_a_layers_options():
    """The GPU timing aside (it needs CUDA), its options parse; what it times is `conv.choice_calls`, tested with
    the functional op."""
    out = subprocess.run([sys.executable, str(TOOLS / "conv_candidates.py"), "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert all(option in out for option in ("--kernel", "--groups", "--channels-last", "--count"))
