"""Helpers that build real infrastructure on one machine for labkit's tests and for trying it
out (see docs/slurm.md, "Try it on one machine")."""
