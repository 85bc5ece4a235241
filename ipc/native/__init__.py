"""C sources of the transport's optional fast paths (built and loaded by ipc.native_lib)."""
