"""kvtier storage media: host blocks on disk (and, next, in a remote store), knowing neither the engine nor the
kernels: they move bytes with their identity (fingerprint, namespace, chain hash, tokens) and verify them."""

from kvtier.storage.block_file import BlockFile, BlockFileError
from kvtier.storage.block_format import BlockHeader, fingerprint
from kvtier.storage.ssd_store import Block, SsdStore

__all__ = ["BlockFile", "BlockFileError", "BlockHeader", "fingerprint", "Block", "SsdStore"]
