"""npuserve: engine."""
