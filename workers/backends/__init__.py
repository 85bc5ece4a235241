"""npuserve: workers/backends."""
