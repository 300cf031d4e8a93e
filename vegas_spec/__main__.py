"""`python -m vegas_spec`: the `vegas` command."""

from vegas_spec.cli import console

console()
