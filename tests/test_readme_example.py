"""The README's examples run as written (on a CPU through the Triton interpreter) and move real bytes; the Python
versions it claims are pyproject's and CI's."""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _example(heading: str) -> str:
    section = _readme().split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_kernel_example_runs_as_written():
    scope: dict = {}
    exec(compile(_example("## Using the kernels from any engine"), "README.md", "exec"), scope)  # noqa: S102
    import torch

    host, slots = scope["host"], scope["slots"]
    if scope["load_stream"] is not None:
        torch.cuda.synchronize()
    k, v = scope["k_buffers"], scope["v_buffers"]
    assert torch.equal(host[0, 3, 0], k[0][slots[:16]].cpu())  # layer 0, block 3 = page 0, K
    assert torch.equal(host[5, 7, 1], v[5][slots[32:48]].cpu())  # layer 5, block 7 = page 2, V


def test_readme_tier_example_runs_as_written(capsys):
    """There was no KVTier example, only the kernels'."""
    scope: dict = {}
    exec(compile(_example("## Using the tier from any engine"), "README.md", "exec"), scope)  # noqa: S102
    assert capsys.readouterr().out.strip() == "6 pages held"
    assert scope["task"].num_pages == 6  # the load moved the 6 held pages (its own assert compared their bytes)
    k = scope["kv"].buffers[0]
    assert not k[scope["other"][96:]].equal(k[scope["slots"][96:]])  # the unheld tail was not copied


def test_the_python_versions_claimed_agree():
    """README and pyproject said ">= 3.10", which the pinned set-up cannot install; CI resolved one version."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    claimed = [c.rsplit(" ", 1)[1] for c in project["classifiers"]
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert claimed == ["3.11", "3.12", "3.13"]
    assert project["requires-python"] == f">={claimed[0]}"
    readme = _readme()
    assert f"Python {', '.join(claimed[:-1])} or {claimed[-1]} (CI resolves this set-up on PyPI for each" in readme
    assert ">= 3.10" not in readme and "3.10 lacks the pinned numpy" in readme
    from kvtier.commands.doctor import PYTHONS

    assert PYTHONS == (tuple(map(int, claimed[0].split("."))), tuple(map(int, claimed[-1].split("."))))
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert '"Programming Language :: Python :: \\(3\\.[0-9]*\\)"' in ci  # CI resolves each classifier's version
