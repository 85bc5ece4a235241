"""npuserve: tools."""
