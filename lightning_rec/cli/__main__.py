"""`python -m lightning_rec.cli ...`: the same as `lightning-rec ...`."""

from lightning_rec.cli.commands import main

main()
