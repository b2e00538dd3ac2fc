"""kvtier transfer kernels: move paged KV between an engine's device buffers and host blocks.

Torch and Triton only; no engine is imported here, so any engine can call these with plain tensors::

    kv = PagedKV.mha(k_buffers, v_buffers, page_size=16)       # once per KV pool
    store_pages(kv, host_blocks, slots, block_ids)             # D2H, all layers, one launch
    load_pages(kv, host_blocks, slots, block_ids, layers=3)    # H2D, one layer
    StagedTransfer(kv, host_blocks).store(slots, block_ids)    # gather + copy engine
    copy = DirectCopy(kv, host_blocks, slots, block_ids, to_host=False)   # checked once ...
    copy.launch(layers=3)                                      # ... launched per layer (a layerwise load)

On a machine without CUDA the kernels run on CPU tensors through the Triton interpreter, chosen for kvtier's
kernels only (the process's ``TRITON_INTERPRET`` is left as it is). ``check=False`` skips the index range checks;
``KVTIER_CHECK=1`` forces them on every launch (debugging). The tuned constants (tiles, warps, staging buffers,
programs) default to the values measured best; a benchmark that sweeps them passes ``tuning=Tuning(...)``.
"""

from kvtier.kernels._interpret import interpreter_for_import

with interpreter_for_import():
    from kvtier.kernels.paged_kv import PagedKV  # noqa: E402
    from kvtier.kernels.reference import copy_pages_ref  # noqa: E402
    from kvtier.kernels.staged import StagedTransfer  # noqa: E402
    from kvtier.kernels.staged_copy import StagedCopy  # noqa: E402
    from kvtier.kernels.transfer import DirectCopy, load_pages, store_pages  # noqa: E402
    from kvtier.kernels.tuning import Tuning  # noqa: E402

__all__ = ["PagedKV", "store_pages", "load_pages", "DirectCopy", "copy_pages_ref", "StagedTransfer",
           "StagedCopy", "Tuning"]
