"""The exit statuses of the servers (`npuserve serve`, `balance`, `http`): what systemd and scripts branch on.

0 is a clean stop (SIGTERM/SIGINT). A unit restarts on 1, 3 and 4 and gives up
on 2, which a restart cannot fix (engine/deploy/npuserve@.service)."""

from __future__ import annotations

EXIT_STARTUP = 1  # cannot start: an endpoint in use, unreadable keys, a worker that fails to come up
EXIT_CONFIG = 2  # the configuration is invalid or does not fit the model
EXIT_UNRECOVERABLE = 3  # serving became impossible: every chip out of service
EXIT_INTERNAL = 4  # a bug: the core's state can no longer be trusted
