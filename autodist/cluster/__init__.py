"""Tools for the clusters AutoDist runs on (emulated clusters on one machine)."""
