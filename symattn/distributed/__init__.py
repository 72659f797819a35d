"""Context parallelism: a generated module's cores run over a ring of ranks, each holding a block of the sequence."""

from symattn.distributed.context import context_parallel

__all__ = ["context_parallel"]
