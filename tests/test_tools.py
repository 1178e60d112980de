"""tools/: the parts that run without a GPU."""
import importlib.util
from pathlib import Path


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuning_table_reads_the_tuners_log():
    log = ("conv2d launches conv2d_gemm_cl_dw__bf16__3_3\n"
           "tuning conv2d_cl_dw (32, 64, 'torch.bfloat16', True): {'Config(block_m=64, block_n=64, block_k=64, "
           "num_warps=4, num_stages=3, split=30)': 0.0778, 'Config(block_m=64, block_n=64, block_k=64, num_warps=8, "
           "num_stages=3, split=30)': 0.0728}\n")
    assert _tool("tuning_table").table(log).splitlines() == [
        "conv2d_cl_dw (32, 64, 'torch.bfloat16', True)",
        "   0 64,64,64,4,3,30                   77.8 us",
        "  *1 64,64,64,8,3,30                   72.8 us",
    ]
