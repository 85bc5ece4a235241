"""npuserve: engine/core/kv."""
