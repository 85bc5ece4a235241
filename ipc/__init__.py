"""npuserve: ipc."""
