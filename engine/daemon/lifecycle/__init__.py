"""The daemon as a system service: signals into the loop, systemd notify and watchdog, the stop-signal drain,
and loop-stall detection."""
