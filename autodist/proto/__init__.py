"""Generated protocol buffer modules (run ``scripts/gen_protos.py`` to refresh)."""
