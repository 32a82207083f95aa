"""`python -m retention.cli`: the same command as the `retention` script."""

from retention.cli import main

main(prog_name="retention")
