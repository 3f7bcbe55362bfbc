"""Layerwise transfer, one job per engine step: a receive thread reads layers ahead of compute
(load.py), a send thread copies each layer into its object image after compute and a write
thread writes the images and runs the commits (save.py, commit.py); the planner chooses how
loads read (planner.py). Map: docs/architecture.md."""
