"""Store backends behind one batch session protocol (see base.py)."""
