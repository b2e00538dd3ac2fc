"""The README's kernel example runs as written (on a CPU through the Triton interpreter), and moves real bytes."""

import os
import re


def test_readme_kernel_example_runs_as_written():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Using the kernels from any engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    import torch

    host, slots = scope["host"], scope["slots"]
    if scope["load_stream"] is not None:
        torch.cuda.synchronize()
    k, v = scope["k_buffers"], scope["v_buffers"]
    assert torch.equal(host[0, 3, 0], k[0][slots[:16]].cpu())  # layer 0, block 3 = page 0, K
    assert torch.equal(host[5, 7, 1], v[5][slots[32:48]].cpu())  # layer 5, block 7 = page 2, V
