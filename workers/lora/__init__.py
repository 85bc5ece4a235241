"""LoRA adapters on the worker side: the adapter package format, its maker, and the per-lane low-rank product.

Workers never import `engine`; the daemon's adapter gate imports the format
checks from here (as it does the model package's).
"""
