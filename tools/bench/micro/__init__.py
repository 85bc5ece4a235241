"""In-process measurements of one part (`npuserve bench micro NAME`): transports, KV paths, backends, clients."""
