"""npuserve: engine/core."""
