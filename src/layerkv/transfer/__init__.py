"""Layerwise transfer: a receive thread that reads layers ahead of compute and a send thread
that writes each layer after compute, one job per engine step (see load.py, save.py)."""
