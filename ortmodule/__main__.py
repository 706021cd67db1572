"""`python -m ortmodule export|serve|...`: the `ortmodule` command, also where its console script is
not on the PATH (the package on PYTHONPATH rather than installed, say)."""

from .cli import ortmodule

ortmodule()
