"""npuserve: workers."""
