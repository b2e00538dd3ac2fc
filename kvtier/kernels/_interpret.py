"""The Triton interpreter where CUDA is absent, without changing the process's environment.

Triton decides interpreter or compiler when a function is decorated (its own library functions, ``tl.cdiv`` and
the like, at ``import triton``) and checks the same switch at run time. Where CUDA is absent and
``TRITON_INTERPRET`` is unset, the variable is set while ``triton`` and kvtier's kernels are imported, Triton's
in-process knob is then turned on (no compiled Triton kernel can run without CUDA anyway) and the variable is
removed again: child processes and other readers of the environment see it as it was.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

ENV = "TRITON_INTERPRET"


@contextlib.contextmanager
def interpreter_for_import():
    if torch.cuda.is_available() or ENV in os.environ:
        yield
        return
    if "triton" in sys.modules:  # its library functions were decorated for the compiler: too late to interpret
        yield
        return
    os.environ[ENV] = "1"
    try:
        from triton import knobs  # decorates triton.language's functions for the interpreter

        yield
        knobs.runtime.interpret = True  # from now on regardless of the environment
    finally:
        del os.environ[ENV]
