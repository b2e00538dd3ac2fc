"""The ``kvtier`` command line's commands beyond argument parsing (:mod:`kvtier.cli` dispatches to them)."""
