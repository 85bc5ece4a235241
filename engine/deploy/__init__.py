"""Files an installation copies: the systemd template unit and an example board config."""
