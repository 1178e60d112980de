"""Every Python block of README.md runs as written (those marked as needing a GPU, only on one)."""
import re
from pathlib import Path

import pytest
import torch

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"(<!-- needs a GPU -->\n)?```python\n(.*?)```", README, re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    needs_gpu, code = BLOCKS[index]
    if needs_gpu and not torch.cuda.is_available():
        pytest.skip("this README block captures a CUDA graph: GPU only")
    exec(compile(code, f"README.md block {index}", "exec"), {})
